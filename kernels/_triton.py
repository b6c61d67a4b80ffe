"""Triton kernels: lazy_prefill, lazy_decode (flash-decoding), rotate_copy.

Loaded through ``kernels/__init__.py``, which imports this file twice when needed (once
compiled, once under the Triton interpreter), so use the public API, not this module.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pages import PageTable


@triton.jit
def _rot_join(x1, x2, pos, invf, DTYPE: tl.constexpr):
    """R(pos) applied to rows given as halves x1, x2 [M, HALF]; returns one [M, 2*HALF] DTYPE tile.

    fp32 maths: ``pos`` is an int32 [M] difference (already subtracted), converted here.
    """
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    ang = pos.to(tl.float32)[:, None] * invf[None, :]
    c = tl.cos(ang)
    s = tl.sin(ang)
    r1 = (a1 * c - a2 * s).to(DTYPE)
    r2 = (a2 * c + a1 * s).to(DTYPE)
    M: tl.constexpr = r1.shape[0]
    H2: tl.constexpr = 2 * r1.shape[1]
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (M, H2))


@triton.jit
def _page_rows(ids_row, start_row, delta_row, len_row, e, emask, row_tok, kvh,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, IDX64: tl.constexpr):
    """Per key row of a block: K and V row offsets in the pools, logical position, validity."""
    pid = tl.load(ids_row + e, mask=emask, other=0)
    st = tl.load(start_row + e, mask=emask, other=0)
    dl = tl.load(delta_row + e, mask=emask, other=0)
    ln = tl.load(len_row + e, mask=emask, other=0)
    if IDX64:
        pid = pid.to(tl.int64)
    krow = pid * stride_kp + row_tok * stride_kt + kvh * stride_kh
    vrow = pid * stride_vp + row_tok * stride_vt + kvh * stride_vh
    return krow, vrow, st + dl + row_tok, emask & (row_tok < ln)


@triton.jit
def _softmax_step(s, kvalid, kpos, qpos, qmin, V, vrow, offs_d, acc, m_i, l_i,
                  DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One key block of online softmax: scores s [M, N] (log2 units) -> updated acc, m_i, l_i."""
    # mask only blocks that need it (padding rows, or keys after the earliest query)
    kmax = tl.max(tl.where(kvalid, kpos, 2147483647), axis=0)
    if kmax > qmin:
        s = tl.where(kvalid[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(V + vrow[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DTYPE), v, acc, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attn_runs(qptr, qmask, qpos, invf, acc, m_i, l_i,
               K, V, ids_row, delta_row, start_row, len_row, n_pages, kvh,
               p_lo, p_hi,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
               qk_scale,
               DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr,
               PREC: tl.constexpr, IDX64: tl.constexpr, SCAN: tl.constexpr):
    """Online softmax over page entries [p_lo, p_hi) of one request, run by run.

    A run is a stretch of consecutive page entries with one delta (at most SCAN entries).
    The query is rotated once per run, outside the inner loop, which is then exactly the
    rotate=False loop (the query is loop-invariant there); blocks are aligned to the run's
    first page, so no key block ever mixes deltas. Measured against two alternatives on the
    H200 (docs/benchmarks.md): a flat loop re-rotating on a delta change (its per-block scalar
    delta load and branch stall the pipeline: prefill 25% slower) and, in decode, rotating
    for every page unconditionally (20-25% slower).
    """
    PPB: tl.constexpr = BLOCK_N // PS
    qmin = tl.min(tl.where(qmask, qpos, 2147483647), axis=0)
    offs_n = tl.arange(0, BLOCK_N)
    row_page = offs_n // PS
    row_tok = offs_n % PS
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    p_hi = tl.minimum(p_hi, n_pages)
    if not ROTATE:
        q = tl.load(qptr[:, None] + offs_d[None, :], mask=qmask[:, None], other=0.0).to(DTYPE)
    p = p_lo
    while p < p_hi:
        if ROTATE:
            d = tl.load(delta_row + p)
            offs_s = tl.arange(0, SCAN)
            nd = tl.load(delta_row + p + offs_s, mask=(p + offs_s) < p_hi, other=0)
            differs = (nd != d) | ((p + offs_s) >= p_hi)
            run = tl.min(tl.where(differs, offs_s, SCAN), axis=0)
            qh1 = tl.load(qptr[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0)
            qh2 = tl.load(qptr[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0)
            q = _rot_join(qh1, qh2, qpos - d, invf, DTYPE)
        else:
            run = p_hi - p
        r_end = p + run
        for i in range(0, tl.cdiv(run, PPB)):
            e = p + i * PPB + row_page
            krow, vrow, kpos, kvalid = _page_rows(ids_row, start_row, delta_row, len_row, e, e < r_end, row_tok,
                                                  kvh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                                  stride_vh, IDX64)
            # unmasked: every row address is inside the pool (rows past the run read page 0);
            # their scores are replaced by -inf, so junk there is harmless
            k = tl.load(K + krow[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            acc, m_i, l_i = _softmax_step(s, kvalid, kpos, qpos, qmin, V, vrow, offs_d, acc, m_i, l_i, DTYPE, PREC)
        p = r_end
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(Q, K, V, O, IDS, DELTA, START, LEN, COUNT, CU, QPOS, INVF,
                    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
                    stride_vp, stride_vt, stride_vh, stride_ot, stride_oh, stride_tb,
                    qk_scale,
                    GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr,
                    PREC: tl.constexpr, IDX64: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(CU + b)
    q_end = tl.load(CU + b + 1)
    m0 = q_start + tile * BLOCK_M
    if m0 < q_end:
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mmask = offs_m < q_end
        offs_h = tl.arange(0, HALF)
        offs_d = tl.arange(0, 2 * HALF)
        qptr = Q + offs_m.to(tl.int64) * stride_qt + h * stride_qh
        qpos = tl.load(QPOS + offs_m, mask=mmask, other=0)
        invf = tl.load(INVF + offs_h)
        n_pages = tl.load(COUNT + b)
        acc = tl.zeros([BLOCK_M, 2 * HALF], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        tb = b.to(tl.int64) * stride_tb
        acc, m_i, l_i = _attn_runs(qptr, mmask, qpos, invf, acc, m_i, l_i,
                                   K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, n_pages, kvh,
                                   0, n_pages,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                   qk_scale, DTYPE, PS, HALF, BLOCK_M, BLOCK_N, ROTATE, PREC, IDX64, 64)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        orow = offs_m.to(tl.int64) * stride_ot + h * stride_oh
        tl.store(O + orow[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _decode_split_kernel(Q, K, V, OP, LSE, IDS, DELTA, START, LEN, COUNT, QPOS, INVF,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, stride_tb, num_heads, blk_per_split, num_splits,
                         qk_scale,
                         GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_H)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    qptr = Q + b.to(tl.int64) * stride_qb + heads * stride_qh
    qpos = tl.load(QPOS + b + offs_g * 0)
    invf = tl.load(INVF + offs_h)
    n_pages = tl.load(COUNT + b)
    n_blk = tl.cdiv(n_pages * PS, BLOCK_N)
    lo = sp * blk_per_split
    hi = tl.minimum(lo + blk_per_split, n_blk)
    acc = tl.zeros([BLOCK_H, 2 * HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    tb = b.to(tl.int64) * stride_tb
    if lo < hi:
        PPB: tl.constexpr = BLOCK_N // PS
        acc, m_i, l_i = _attn_runs(qptr, gmask, qpos, invf, acc, m_i, l_i,
                                   K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, n_pages, kvh,
                                   lo * PPB, hi * PPB,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                   qk_scale, DTYPE, PS, HALF, BLOCK_H, BLOCK_N, ROTATE, PREC, IDX64, 64)
    # partial results: OP [B, H, num_splits, D] (normalised), LSE [B, H, num_splits] (log2 domain)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    prow = (b.to(tl.int64) * num_heads + heads) * num_splits + sp
    tl.store(OP + prow[:, None] * (2 * HALF) + offs_d[None, :], o, mask=gmask[:, None])
    tl.store(LSE + prow, lse, mask=gmask)


@triton.jit
def _decode_merge_kernel(OP, LSE, O, stride_ob, stride_oh, num_heads, num_splits,
                         D: tl.constexpr, SPLITS_P2: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    smask = offs_s < num_splits
    offs_d = tl.arange(0, D)
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    lse = tl.load(LSE + base + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx_safe = tl.where(mx > float("-inf"), mx, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - mx_safe), 0.0)
    tot = tl.sum(w, axis=0)
    op = tl.load(OP + (base + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(op * w[:, None], axis=0)
    o = tl.where(tot > 0, o / tl.where(tot > 0, tot, 1.0), 0.0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(O.dtype.element_ty))


@triton.jit
def _rotate_copy_kernel(K, V, DK, DV, SRC, DST, DELTA, INVF,
                        stride_kp, stride_vp, stride_dkp, stride_dvp, rows_per_page,
                        HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    rb = tl.program_id(1)
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    d = tl.load(DELTA + i)
    offs_h = tl.arange(0, HALF)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < rows_per_page
    invf = tl.load(INVF + offs_h)
    ang = d.to(tl.float32) * invf
    c = tl.cos(ang)[None, :]
    s = tl.sin(ang)[None, :]
    roff = offs_r[:, None] * (2 * HALF) + offs_h[None, :]
    k1 = tl.load(K + src * stride_kp + roff, mask=rmask[:, None]).to(tl.float32)
    k2 = tl.load(K + src * stride_kp + HALF + roff, mask=rmask[:, None]).to(tl.float32)
    v1 = tl.load(V + src * stride_vp + roff, mask=rmask[:, None])
    v2 = tl.load(V + src * stride_vp + HALF + roff, mask=rmask[:, None])
    tl.store(DK + dst * stride_dkp + roff, (k1 * c - k2 * s).to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DK + dst * stride_dkp + HALF + roff, (k2 * c + k1 * s).to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + roff, v1.to(DV.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + HALF + roff, v2.to(DV.dtype.element_ty), mask=rmask[:, None])


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = 1.4426950408889634
POISON_SCRATCH = False  # tests: fill decode scratch with NaN to catch unwritten partials


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _idx64(k_pages, v_pages) -> bool:
    # int32 page offsets suffice while every element of the pools is addressable in int32
    return max(k_pages.shape[0] * k_pages.stride(0), v_pages.shape[0] * v_pages.stride(0)) >= 2**31


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _block_n(ps: int, head_dim: int) -> int:
    return max(ps, 64)


def lazy_prefill(q, k_pages, v_pages, pages: PageTable, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True,
                 max_seqlen_q: int | None = None, block_m: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, out=None):
    total, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    B = pages.ids.shape[0]
    o = torch.empty_like(q) if out is None else out
    if total == 0 or B == 0:
        return o
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if block_m is None:  # 64 x 64 tiles, 4 warps measured best on the H200 (docs/benchmarks.md)
        block_m = max(16, min(64, triton.next_power_of_2(max(1, max_seqlen_q))))
    block_n = block_n or _block_n(PS, D)
    block_n = max(block_n, PS)
    n_tiles = max(1, triton.cdiv(max_seqlen_q, block_m))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 2
    grid = (H, B, n_tiles)
    _prefill_kernel[grid](
        q, k_pages, v_pages, o, pages.ids, pages.delta, pages.start, pages.length, pages.count,
        cu_seqlens_q, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), o.stride(0), o.stride(1), pages.ids.stride(0),
        float(sm_scale) * _LOG2E,
        GROUP=H // Hkv, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2,
        BLOCK_M=block_m, BLOCK_N=block_n, ROTATE=bool(rotate), PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages),
        num_warps=num_warps, num_stages=num_stages)
    return o


def lazy_decode(q, k_pages, v_pages, pages: PageTable, q_pos, inv_freq, sm_scale, rotate=True,
                num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, out=None):
    B, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    G = H // Hkv
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    block_n = max(block_n or _block_n(PS, D), PS)
    max_blk = max(1, triton.cdiv(pages.ids.shape[1] * PS, block_n))  # upper bound, no host sync
    if num_splits is None:
        want = triton.cdiv(4 * _num_sms(q.device), B * Hkv)
        num_splits = max(1, min(want, max_blk, 64))
    blk_per_split = triton.cdiv(max_blk, num_splits)
    num_splits = triton.cdiv(max_blk, blk_per_split)
    scratch = torch.full if POISON_SCRATCH else (lambda shape, _v, **kw: torch.empty(shape, **kw))
    op = scratch((B, H, num_splits, D), float("nan"), device=q.device, dtype=torch.float32)
    lse = scratch((B, H, num_splits), float("nan"), device=q.device, dtype=torch.float32)
    block_h = max(16, triton.next_power_of_2(G))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_pages, v_pages, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), pages.ids.stride(0), H, blk_per_split, num_splits,
        float(sm_scale) * _LOG2E,
        GROUP=G, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2, BLOCK_H=block_h, BLOCK_N=block_n,
        ROTATE=bool(rotate), PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages),
        num_warps=num_warps or (8 if D == 64 else 4), num_stages=num_stages or 2)
    # the split count is a runtime argument (it follows the batch size; a constexpr would
    # compile a kernel per batch size); the merge rounds it up to a power of two
    _decode_merge_kernel[(B, H)](op, lse, o, o.stride(0), o.stride(1), H, num_splits, D=D,
                                 SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4)
    return o


def rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=None, dst_v=None, block_r: int = 64):
    dst_k = k_pages if dst_k is None else dst_k
    dst_v = v_pages if dst_v is None else dst_v
    N = src.shape[0]
    if N == 0:
        return dst_k, dst_v
    _, PS, Hkv, D = k_pages.shape
    rows = PS * Hkv
    block_r = min(block_r, triton.next_power_of_2(rows))
    grid = (N, triton.cdiv(rows, block_r))
    _rotate_copy_kernel[grid](k_pages, v_pages, dst_k, dst_v, src, dst, delta, inv_freq,
                              k_pages.stride(0), v_pages.stride(0), dst_k.stride(0), dst_v.stride(0), rows,
                              HALF=D // 2, BLOCK_R=block_r, num_warps=4)
    return dst_k, dst_v
