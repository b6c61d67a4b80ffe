"""APE's attention temperature and scale on a run of each request's page-table entries: the
PyTorch reference against a float64 direct computation, the Triton kernels under the
interpreter against the reference, and the argument rules."""
from __future__ import annotations


import pytest
import torch
from kernel_cases import direct64, make_case, rel_err, tol

from lazyrag import kernels
from lazyrag.kernels import PageTable, reference

# Request 0 reads chunks [1, 0] (2 + 3 pages), request 1 [2, 2, 0] (4 + 4 + 3: one page at two
# deltas), request 2 nothing; then each its own pages. The runs: a middle run, every entry,
# and an empty one (lo == hi), or one before lo (lo > hi), or past the count.
PLAN = [[1, 0], [2, 2, 0], []]
RUNS = {
    "middle": [(1, 4), (2, 9), (0, 0)],
    "all": [(0, 99), (-3, 12), (0, 1)],
    "empty": [(3, 3), (7, 2), (5, 9)],
}
# (name, make_case kwargs): odd lengths, GQA 3 and 1, fp16 and fp32, two page sizes
CASES = [
    ("gqa3_f32", dict(seed=61, H=6, Hkv=2, dtype=torch.float32, plan=PLAN, q_lens=[5, 13, 3])),
    ("mha_ps32_f16", dict(seed=62, H=2, Hkv=2, PS=32, dtype=torch.float16, plan=PLAN, q_lens=[9, 1, 2],
                          preamble=40)),
    ("gqa4_d128_f16", dict(seed=63, H=4, Hkv=1, D=128, dtype=torch.float16, plan=PLAN, q_lens=[3, 7, 1],
                           base_offsets=[701, 0, 5])),
]
TS = [(0.8, 1.7), (1.3, 1.0), (1.0, 0.6)]


def case(kw, runs, **over):
    return make_case(ape_runs=RUNS[runs], **{**kw, **over})


def ape_changes_something(runs: str, T: float) -> bool:
    """A scale on every key a row sees cancels in the softmax; a temperature does not."""
    return runs == "middle" or (runs == "all" and T != 1.0)


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("runs", list(RUNS))
@pytest.mark.parametrize("T,S", TS)
@pytest.mark.parametrize("rotate", [True, False])
def test_reference_vs_float64(name, kw, runs, T, S, rotate):
    c = case(kw, runs, dtype=torch.float32)
    want = direct64(c, rotate=rotate, ape_temperature=T, ape_scale=S)
    got = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                 rotate=rotate, ape_temperature=T, ape_scale=S)
    assert rel_err(got, want) < 2e-5, rel_err(got, want)
    plain = direct64(c, rotate=rotate)
    assert (rel_err(want, plain) > 1e-3) == ape_changes_something(runs, T)


def test_defaults_are_plain_attention_with_or_without_runs():
    c = case(CASES[0][1], "all")
    bare = PageTable(c.pages.ids, c.pages.delta, c.pages.start, c.pages.length, c.pages.count)
    args = (c.k_pages, c.v_pages)
    with_runs = kernels.lazy_prefill(c.q, *args, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    without = kernels.lazy_prefill(c.q, *args, bare, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert torch.equal(with_runs, without)
    assert rel_err(without, direct64(c)) < 2e-5


def test_argument_rules():
    c = case(CASES[0][1], "middle")
    bare = PageTable(c.pages.ids, c.pages.delta, c.pages.start, c.pages.length, c.pages.count)
    args = (c.q, c.k_pages, c.v_pages)
    with pytest.raises(ValueError, match="ape_lo"):
        kernels.lazy_prefill(*args, bare, c.cu, c.q_pos, c.inv_freq, c.sm_scale, ape_temperature=0.9)
    last = (c.cu[1:] - 1).long()
    with pytest.raises(ValueError, match="ape_lo"):
        kernels.lazy_decode(c.q[last], c.k_pages, c.v_pages, bare, c.q_pos[last], c.inv_freq, c.sm_scale,
                            ape_scale=2.0)
    for bad in (dict(ape_temperature=0.0), dict(ape_scale=-1.0), dict(ape_temperature=float("nan")),
                dict(ape_scale=float("inf"))):
        with pytest.raises(ValueError, match="positive finite"):
            kernels.lazy_prefill(*args, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, **bad)
    half = PageTable(c.pages.ids, c.pages.delta, c.pages.start, c.pages.length, c.pages.count, c.pages.ape_lo)
    with pytest.raises(ValueError, match="together"):
        kernels.lazy_prefill(*args, half, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    wide = PageTable(c.pages.ids, c.pages.delta, c.pages.start, c.pages.length, c.pages.count,
                     c.pages.ape_lo.long(), c.pages.ape_hi)
    with pytest.raises(ValueError, match="ape_lo must be int32"):
        kernels.lazy_prefill(*args, wide, c.cu, c.q_pos, c.inv_freq, c.sm_scale)


# ------------------------------------------------- Triton (interpreter on CPU) vs reference



@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("runs", list(RUNS))
@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_interp(interp, name, kw, runs, splits):
    c = case(kw, runs)
    for rotate, (T, S) in ((True, TS[0]), (False, TS[2])):
        want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                      rotate=rotate, ape_temperature=T, ape_scale=S)
        got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                   rotate=rotate, ape_temperature=T, ape_scale=S, num_splits=splits,
                                   out=torch.full_like(c.q, float("nan")))
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), (rotate, rel_err(got, want))


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("runs", ["middle", "all"])
@pytest.mark.parametrize("splits", [None, 2])
def test_decode_interp(interp, name, kw, runs, splits):
    c = case(kw, runs, q_lens=[1, 1, 1])
    for rotate, (T, S) in ((True, TS[0]), (False, TS[1])):
        want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                     rotate=rotate, ape_temperature=T, ape_scale=S)
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=rotate, ape_temperature=T, ape_scale=S, num_splits=splits,
                                  out=torch.full_like(c.q, float("nan")))
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), (rotate, rel_err(got, want))
