"""Chunk-major attention: the grouping of shared runs with exact ids, and the chunk-major kernels
(Triton under the interpreter, and the reference) against per-request attention over the same
whole page tables."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import make_case, rel_err, tol

from lazyrag import kernels
from lazyrag.kernels import PageTable, PlanLayout, empty_plan, group_shared, plan_shared, reference


def table(rows: list[list[tuple[int, int, int, int]]], ape=None) -> PageTable:
    """A page table from each request's (page, delta, start, length) entries."""
    width = max(len(r) for r in rows) + 1  # a junk entry past every count
    planes = torch.full((4, len(rows), width), 7, dtype=torch.int32)
    for b, ents in enumerate(rows):
        for e, ent in enumerate(ents):
            planes[:, b, e] = torch.tensor(ent)
    extra = () if ape is None else tuple(torch.tensor(x, dtype=torch.int32) for x in zip(*ape))
    return PageTable(*planes, torch.tensor([len(r) for r in rows], dtype=torch.int32), *extra)


def labels(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), 9, dtype=torch.int32)  # junk past every count
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def test_grouping_with_exact_ids():
    """Preamble page 5 (label 1), chunk A = pages 10, 11, 12 (label 2), chunk B = 20, 21 (label
    3), chunk C = 40 (label 4, one request only); own pages from 30. Request 1 reads A twice, the
    second time with its middle page recomputed into private page 99; request 3 shares nothing."""
    pre = (5, 0, 0, 7)
    A = [(10, 0, 7, 16), (11, 0, 23, 16), (12, 0, 39, 9)]
    B = [(20, 0, 7, 16), (21, 0, 23, 3)]

    def at(pages, d):
        return [(p, d, s, n) for p, _, s, n in pages]

    rows = [[pre, *at(A, 3), *at(B, 44), (30, 0, 80, 4)],
            [pre, *at(B, 3), *at(A, 22), *at(A[:1], 70), (99, 70, 23, 16), *at(A[2:], 70), (31, 0, 150, 16),
             (32, 0, 166, 2)],
            [pre, (40, 5, 7, 16), (33, 0, 28, 5)],
            [(34, 0, 0, 3)]]
    runs = labels([[1, 2, 2, 2, 3, 3, 0], [1, 3, 3, 2, 2, 2, 2, 0, 2, 0, 0], [1, 4, 0], [0]], 12)
    pages = table(rows, ape=[(1, 6), (1, 9), (1, 2), (0, 0)])
    shared, rest = group_shared(pages, runs)
    s = {k: v.tolist() for k, v in shared.numpy().items()}
    assert s["page_ptr"] == [0, 1, 4, 6]  # groups: the preamble, A, B (C has one run: not shared)
    assert s["page_ids"] == [5, 10, 11, 12, 20, 21]
    assert s["page_start"] == [0, 7, 23, 39, 7, 23]
    assert s["page_length"] == [7, 16, 16, 9, 16, 3]
    assert s["use_ptr"] == [0, 3, 7, 9]
    assert s["use_request"] == [0, 1, 2, 0, 1, 1, 1, 0, 1]
    assert s["use_delta"] == [0, 0, 0, 3, 22, 70, 70, 44, 3]
    assert s["use_first"] == [0, 0, 0, 0, 0, 0, 2, 0, 0]
    assert s["use_pages"] == [1, 1, 1, 3, 3, 1, 1, 2, 2]
    assert s["use_ape"] == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert s["use_slot"] == [0, 0, 0, 1, 2, 3, 4, 2, 1]
    assert rest.count.tolist() == [1, 3, 2, 1]
    assert [rest.ids[b, :n].tolist() for b, n in enumerate(rest.count.tolist())] == [[30], [99, 31, 32], [40, 33],
                                                                                       [34]]
    assert rest.delta[1, :3].tolist() == [70, 0, 0] and rest.start[2, :2].tolist() == [7, 28]
    assert list(zip(rest.ape_lo.tolist(), rest.ape_hi.tolist())) == [(0, 0), (0, 1), (0, 1), (0, 0)]


def test_grouping_keeps_everything_in_the_remainder_when_nothing_is_shared():
    pages = table([[(3, 0, 0, 16), (4, 0, 16, 2)], [(5, 9, 0, 16)]])
    shared, rest = group_shared(pages, labels([[0, 0], [2]], pages.max_pages))
    assert shared.groups == 0 and shared.uses == 0
    assert rest.count.tolist() == [2, 1] and rest.ids[0, :2].tolist() == [3, 4] and rest.delta[1, 0] == 9


def test_grouping_refuses_a_page_with_two_starts_under_one_label():
    pages = table([[(3, 0, 0, 16)], [(3, 0, 16, 16)]])
    with pytest.raises(ValueError, match="two starts"):
        group_shared(pages, labels([[1], [1]], pages.max_pages))


# ------------------------------------------------------------------------------ kernels

def chunk_runs(c, chunk_lens, PS, private=()):
    """Run labels for make_case's tables: chunk k's pages (the first physical pages) carry k + 1,
    own pages 0; `private`: (request, entry) pairs read as private pages (recomputed)."""
    label_of = [k + 1 for k, L in enumerate(chunk_lens) for _ in range(math.ceil(L / PS))]
    lut = torch.tensor(label_of + [0], dtype=torch.int32)
    runs = lut[c.pages.ids.long().clamp(max=len(label_of))]
    for b, e in private:
        runs[b, e] = 0
    return runs


CASES = [
    # id, make_case keywords, private entries
    ("gqa2_twice_and_alone_f32", dict(seed=51, H=4, Hkv=2, plan=[[0, 1], [1, 0, 2], [1, 1]], chunk_lens=(37, 16, 50)),
     ()),
    ("one_chunk_many_deltas_gqa3_f16", dict(seed=52, H=6, Hkv=2, dtype=torch.float16, plan=[[0]] * 6,
                                            chunk_lens=(45,), base_offsets=[0, 3, 70001, 40, 9, 65537]), ()),
    ("unshared_requests_gqa8_d128_f16", dict(seed=53, H=8, Hkv=1, D=128, dtype=torch.float16, PS=32,
                                             plan=[[0, 1], [], [1, 0], [2]], chunk_lens=(70, 33, 20), preamble=5),
     ()),
    ("recomputed_hole_mha_f32", dict(seed=54, H=2, Hkv=2, plan=[[0, 1], [0, 1]], chunk_lens=(60, 17)), ((1, 1),)),
]


def shared_inputs(name, kw, private, decode):
    kw = dict(kw)
    n = len(kw["plan"])
    kw["q_lens"] = [1] * n if decode else [5, 1, 13, 2, 7, 3][:n]
    c = make_case(**kw)
    shared, rest = group_shared(c.pages, chunk_runs(c, kw["chunk_lens"], c.k_pages.shape[1], private))
    assert shared.groups > 0
    return c, shared, rest


@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode", [True, False])
def test_reference_is_attention_over_the_whole_tables(name, kw, private, decode):
    c, shared, rest = shared_inputs(name, kw, private, decode)
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode)
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    if decode:
        got = kernels.shared_decode(c.q, c.k_pages, c.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale)
    else:
        got = kernels.shared_prefill(c.q, c.k_pages, c.v_pages, rest, plan, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert torch.equal(got, want)  # the same table, rebuilt in logical order: the same arithmetic


def run_triton(c, rest, plan, decode, **opts):
    out = torch.full_like(c.q, float("nan"))
    if decode:
        return kernels.shared_decode(c.q, c.k_pages, c.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale, out=out,
                                     **opts)
    return kernels.shared_prefill(c.q, c.k_pages, c.v_pages, rest, plan, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                  out=out, **opts)


@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode", [True, False])
def test_chunk_major_interp(interp, name, kw, private, decode):
    """16-row tiles (several per group) and two page splits: against the reference and the
    per-request kernel over the whole tables."""
    c, shared, rest = shared_inputs(name, kw, private, decode)
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode, block_m=16,
                       num_splits=2)
    assert plan.layout.works > shared.groups  # tiled and split
    got = run_triton(c, rest, plan, decode)
    assert not torch.isnan(got).any(), "unwritten output elements"
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)
    if decode:
        per_request = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    else:
        per_request = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, per_request) < tol(c.q.dtype)


@pytest.mark.parametrize("decode", [True, False])
def test_chunk_major_ape_interp(interp, decode):
    """APE's temperature and scale on the chunk entries, shared ones included."""
    kw = dict(seed=55, H=4, Hkv=2, plan=[[0, 1], [1, 0], [1]], chunk_lens=(30, 40), q_lens=[1, 1, 1] if decode else
              [3, 4, 9], ape_runs=[(0, 5), (0, 5), (0, 3)])
    c = make_case(**kw)
    shared, rest = group_shared(c.pages, chunk_runs(c, kw["chunk_lens"], 16))
    assert rest.ape_lo.tolist() == [0, 0, 0] and rest.ape_hi.tolist() == [0, 0, 0]
    plan = plan_shared(shared, c.cu, 4, 2, 64, decode=decode)
    ape = dict(ape_temperature=0.7, ape_scale=1.8)
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, **ape)
    got = run_triton(c, rest, plan, decode, **ape)
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


def test_plan_in_a_larger_layout_and_the_empty_plan_interp(interp):
    """As a CUDA graph runs it: the plan copied into a static one of larger capacity (programs
    past its work exit, tokens past the batch have no partial rows); and a plan with nothing
    shared, which leaves the per-request path over the whole tables."""
    kw = dict(seed=56, H=4, Hkv=2, plan=[[0, 1], [1, 0]], chunk_lens=(20, 33), q_lens=[1, 1])
    c = make_case(**kw)
    shared, rest = group_shared(c.pages, chunk_runs(c, kw["chunk_lens"], 16))
    exact = plan_shared(shared, c.cu, 4, 2, 64, decode=True)
    big = PlanLayout(works=exact.layout.works + 5, uses=20, items=20, pages=30, tokens=4, rows=64)
    static = empty_plan(big, decode=True, group=2)
    static.copy_(plan_shared(shared, c.cu, 4, 2, 64, decode=True, layout=big))
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    got = run_triton(c, rest, static, decode=True)
    assert rel_err(got, want) < tol(c.q.dtype)
    got = run_triton(c, c.pages, empty_plan(big, decode=True, group=2), decode=True)
    assert rel_err(got, want) < tol(c.q.dtype)
    small = PlanLayout(works=1, uses=1, items=1, pages=1, tokens=2, rows=1)
    assert plan_shared(shared, c.cu, 4, 2, 64, decode=True, layout=small) is None


def test_argument_rules():
    c = make_case(seed=57, H=4, Hkv=2, plan=[[0], [0]], chunk_lens=(20,), q_lens=[1, 1])
    shared, rest = group_shared(c.pages, chunk_runs(c, (20,), 16))
    plan = plan_shared(shared, c.cu, 4, 2, 64, decode=True)
    with pytest.raises(ValueError, match="built for decode"):
        kernels.shared_prefill(c.q, c.k_pages, c.v_pages, rest, plan, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    with pytest.raises(ValueError, match="GQA group"):
        kernels.shared_decode(c.q[:, :2], c.k_pages, c.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale)
    with pytest.raises(ValueError, match="one query token"):
        plan_shared(shared, torch.tensor([0, 2, 3], dtype=torch.int32), 4, 2, 64, decode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("tiles", [dict(), dict(block_m=16, num_splits=2)], ids=["defaults", "tiled_split"])
def test_chunk_major_gpu(name, kw, private, decode, tiles):
    """The compiled kernels (bf16 where the case is fp32: tensor-core dots) against the reference
    over the whole tables and against the per-request kernel on the same GPU tables."""
    c, shared, rest = shared_inputs(name, kw, private, decode)
    dtype = torch.bfloat16 if c.q.dtype == torch.float32 else c.q.dtype
    q, kp, vp = (t.to("cuda", dtype) for t in (c.q, c.k_pages, c.v_pages))
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode,
                       **tiles).to("cuda")
    rest, pages = rest.to("cuda"), c.pages.to("cuda")
    cu, q_pos, inv = c.cu.cuda(), c.q_pos.cuda(), c.inv_freq.cuda()
    want = reference.lazy_prefill(q.float().cpu(), kp.float().cpu(), vp.float().cpu(), c.pages, c.cu, c.q_pos,
                                  c.inv_freq, c.sm_scale)
    out = torch.full_like(q, float("nan"))
    if decode:
        got = kernels.shared_decode(q, kp, vp, rest, plan, q_pos, inv, c.sm_scale, out=out)
        per_request = kernels.lazy_decode(q, kp, vp, pages, q_pos, inv, c.sm_scale)
    else:
        got = kernels.shared_prefill(q, kp, vp, rest, plan, cu, q_pos, inv, c.sm_scale, out=out)
        per_request = kernels.lazy_prefill(q, kp, vp, pages, cu, q_pos, inv, c.sm_scale)
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got.float().cpu(), want) < tol(dtype), rel_err(got.float().cpu(), want)
    assert rel_err(got.float(), per_request.float()) < tol(dtype)
