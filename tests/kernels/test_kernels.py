"""The kernels on the CPU: the PyTorch reference against a float64 direct computation with
explicit rotation and mask, and the Triton kernels under Triton's interpreter against the reference."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import Case, direct64, inv_freq_for, make_case, rel_err, rope64, tol

from lazyrag import kernels
from lazyrag.kernels import PageTable, reference

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


# ------------------------------------------------------------------ reference vs float64

REF_CASES = [
    dict(seed=1),
    dict(seed=2, H=3, Hkv=1, PS=32, preamble=40),  # negative deltas, GQA 3
    dict(seed=3, H=8, Hkv=1, D=128, base_offsets=[70000, 65537, 0]),  # deltas > 65536, GQA 8
    dict(seed=4, H=4, Hkv=4, random_qpos=True),  # MHA, some rows see nothing
    dict(seed=5, plan=[[2, 2], [0]], q_lens=[1, 7], PS=64),  # same page twice; one-token query
]


@pytest.mark.parametrize("kw", REF_CASES)
@pytest.mark.parametrize("rotate", [True, False])
def test_reference_vs_float64(kw, rotate):
    c = make_case(dtype=torch.float32, **kw)
    want = direct64(c, rotate=rotate)
    got = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                 rotate=rotate)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-5
    # rows that see no key are exactly zero
    zero_rows = want.abs().sum(dim=(1, 2)) == 0
    assert (got[zero_rows] == 0).all()


def test_reference_decode_and_rotate_copy_vs_float64():
    c = make_case(seed=11, H=4, Hkv=2, q_lens=[1, 1, 1], base_offsets=[3, 80000, 0])
    want = direct64(c)
    got = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < 2e-5
    # rotate_copy: R(delta) applied to keys stored at s+j == keys rotated at s+delta+j
    g = torch.Generator().manual_seed(12)
    PS, Hkv, D = 16, 2, 64
    inv = inv_freq_for(D)
    raw = torch.randn(4, PS, Hkv, D, generator=g, dtype=torch.float64)
    st = torch.tensor([0, 16, 100, 5])
    pos = st[:, None] + torch.arange(PS)
    kp = rope64(raw, pos[:, :, None].expand(4, PS, Hkv), inv).float()
    vp = torch.randn(4, PS, Hkv, D, generator=g)
    dk, dv = torch.full((3, PS, Hkv, D), float("nan")), torch.full((3, PS, Hkv, D), float("nan"))
    src = torch.tensor([2, 0, 3], dtype=torch.int32)
    dst = torch.tensor([0, 2, 1], dtype=torch.int32)
    dl = torch.tensor([7, -16, 70000], dtype=torch.int32)
    reference.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=dk, dst_v=dv)
    for i in range(3):
        s, d_, t = int(src[i]), int(dst[i]), int(dl[i])
        want_k = rope64(raw[s], (pos[s] + t)[:, None].expand(PS, Hkv), inv)
        # fp32 angle delta*inv_freq at 70,000 carries ~4e-3 rad of rounding; allow for it
        assert rel_err(dk[d_], want_k) < (1e-2 if abs(t) > 65536 else 1e-5)
        assert torch.equal(dv[d_], vp[s])


def test_bad_head_dim_and_shapes():
    c = make_case(seed=13)
    q = torch.randn(c.q.shape[0], c.q.shape[1], 96)
    kp = torch.randn(4, 16, 2, 96)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.lazy_prefill(q, kp, kp, c.pages, c.cu, c.q_pos, torch.ones(48), 0.1)
    with pytest.raises(ValueError, match="page_size"):
        kp = torch.randn(4, 24, 2, 64)
        kernels.lazy_prefill(c.q, kp, kp, c.pages, c.cu, c.q_pos, c.inv_freq, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        kp = torch.randn(4, 16, 3, 64)
        kernels.lazy_prefill(c.q, kp, kp, c.pages, c.cu, c.q_pos, c.inv_freq, 0.1)


def test_cpu_tensors_run_the_reference_by_default():
    assert kernels.backend(torch.zeros(1)) == "reference"
    with pytest.raises(ValueError, match="cpu backend"):
        with kernels.cpu_backend("interpreter"):
            pass


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA present Triton is imported compiled")
def test_cpu_backend_switches_cpu_tensors_to_the_interpreter():
    with kernels.cpu_backend("triton"):
        assert kernels.backend(torch.zeros(1)) == "triton-interpret"
    assert kernels.backend(torch.zeros(1)) == "reference"


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)


@needs_triton
def test_triton_mode_is_fixed_when_the_kernels_are_imported():
    """Without TRITON_INTERPRET at start-up Triton is compiled: CPU tensors cannot switch to it
    (so the interpreter tests below fail rather than run the reference). Setting the variable
    after triton was imported is refused when the kernels are imported."""
    compiled = run_python(
        "import torch; from lazyrag import kernels\n"
        "assert kernels.backend(torch.zeros(1)) == 'reference'\n"
        "try:\n    kernels.cpu_backend('triton').__enter__()\nexcept RuntimeError as e:\n    print(e)\n")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in compiled.stdout
    late = run_python("import os, triton; os.environ['TRITON_INTERPRET'] = '1'; import lazyrag.kernels")
    assert late.returncode != 0 and "TRITON_INTERPRET changed" in late.stderr, late.stderr[-2000:]


# ------------------------------------------------- Triton (interpreter on CPU) vs reference



KERNEL_CASES = [
    # (id, kwargs)
    ("gqa2_ps16_f32", dict(seed=21, H=4, Hkv=2, dtype=torch.float32)),
    ("gqa3_neg_delta_f16", dict(seed=22, H=6, Hkv=2, dtype=torch.float16, preamble=40, PS=32)),
    ("gqa4_big_delta_f16", dict(seed=23, H=4, Hkv=1, D=128, dtype=torch.float16,
                                base_offsets=[70001, 0, 65600])),
    ("gqa8_f32", dict(seed=24, H=8, Hkv=1, dtype=torch.float32, q_lens=[3, 20, 1])),
    ("mha_randpos_f16", dict(seed=25, H=2, Hkv=2, dtype=torch.float16, random_qpos=True)),
    ("dup_page_ps64_f32", dict(seed=26, H=3, Hkv=1, PS=64, dtype=torch.float32,
                               plan=[[2, 2, 0], [1]], q_lens=[9, 1])),
    ("noncached_only_f16", dict(seed=27, H=4, Hkv=2, dtype=torch.float16, plan=[[], []], q_lens=[17, 1])),
    ("mixed_delta_block_f32", dict(seed=28, H=4, Hkv=2, PS=16, dtype=torch.float32,
                                   chunk_lens=(20, 9, 33), plan=[[0, 1, 2, 1]], q_lens=[4])),
]


@pytest.mark.parametrize("name,kw", KERNEL_CASES, ids=[k[0] for k in KERNEL_CASES])
@pytest.mark.parametrize("rotate", [True, False])
def test_prefill_interp(interp, name, kw, rotate):
    check_prefill(make_case(**kw), rotate=rotate)


def check_prefill(c: Case, **opts):
    """The kernel into a NaN-poisoned output against the reference: every element written, close."""
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=opts.get("rotate", True))
    out = torch.full_like(c.q, float("nan"))
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               out=out, **opts)
    assert got is out
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("name,kw", [KERNEL_CASES[i] for i in (0, 2, 5, 7)],
                         ids=[KERNEL_CASES[i][0] for i in (0, 2, 5, 7)])
def test_prefill_interp_wide_tile(interp, name, kw):
    """64-row tiles: one tile holds many query rows (and tokens of several pages)."""
    check_prefill(make_case(**kw), block_m=64)


@pytest.mark.parametrize("name,kw", KERNEL_CASES, ids=[k[0] for k in KERNEL_CASES])
@pytest.mark.parametrize("splits", [2, 5])
def test_prefill_interp_splits(interp, name, kw, splits):
    """Each tile's pages split across programs and merged: splits past the page count (empty
    splits) and splits where a row sees no unmasked key included."""
    check_prefill(make_case(**kw), num_splits=splits)


@pytest.mark.parametrize("name,kw", KERNEL_CASES[:6], ids=[k[0] for k in KERNEL_CASES[:6]])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_interp(interp, name, kw, splits):
    kw = dict(kw)
    n = len(kw.get("plan") or [0, 1, 2])
    kw["q_lens"] = [1] * n
    kw.pop("random_qpos", None)
    c = make_case(**kw)
    for rotate in (True, False):
        want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                     rotate=rotate)
        out = torch.full_like(c.q, float("nan"))
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=rotate, out=out, num_splits=splits)
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("D", [64, 128])
def test_decode_interp_wide_table(interp, D):
    """As a CUDA graph runs it: a page table far wider than any request (junk past each count),
    the split over each request's own pages."""
    c = make_case(seed=43, H=4, Hkv=2, D=D, dtype=torch.float16, q_lens=[1, 1, 1])
    g = torch.Generator().manual_seed(44)
    wide = 5 * c.pages.max_pages

    def widen(t, hi):
        out = torch.randint(0, hi, (t.shape[0], wide), generator=g, dtype=torch.int32)
        out[:, : t.shape[1]] = t
        return out

    n_pages = c.k_pages.shape[0]
    pages = PageTable(widen(c.pages.ids, n_pages), widen(c.pages.delta, 999), widen(c.pages.start, 999),
                      widen(c.pages.length, c.k_pages.shape[1]), c.pages.count)
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, pages, c.q_pos, c.inv_freq, c.sm_scale,
                              num_splits=4, out=torch.full_like(c.q, float("nan")))
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@needs_triton
def test_split_rule():
    """The split count follows waves of resident programs. Decode at 3 programs per SM on 132
    SMs: 3 splits for 32 requests x 8 KV heads (2 full waves) and 6 for 8 x 8 (1 wave), the
    counts measured best on the H200. Prefill at 2 per SM: Llama-8B's 8 x 2 tiles x 32 heads
    fill the GPU unsplit; SmolLM2's 9 heads leave it partly idle, so they are split. Never
    more splits than pages, never more than 64."""
    from lazyrag.kernels.splits import split_count

    slots = 3 * 132
    assert split_count(32 * 8, 128, slots) == 3
    assert split_count(8 * 8, 512, slots) == 6
    assert split_count(1 * 8, 2048, slots) == 49  # one short request: spread it over the GPU
    assert split_count(8, 5, slots) == 5 and split_count(8, 0, slots) == 1
    assert all(1 <= split_count(p, n, slots) <= 64 for p in (1, 7, 256, 4096) for n in (1, 100, 10_000))
    assert split_count(32 * 8 * 2, 130, 2 * 132) == 1
    assert split_count(9 * 8 * 2, 130, 2 * 132) > 1


def test_empty_request_interp(interp):
    """A request with no pages at all (count 0) gets zeros; the others are unaffected."""
    c = make_case(seed=41, H=4, Hkv=2, dtype=torch.float16)
    c.pages.count[1] = 0
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               out=torch.full_like(c.q, float("nan")))
    assert (got[c.cu[1]:c.cu[2]] == 0).all() and (want[c.cu[1]:c.cu[2]] == 0).all()
    assert rel_err(got, want) < tol(c.q.dtype)
    c = make_case(seed=42, H=4, Hkv=2, dtype=torch.float16, q_lens=[1, 1, 1])
    c.pages.count[0] = 0
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                              out=torch.full_like(c.q, float("nan")))
    assert (got[0] == 0).all() and not torch.isnan(got).any()
    assert rel_err(got, want) < tol(c.q.dtype)


@pytest.mark.parametrize("dtype,PS,Hkv,D", [(torch.float32, 16, 2, 64), (torch.float16, 32, 3, 128),
                                            (torch.float16, 16, 1, 64)])
def test_rotate_copy_interp(interp, dtype, PS, Hkv, D):
    g = torch.Generator().manual_seed(31 + PS + D)
    P = 9
    kp = torch.randn(P, PS, Hkv, D, generator=g).to(dtype)
    vp = torch.randn(P, PS, Hkv, D, generator=g).to(dtype)
    inv = inv_freq_for(D)
    src = torch.tensor([1, 4, 4, 0], dtype=torch.int32)
    dst = torch.tensor([5, 6, 2, 8], dtype=torch.int32)
    dl = torch.tensor([3, -70, 70000, 0], dtype=torch.int32)
    # separate destination pools, poisoned
    dk = torch.full((10, PS, Hkv, D), float("nan"), dtype=dtype)
    dv = torch.full((10, PS, Hkv, D), float("nan"), dtype=dtype)
    rk, rv = dk.clone(), dv.clone()
    reference.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=rk, dst_v=rv)
    kernels.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=dk, dst_v=dv)
    d = dst.long()
    assert not torch.isnan(dk[d]).any() and not torch.isnan(dv[d]).any()
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[d] = False
    assert torch.isnan(dk[untouched]).all() and torch.isnan(dv[untouched]).all()
    assert rel_err(dk[d], rk[d]) < tol(dtype)
    assert torch.equal(dv[d], rv[d])
    # in place (default pools): dst pages disjoint from src pages
    kp2, vp2 = kp.clone(), vp.clone()
    kr, vr = kp.clone(), vp.clone()
    src2 = torch.tensor([1, 4], dtype=torch.int32)
    dst2 = torch.tensor([7, 3], dtype=torch.int32)
    dl2 = torch.tensor([12, 99999], dtype=torch.int32)
    kernels.rotate_copy(kp2, vp2, src2, dst2, dl2, inv)
    reference.rotate_copy(kr, vr, src2, dst2, dl2, inv)
    assert rel_err(kp2, kr) < tol(dtype) and torch.equal(vp2, vr)


@pytest.mark.parametrize("name,kw", [KERNEL_CASES[i] for i in (0, 2, 4, 5)],
                         ids=[KERNEL_CASES[i][0] for i in (0, 2, 4, 5)])
@pytest.mark.parametrize("rotate", [True, False])
def test_decode_interp_tma(interp, name, kw, rotate):
    """Decode pages loaded as whole TMA tiles, with 16 and 64 query rows per program."""
    kw = dict(kw, q_lens=[1] * len(kw.get("plan") or [0, 1, 2]))
    kw.pop("random_qpos", None)
    c = make_case(**kw)
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale, rotate=rotate)
    for block_h in (None, 64):
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale, rotate=rotate,
                                  out=torch.full_like(c.q, float("nan")), tma=True, block_h=block_h, num_splits=2)
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


# ----------------------------------------------- fp32 queries over 16-bit pages (a CPU model over bf16 KV)


def upcast_pages_case(c: Case, dtype: torch.dtype) -> tuple[Case, Case]:
    """The case with its pages rounded to ``dtype`` (queries left fp32), and the same rounded pages in fp32."""
    k, v = c.k_pages.to(dtype), c.v_pages.to(dtype)
    low = Case(c.q, k, v, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, c.lens)
    return low, Case(c.q, k.float(), v.float(), c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, c.lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotate", [True, False])
def test_reference_upcasts_16_bit_pages_for_fp32_queries_exactly(dtype, rotate):
    """What the engine runs on the CPU over a bf16 store: the reference reads the pages up to fp32 and computes
    as over fp32 pages holding the same values, bit for bit; the output stays fp32."""
    low, plain = upcast_pages_case(make_case(31, H=6, Hkv=2, preamble=7), dtype)
    for fn in (kernels.lazy_prefill, reference.lazy_prefill):
        got = fn(low.q, low.k_pages, low.v_pages, low.pages, low.cu, low.q_pos, low.inv_freq, low.sm_scale,
                 rotate=rotate)
        want = fn(plain.q, plain.k_pages, plain.v_pages, plain.pages, plain.cu, plain.q_pos, plain.inv_freq,
                  plain.sm_scale, rotate=rotate)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    one = make_case(32, q_lens=[1, 1, 1])
    low, plain = upcast_pages_case(one, dtype)
    got = kernels.lazy_decode(low.q, low.k_pages, low.v_pages, low.pages, low.q_pos, low.inv_freq, low.sm_scale)
    want = kernels.lazy_decode(plain.q, plain.k_pages, plain.v_pages, plain.pages, plain.q_pos, plain.inv_freq,
                               plain.sm_scale)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_16_bit_queries_over_fp32_pages_are_refused():
    """A query is never cast down to meet its pages: only fp32 queries may read pages of another dtype."""
    c = make_case(33)
    with pytest.raises(ValueError, match="share the pages' dtype"):
        kernels.lazy_prefill(c.q.to(torch.bfloat16), c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq,
                             c.sm_scale)
    with pytest.raises(ValueError, match="share the pages' dtype"):
        kernels.lazy_prefill(c.q.half(), c.k_pages.to(torch.bfloat16), c.v_pages.to(torch.bfloat16), c.pages,
                             c.cu, c.q_pos, c.inv_freq, c.sm_scale)


@pytest.mark.parametrize("rotate", [True, False])
def test_interp_fp32_queries_over_bf16_pages(interp, rotate):
    """The Triton kernels convert the pages to the query's dtype in registers: fp32 queries over bf16 pages
    match the reference to fp32's tolerance, in prefill and in decode."""
    low, _ = upcast_pages_case(make_case(34, H=4, Hkv=2), torch.bfloat16)
    check_prefill(low, rotate=rotate)
    low, _ = upcast_pages_case(make_case(35, H=4, Hkv=2, q_lens=[1, 1, 1]), torch.bfloat16)
    want = reference.lazy_decode(low.q, low.k_pages, low.v_pages, low.pages, low.q_pos, low.inv_freq, low.sm_scale,
                                 rotate=rotate)
    got = kernels.lazy_decode(low.q, low.k_pages, low.v_pages, low.pages, low.q_pos, low.inv_freq, low.sm_scale,
                              rotate=rotate)
    assert rel_err(got, want) < tol(torch.float32), rel_err(got, want)
