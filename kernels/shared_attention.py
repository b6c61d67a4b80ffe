"""Triton chunk-major attention: each shared page is read once per step for every request using it.

One program takes one work item of a SharedPlan (a group's pages, or a split of them, and a
tile of its row items) for one KV head (a grouped plan: the tile's rows are uses x tokens x the
GQA group's query heads, so a page is loaded once for the group) or one query head (uses x
tokens). In prefill the questions of every request sharing the chunk stack into one tile,
which also gives short questions full tensor-core tiles. A row of use u sits at query position m and
reads the pages at u's shift: it is rotated once, by R(m - delta_u), before the page loop.
Shared pages precede every query of their requests, so only the valid-length mask applies.
fp8 pages are read as the request kernels read them (page_loop.key_dot, value_dot).
Each program writes a normalised partial output and its log2-sum-exp per (row, split); the
request kernels (decode.py, prefill.py) run over each request's remainder and hand their
split partials to `merge_shared`, which merges both by log-sum-exp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode, prefill, tuning
from .fp8 import FP8
from .page_loop import TL_DTYPE, key_dot, logit_scales, needs_idx64, precision, query_at, scale_args, value_dot
from .pages import PageTable, ape_enabled
from .shared_plan import ITEM, PAGE, USE, WORK, SharedPlan
from .splits import scratch


@triton.jit
def _shared_kernel(Q, K, V, KS, VS, SOP, SLSE, HEAD, WORK_, USE_, ITEM_, PAGE_, QPOS, INVF,
                   stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                   stride_ksp, stride_vsp, stride_st, num_heads, qk_scale, ape_qk_scale, ape_bias,
                   GROUP: tl.constexpr, PER_ITEM: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
                   APE: tl.constexpr, FP8: tl.constexpr, NW: tl.constexpr, NU: tl.constexpr, NI: tl.constexpr,
                   NP: tl.constexpr):
    # FP8 (compiled out unless set): e4m3 pages with their row scales KS, VS, as page_loop reads them
    w = tl.program_id(0)
    # a CUDA graph launches the plan's capacity: programs past its work items exit at once
    if w < tl.load(HEAD):
        ax = tl.program_id(1)  # a KV head (decode) or a query head (prefill)
        work = WORK_ + w * NW
        item_lo = tl.load(work)
        item_hi = tl.load(work + 1)
        p_lo = tl.load(work + 2)
        p_hi = tl.load(work + 3)
        sp = tl.load(work + 4)
        r = tl.arange(0, BLOCK_M)
        item = item_lo + r // PER_ITEM
        rmask = item < item_hi
        head = ax * PER_ITEM + r % PER_ITEM
        kvh = (ax * PER_ITEM) // GROUP
        tok = tl.load(ITEM_ + item * NI, mask=rmask, other=0)
        use = tl.load(ITEM_ + item * NI + 1, mask=rmask, other=0)
        part = tl.load(ITEM_ + item * NI + 2, mask=rmask, other=0)
        d = tl.load(USE_ + use * NU + 1, mask=rmask, other=0)
        u_lo = tl.load(USE_ + use * NU + 3, mask=rmask, other=0)
        u_hi = tl.load(USE_ + use * NU + 4, mask=rmask, other=0)
        qpos = tl.load(QPOS + tok, mask=rmask, other=0)
        offs_n = tl.arange(0, PS)
        offs_d = tl.arange(0, 2 * HALF)
        invf = tl.load(INVF + tl.arange(0, HALF))
        q = query_at(Q + tok.to(tl.int64) * stride_qt + head * stride_qh, rmask, qpos, d, invf, HALF, DTYPE)
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
        row_bias = tl.zeros([BLOCK_M], dtype=tl.float32)
        if APE:
            in_ape = tl.load(USE_ + use * NU + 2, mask=rmask, other=0) != 0
            row_scale = tl.where(in_ape, ape_qk_scale, qk_scale)
            row_bias = tl.where(in_ape, ape_bias, 0.0)
        # rows whose use covers every page of the work need no per-row page mask
        lo_max = tl.max(tl.where(rmask, u_lo, -1), axis=0)
        hi_min = tl.min(tl.where(rmask, u_hi, 2147483647), axis=0)
        acc = tl.zeros([BLOCK_M, 2 * HALF], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for p in range(p_lo, p_hi):
            pid = tl.load(PAGE_ + p * NP)
            n_valid = tl.load(PAGE_ + p * NP + 2)
            if IDX64:
                pid = pid.to(tl.int64)
            k = tl.load(K + pid * stride_kp + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :])
            s = key_dot(q, k, KS, pid, kvh, stride_ksp, stride_st, DTYPE, PS, PREC, FP8) * row_scale[:, None]
            if APE:
                s = s + row_bias[:, None]
            if (n_valid < PS) | (p < lo_max) | (p >= hi_min):
                keep = (offs_n < n_valid)[None, :] & ((p >= u_lo) & (p < u_hi))[:, None]
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            # padding rows are read whole: their weights are 0 and the pool holds finite values
            v = tl.load(V + pid * stride_vp + kvh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :])
            acc = value_dot(acc * alpha[:, None], pr, v, VS, pid, kvh, stride_vsp, stride_st, DTYPE, PS, PREC, FP8)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        prow = (part + sp).to(tl.int64) * num_heads + head
        tl.store(SOP + prow[:, None] * (2 * HALF) + offs_d[None, :], o.to(SOP.dtype.element_ty), mask=rmask[:, None])
        tl.store(SLSE + prow, lse, mask=rmask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_shared_kernel(OP, LSE, SOP, SLSE, PART_PTR, O, stride_ot, stride_oh, num_heads, num_splits,
                         D: tl.constexpr, SPLITS_P2: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr):
    # one program per (query token, HEADS heads): the remainder's split partials, then the token's
    # shared rows ROWS at a time with a running max. A token's usual 5-30 rows make the merge
    # latency-bound: a program per head moved 8 KB a round, one per head block moves HEADS times that
    t = tl.program_id(0)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    hmask = h < num_heads
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, ROWS)
    r_lo = tl.load(PART_PTR + t)
    r_hi = tl.load(PART_PTR + t + 1)
    split = (t.to(tl.int64) * num_heads + h)[:, None] * num_splits + offs_s[None, :]  # [HEADS, SPLITS_P2]
    smask = hmask[:, None] & (offs_s < num_splits)[None, :]
    lse = tl.load(LSE + split, mask=smask, other=float("-inf"))
    op = tl.load(OP + split[:, :, None] * D + offs_d[None, None, :], mask=smask[:, :, None], other=0.0)
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m_safe[:, None]), 0.0)
    o = tl.sum(op * w[:, :, None], axis=1)
    tot = tl.sum(w, axis=1)
    for r0 in range(r_lo, r_hi, ROWS):
        rmask = hmask[:, None] & (r0 + offs_r < r_hi)[None, :]
        row = (r0 + offs_r)[None, :] * num_heads + h[:, None]  # [HEADS, ROWS] partial rows: int32 offsets
        lr = tl.load(SLSE + row, mask=rmask, other=float("-inf"))
        sop = tl.load(SOP + row[:, :, None] * D + offs_d[None, None, :], mask=rmask[:, :, None], other=0.0)
        sop = sop.to(tl.float32)
        m_new = tl.maximum(m, tl.max(lr, axis=1))
        m_new_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - m_new_safe)  # 0 while nothing was seen (m = -inf)
        wr = tl.where(lr > float("-inf"), tl.exp2(lr - m_new_safe[:, None]), 0.0)
        o = o * alpha[:, None] + tl.sum(sop * wr[:, :, None], axis=1)
        tot = tot * alpha + tl.sum(wr, axis=1)
        m = m_new
    o = tl.where(tot[:, None] > 0, o / tl.where(tot > 0, tot, 1.0)[:, None], 0.0)
    out = O + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, o.to(O.dtype.element_ty), mask=hmask[:, None])


MERGE_ROWS, MERGE_HEADS = 8, 8  # partial rows and heads the merge loads at once


def launch_config(dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int, page_size: int, *,
                  grouped: bool, block_m: int = 64, idx64: bool = False, ape: bool = False, fp8: bool = False,
                  num_warps: int | None = None, num_stages: int = 2) -> tuning.Launch:
    """The chunk-major kernel as a launch of these shapes runs it (dtype: the query's; fp8: e4m3 pages)."""
    group = num_heads // kv_heads
    constexprs = dict(GROUP=group, PER_ITEM=group if grouped else 1, DTYPE=TL_DTYPE[dtype], PS=page_size,
                      HALF=head_dim // 2, BLOCK_M=block_m, PREC=precision(dtype), IDX64=idx64, APE=ape, FP8=fp8,
                      NW=WORK, NU=USE, NI=ITEM, NP=PAGE)
    options = dict(num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages)
    return tuning.Launch(_shared_kernel, constexprs, options)


# a 16-bit query's partial outputs are stored in its dtype: normalised, they need no more precision
# than the output, and half the bytes halve the merge's reads (the chunk-major prefill's largest cost
# after its own kernel); log-sum-exps stay fp32
HALF_PARTIALS = True
SIDE_STREAM = True  # on a GPU, the chunk-major kernel runs beside the request kernels (benchmarks turn it off)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream the chunk-major kernel runs on while the request kernels run on the current
    one: the request kernels' programs fill the SMs its last programs leave idle. None on the CPU."""
    if device.type != "cuda" or not SIDE_STREAM:
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _shared_partials(q, k_pages, v_pages, k_scale, v_scale, plan: SharedPlan, q_pos, inv_freq, sm_scale,
                     ape_temperature, ape_scale, num_warps, num_stages):
    """Launch the chunk-major kernel: partial outputs [rows, H, D] and log2-sum-exps [rows, H],
    and the side stream it runs on (None: the current one), which the merge joins."""
    H, D = q.shape[1], q.shape[2]
    _, PS, Hkv, _ = k_pages.shape
    rows = max(1, plan.layout.rows)
    # allocated on the current stream, which waits for the side one before the merge reads them
    half = HALF_PARTIALS and q.dtype in (torch.float16, torch.bfloat16)
    sop = scratch((rows, H, D), q.device, q.dtype if half else torch.float32)
    slse = scratch((rows, H), q.device)
    side = None
    ape = ape_enabled(ape_temperature, ape_scale)
    launch = launch_config(q.dtype, H, Hkv, D, PS, grouped=plan.grouped, block_m=plan.block_m,
                           idx64=needs_idx64(k_pages, v_pages), ape=ape, fp8=k_pages.dtype == FP8,
                           num_warps=num_warps, num_stages=num_stages)
    if plan.layout.works:
        grid = (plan.layout.works, Hkv if plan.grouped else H)
        ks, vs, stride_ksp, stride_vsp, stride_st = scale_args(k_pages, k_scale, v_scale)
        if (side := _side_stream(q.device)) is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):  # a no-op for None
            _shared_kernel[grid](q, k_pages, v_pages, ks, vs, sop, slse, plan.head, plan.work, plan.use, plan.item,
                                 plan.page, q_pos, inv_freq, q.stride(0), q.stride(1), k_pages.stride(0),
                                 k_pages.stride(1), k_pages.stride(2), v_pages.stride(0), v_pages.stride(1),
                                 v_pages.stride(2), stride_ksp, stride_vsp, stride_st, H,
                                 *logit_scales(sm_scale, ape_temperature, ape_scale), **launch.constexprs,
                                 **launch.options)
    return sop, slse, side


def _merger(sop, slse, plan: SharedPlan, side: torch.cuda.Stream | None):
    """The request kernels' merge step: their split partials with the shared ones."""
    def merge(op, lse, o, num_splits):
        if side is not None:
            torch.cuda.current_stream(o.device).wait_stream(side)
        T, H, D = o.shape
        heads = min(MERGE_HEADS, triton.next_power_of_2(H))
        _merge_shared_kernel[(T, triton.cdiv(H, heads))](
            op, lse, sop, slse, plan.part_ptr, o, o.stride(0), o.stride(1), H, num_splits, D=D,
            SPLITS_P2=triton.next_power_of_2(num_splits), ROWS=MERGE_ROWS, HEADS=heads, num_warps=4)
    return merge


def shared_decode(q, k_pages, v_pages, pages: PageTable, plan: SharedPlan, q_pos, inv_freq, sm_scale,
                  ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale=None, v_scale=None,
                  num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2, out=None):
    o = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return o
    sop, slse, side = _shared_partials(q, k_pages, v_pages, k_scale, v_scale, plan, q_pos, inv_freq, sm_scale,
                                       ape_temperature, ape_scale, num_warps, num_stages)
    return decode.lazy_decode(q, k_pages, v_pages, pages, q_pos, inv_freq, sm_scale, True, ape_temperature,
                              ape_scale, k_scale, v_scale, num_splits=num_splits, out=o,
                              merge=_merger(sop, slse, plan, side))


def shared_prefill(q, k_pages, v_pages, pages: PageTable, plan: SharedPlan, cu_seqlens_q, q_pos, inv_freq, sm_scale,
                   ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale=None, v_scale=None,
                   max_seqlen_q: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int = 2, out=None):
    o = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0 or pages.batch == 0:
        return o
    sop, slse, side = _shared_partials(q, k_pages, v_pages, k_scale, v_scale, plan, q_pos, inv_freq, sm_scale,
                                       ape_temperature, ape_scale, num_warps, num_stages)
    return prefill.lazy_prefill(q, k_pages, v_pages, pages, cu_seqlens_q, q_pos, inv_freq, sm_scale, True,
                                ape_temperature, ape_scale, k_scale, v_scale, max_seqlen_q=max_seqlen_q,
                                num_splits=num_splits, out=o, merge=_merger(sop, slse, plan, side))
