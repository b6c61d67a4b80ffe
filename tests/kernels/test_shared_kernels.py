"""Chunk-major attention: the grouping of shared runs with exact ids, and the chunk-major kernels
(Triton under the interpreter, and the reference) against per-request attention over the same
whole page tables, on pages of the query's dtype and on fp8 pages with their scales."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import cuda_fp8, fp8_case, make_case, rel_err, tol

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
    3), chunk C = 40 (label 4, one request only: a group of one use); own pages from 30. Request 1
    reads A twice, the second time with its middle page recomputed into private page 99; request 3
    reads no stored pages."""
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
    assert s["page_ptr"] == [0, 1, 4, 6, 7]  # groups: the preamble, A, B, C
    assert s["page_ids"] == [5, 10, 11, 12, 20, 21, 40]
    assert s["page_start"] == [0, 7, 23, 39, 7, 23, 7]
    assert s["page_length"] == [7, 16, 16, 9, 16, 3, 16]
    assert s["use_ptr"] == [0, 3, 7, 9, 10]
    assert s["use_request"] == [0, 1, 2, 0, 1, 1, 1, 0, 1, 2]
    assert s["use_delta"] == [0, 0, 0, 3, 22, 70, 70, 44, 3, 5]
    assert s["use_first"] == [0, 0, 0, 0, 0, 0, 2, 0, 0, 0]
    assert s["use_pages"] == [1, 1, 1, 3, 3, 1, 1, 2, 2, 1]
    assert s["use_ape"] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert s["use_slot"] == [0, 0, 0, 1, 2, 3, 4, 2, 1, 1]
    assert rest.count.tolist() == [1, 3, 1, 1]
    assert [rest.ids[b, :n].tolist() for b, n in enumerate(rest.count.tolist())] == [[30], [99, 31, 32], [33], [34]]
    assert rest.delta[1, :3].tolist() == [70, 0, 0] and rest.start[2, 0] == 28
    assert list(zip(rest.ape_lo.tolist(), rest.ape_hi.tolist())) == [(0, 0), (0, 1), (0, 0), (0, 0)]


def test_grouping_keeps_everything_in_the_remainder_when_no_entry_is_labelled():
    pages = table([[(3, 0, 0, 16), (4, 0, 16, 2)], [(5, 9, 0, 16)]])
    shared, rest = group_shared(pages, labels([[0, 0], [0]], pages.max_pages))
    assert shared.groups == 0 and shared.uses == 0
    assert rest.count.tolist() == [2, 1] and rest.ids[0, :2].tolist() == [3, 4] and rest.delta[1, 0] == 9


def test_grouping_refuses_a_page_with_two_starts_or_lengths_under_one_label():
    for other in ((3, 0, 16, 16), (3, 0, 0, 9)):
        pages = table([[(3, 0, 0, 16)], [other]])
        with pytest.raises(ValueError, match="two starts or lengths"):
            group_shared(pages, labels([[1], [1]], pages.max_pages))
    pages = table([[(3, 0, 0, 16)], [(3, 0, 16, 16)]])  # one page under two labels: two sequences
    assert group_shared(pages, labels([[1], [2]], pages.max_pages))[0].groups == 2


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


def stored_as(c, fp8):
    """(case, its scale keywords, the case the reference reads): c, {} and c; or, fp8, c's pages in
    e4m3 with their scales and c over the dequantised pages (fp8_case)."""
    if not fp8:
        return c, {}, c
    c8, ks, vs, plain = fp8_case(c)
    return c8, dict(k_scale=ks, v_scale=vs), plain


# pages of the query's dtype, or e4m3 with their scales
FP8_TOO = pytest.mark.parametrize("fp8", [False, True], ids=["q_dtype", "fp8"])


@FP8_TOO
@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode", [True, False])
def test_reference_is_attention_over_the_whole_tables(name, kw, private, decode, fp8):
    c, shared, rest = shared_inputs(name, kw, private, decode)
    c, scales, _ = stored_as(c, fp8)
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode)
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                  **scales)
    if decode:
        got = kernels.shared_decode(c.q, c.k_pages, c.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale, **scales)
    else:
        got = kernels.shared_prefill(c.q, c.k_pages, c.v_pages, rest, plan, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                     **scales)
    assert torch.equal(got, want)  # the same table, rebuilt in logical order: the same arithmetic


def run_triton(c, rest, plan, decode, **opts):
    out = torch.full_like(c.q, float("nan"))
    if decode:
        return kernels.shared_decode(c.q, c.k_pages, c.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale, out=out,
                                     **opts)
    return kernels.shared_prefill(c.q, c.k_pages, c.v_pages, rest, plan, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                  out=out, **opts)


@FP8_TOO
@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode,grouped", [(True, True), (False, True), (False, False)],
                         ids=["decode", "prefill", "prefill_per_head"])
def test_chunk_major_interp(interp, name, kw, private, decode, grouped, fp8):
    """16-row tiles (several per group) and two page splits: against the reference and the
    per-request kernel over the whole tables (fp8: the reference over the dequantised pages,
    the per-request kernel over the same e4m3 pages)."""
    c, shared, rest = shared_inputs(name, kw, private, decode)
    c, scales, plain = stored_as(c, fp8)
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode, block_m=16,
                       num_splits=2, grouped=grouped)
    assert plan.grouped == grouped
    assert plan.layout.works > shared.groups  # tiled and split
    got = run_triton(c, rest, plan, decode, **scales)
    assert not torch.isnan(got).any(), "unwritten output elements"
    want = reference.lazy_prefill(c.q, plain.k_pages, plain.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)
    if decode:
        per_request = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                          **scales)
    else:
        per_request = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                           **scales)
    assert rel_err(got, per_request) < tol(c.q.dtype)


@pytest.mark.parametrize("decode", [True, False])
def test_merge_in_head_blocks_and_row_rounds_interp(interp, monkeypatch, decode):
    """The merge's head blocks, the last one partial (6 heads in blocks of 4), and a token's
    partial rows taken a few at a time (rounds of 2), against the reference."""
    from lazyrag.kernels import shared_attention

    monkeypatch.setattr(shared_attention, "MERGE_HEADS", 4)
    monkeypatch.setattr(shared_attention, "MERGE_ROWS", 2)
    name, kw, private = CASES[1]  # 6 heads, one chunk at six deltas
    kw = dict(kw, plan=[[0], [0, 0], [0]], base_offsets=[0, 3, 70001])
    c, shared, rest = shared_inputs(name, kw, private, decode)
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode, block_m=16,
                       num_splits=2)
    got = run_triton(c, rest, plan, decode)
    assert not torch.isnan(got).any(), "unwritten output elements"
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


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
    c8, ks, vs, _ = fp8_case(c)
    with pytest.raises(ValueError, match="need v_scale"):
        kernels.shared_decode(c8.q, c8.k_pages, c8.v_pages, rest, plan, c.q_pos, c.inv_freq, c.sm_scale, k_scale=ks)


@pytest.mark.gpu
@FP8_TOO
@pytest.mark.parametrize("name,kw,private", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("tiles", [dict(), dict(block_m=16, num_splits=2), dict(grouped=False)],
                         ids=["defaults", "tiled_split", "per_head"])
def test_chunk_major_gpu(name, kw, private, decode, tiles, fp8):
    """The compiled kernels (bf16 where the case is fp32: tensor-core dots) against the reference
    over the whole tables and against the per-request kernel on the same GPU tables (fp8: e4m3
    pages, the reference over the dequantised ones)."""
    if fp8 and not cuda_fp8():
        pytest.skip("needs a GPU of compute capability 8.9 or later")
    c, shared, rest = shared_inputs(name, kw, private, decode)
    dtype = torch.bfloat16 if c.q.dtype == torch.float32 else c.q.dtype
    c, scales, plain = stored_as(c, fp8)
    q = c.q.to("cuda", dtype)
    kp, vp = (t.cuda() if fp8 else t.to("cuda", dtype) for t in (c.k_pages, c.v_pages))  # fp8 pages as stored
    scales = {k: s.cuda() for k, s in scales.items()}
    plan = plan_shared(shared, c.cu, c.q.shape[1], c.k_pages.shape[2], c.q.shape[2], decode=decode,
                       **tiles).to("cuda")
    rest, pages = rest.to("cuda"), c.pages.to("cuda")
    cu, q_pos, inv = c.cu.cuda(), c.q_pos.cuda(), c.inv_freq.cuda()
    ref_k, ref_v = (plain.k_pages, plain.v_pages) if fp8 else (kp.float().cpu(), vp.float().cpu())
    want = reference.lazy_prefill(q.float().cpu(), ref_k, ref_v, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    out = torch.full_like(q, float("nan"))
    if decode:
        got = kernels.shared_decode(q, kp, vp, rest, plan, q_pos, inv, c.sm_scale, out=out, **scales)
        per_request = kernels.lazy_decode(q, kp, vp, pages, q_pos, inv, c.sm_scale, **scales)
    else:
        got = kernels.shared_prefill(q, kp, vp, rest, plan, cu, q_pos, inv, c.sm_scale, out=out, **scales)
        per_request = kernels.lazy_prefill(q, kp, vp, pages, cu, q_pos, inv, c.sm_scale, **scales)
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got.float().cpu(), want) < tol(dtype), rel_err(got.float().cpu(), want)
    assert rel_err(got.float(), per_request.float()) < tol(dtype)
