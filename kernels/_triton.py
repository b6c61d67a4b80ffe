"""Triton kernels: lazy_prefill, lazy_decode (flash-decoding), rotate_copy.

Loaded through ``kernels/__init__.py``, which imports this file twice when needed (once
compiled, once under the Triton interpreter), so use the public API, not this module.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pages import PageTable

# Integer arguments that change from call to call (the page table's width, the split count)
# are marked do_not_specialize: Triton would otherwise compile another variant whenever one
# became a multiple of 16, in the middle of a serving run.


@triton.jit
def _rotate(x1, x2, c, s):
    """R x for rows given as fp32 halves x1, x2 [M, HALF] and cos/sin broadcastable to them."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _join(r1, r2, DTYPE: tl.constexpr):
    """[r1 | r2] as one [M, 2*HALF] DTYPE tile (the rotate_half layout of the keys)."""
    M: tl.constexpr = r1.shape[0]
    H2: tl.constexpr = 2 * r1.shape[1]
    return tl.reshape(tl.permute(tl.join(r1.to(DTYPE), r2.to(DTYPE)), (0, 2, 1)), (M, H2))


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
def _softmax_step(s, kvalid, kpos, qpos, qmin, V, vrow, offs_d, v_tile, acc, m_i, l_i,
                  DTYPE: tl.constexpr, PREC: tl.constexpr, V_LOADED: tl.constexpr):
    """One key block of online softmax: scores s [M, N] (log2 units) -> updated acc, m_i, l_i.
    Values come from v_tile if V_LOADED (TMA), else are loaded here, after the exponentials:
    loading them before measured 6-16% slower in the pointer loops (docs/benchmarks.md)."""
    # mask only blocks that need it (padding rows, or keys after the earliest query)
    kmax = tl.max(tl.where(kvalid, kpos, 2147483647), axis=0)
    if kmax > qmin:
        s = tl.where(kvalid[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_LOADED:
        v = v_tile
    else:
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
               PREC: tl.constexpr, IDX64: tl.constexpr, SCAN: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over page entries [p_lo, p_hi) of one request, run by run.

    A run is a stretch of consecutive page entries with one delta (at most SCAN entries);
    blocks are aligned to the run's first page, so no key block ever mixes deltas, and the
    inner loop is exactly the rotate=False loop (the query is loop-invariant there).

    Rotation: a row at logical position m needs R(m - d) q for a run of delta d. With m0 the
    tile's earliest position, R(m - d) = R(m0 - d) R(m - m0): the row part R(m - m0) q is
    applied once, before the loop, and a run costs HALF cos/sin of the scalar (m0 - d), not
    one per element of the tile (those transcendentals were most of the cost of deferral,
    docs/benchmarks.md). Both angles are differences of int32 positions taken before the
    conversion to fp32, as in the one-step formula.
    """
    PPB: tl.constexpr = BLOCK_N // PS
    qmin = tl.min(tl.where(qmask, qpos, 2147483647), axis=0)
    offs_n = tl.arange(0, BLOCK_N)
    row_page = offs_n // PS
    row_tok = offs_n % PS
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    p_hi = tl.minimum(p_hi, n_pages)
    if ROTATE:
        qh1 = tl.load(qptr[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        qh2 = tl.load(qptr[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        ang = (qpos - qmin).to(tl.float32)[:, None] * invf[None, :]
        q1, q2 = _rotate(qh1, qh2, tl.cos(ang), tl.sin(ang))
    else:
        q = tl.load(qptr[:, None] + offs_d[None, :], mask=qmask[:, None], other=0.0).to(DTYPE)
    p = p_lo
    while p < p_hi:
        if ROTATE:
            d = tl.load(delta_row + p)
            offs_s = tl.arange(0, SCAN)
            nd = tl.load(delta_row + p + offs_s, mask=(p + offs_s) < p_hi, other=0)
            differs = (nd != d) | ((p + offs_s) >= p_hi)
            run = tl.min(tl.where(differs, offs_s, SCAN), axis=0)
            ang_run = (qmin - d).to(tl.float32) * invf
            r1, r2 = _rotate(q1, q2, tl.cos(ang_run)[None, :], tl.sin(ang_run)[None, :])
            q = _join(r1, r2, DTYPE)
        else:
            run = p_hi - p
        r_end = p + run
        for i in range(0, tl.cdiv(run, PPB)):
            e = p + i * PPB + row_page
            krow, vrow, kpos, kvalid = _page_rows(ids_row, start_row, delta_row, len_row, e, e < r_end, row_tok,
                                                  kvh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                                  stride_vh, IDX64)
            if TMA:  # one page per block: a TMA copy of the page's rows of this KV head
                pid = tl.load(ids_row + p + i)
                k = K.load([pid * PS, kvh * (2 * HALF)])
                v = V.load([pid * PS, kvh * (2 * HALF)])
            else:
                # unmasked: every row address is inside the pool (rows past the run read page 0);
                # their scores are replaced by -inf, so junk there is harmless
                k = tl.load(K + krow[:, None] + offs_d[None, :])
                v = 0
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            acc, m_i, l_i = _softmax_step(s, kvalid, kpos, qpos, qmin, V, vrow, offs_d, v, acc, m_i, l_i,
                                          DTYPE, PREC, TMA)
        p = r_end
    return acc, m_i, l_i


@triton.jit
def _attn_pages(qptr, qmask, qpos, acc, m_i, l_i,
                K, V, ids_row, delta_row, start_row, len_row, cs_row, kvh, p_lo, p_hi,
                stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                qk_scale,
                DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr):
    """Decode: online softmax over page entries [p_lo, p_hi), one page per key block.

    The query (one token's heads) is rotated for every page with that page's cos/sin row,
    precomputed by _decode_angles_kernel, so the loop has no branch and no transcendental:
    a run-by-run walk restarts the software pipeline at each delta change.
    """
    qmin = tl.min(tl.where(qmask, qpos, 2147483647), axis=0)
    offs_n = tl.arange(0, PS)
    row_page = offs_n * 0
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    if ROTATE:
        q1 = tl.load(qptr[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(qptr[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    else:
        q = tl.load(qptr[:, None] + offs_d[None, :], mask=qmask[:, None], other=0.0).to(DTYPE)
    for p in range(p_lo, p_hi):
        e = p + row_page
        krow, vrow, kpos, kvalid = _page_rows(ids_row, start_row, delta_row, len_row, e, e < p_hi, offs_n,
                                              kvh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                              stride_vh, IDX64)
        if ROTATE:
            cb = tl.load(cs_row + p * (2 * HALF) + offs_h)
            sb = tl.load(cs_row + p * (2 * HALF) + HALF + offs_h)
            # two half-width dots: joining the halves into one tile first measured 13-17% slower
            r1, r2 = _rotate(q1, q2, cb[None, :], sb[None, :])
            k1 = tl.load(K + krow[:, None] + offs_h[None, :])
            k2 = tl.load(K + krow[:, None] + HALF + offs_h[None, :])
            s = tl.dot(r1.to(DTYPE), tl.trans(k1), input_precision=PREC)
            s = tl.dot(r2.to(DTYPE), tl.trans(k2), s, input_precision=PREC)
        else:
            k = tl.load(K + krow[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
        acc, m_i, l_i = _softmax_step(s * qk_scale, kvalid, kpos, qpos, qmin, V, vrow, offs_d, 0, acc, m_i, l_i,
                                      DTYPE, PREC, False)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_tb", "max_pages"])
def _decode_angles_kernel(DELTA, COUNT, QPOS, INVF, CS, stride_tb, max_pages,
                          HALF: tl.constexpr, BLOCK_P: tl.constexpr):
    """CS[b, p] = [cos | sin] of (q_pos[b] - delta[b, p]) * inv_freq: one row per page entry."""
    b = tl.program_id(0)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = offs_p < tl.load(COUNT + b)
    d = tl.load(DELTA + b.to(tl.int64) * stride_tb + offs_p, mask=pmask, other=0)
    offs_h = tl.arange(0, HALF)
    ang = (tl.load(QPOS + b) - d).to(tl.float32)[:, None] * tl.load(INVF + offs_h)[None, :]
    row = (b.to(tl.int64) * max_pages + offs_p)[:, None] * (2 * HALF) + offs_h[None, :]
    tl.store(CS + row, tl.cos(ang), mask=pmask[:, None])
    tl.store(CS + row + HALF, tl.sin(ang), mask=pmask[:, None])


@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(Q, K, V, O, IDS, DELTA, START, LEN, COUNT, CU, QPOS, INVF,
                    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
                    stride_vp, stride_vt, stride_vh, stride_ot, stride_oh, stride_tb,
                    qk_scale,
                    GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATE: tl.constexpr,
                    PREC: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr):
    # one query head per program: packing the GQA group into the tile's rows (each key block
    # read once per group) measured no faster on the H200 (docs/benchmarks.md)
    head = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(CU + b)
    q_end = tl.load(CU + b + 1)
    if q_start + tile * BLOCK_M < q_end:
        kvh = head // GROUP
        tok = q_start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = tok < q_end
        offs_h = tl.arange(0, HALF)
        offs_d = tl.arange(0, 2 * HALF)
        qptr = Q + tok.to(tl.int64) * stride_qt + head * stride_qh
        qpos = tl.load(QPOS + tok, mask=mmask, other=0)
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
                                   qk_scale, DTYPE, PS, HALF, BLOCK_M, BLOCK_N, ROTATE, PREC, IDX64, 64, TMA)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        orow = tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(O + orow[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=mmask[:, None])


@triton.jit(do_not_specialize=["stride_tb", "num_splits", "max_pages"])
def _decode_split_kernel(Q, K, V, OP, LSE, IDS, DELTA, START, LEN, COUNT, QPOS, INVF, CS,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, stride_tb, num_heads, num_splits,
                         max_pages, qk_scale,
                         GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr, FLAT: tl.constexpr):
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
    # each request's own blocks split evenly (not the table's width: a CUDA graph captures one
    # wide table for requests of any length)
    n_blk = tl.cdiv(n_pages * PS, BLOCK_N)
    blk_per_split = tl.cdiv(n_blk, num_splits)
    lo = sp * blk_per_split
    hi = tl.minimum(lo + blk_per_split, n_blk)
    acc = tl.zeros([BLOCK_H, 2 * HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    tb = b.to(tl.int64) * stride_tb
    if lo < hi and FLAT:
        acc, m_i, l_i = _attn_pages(qptr, gmask, qpos, acc, m_i, l_i,
                                    K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb,
                                    CS + b.to(tl.int64) * max_pages * (2 * HALF), kvh, lo, hi,
                                    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                    qk_scale, DTYPE, PS, HALF, ROTATE, PREC, IDX64)
    if lo < hi and not FLAT:
        PPB: tl.constexpr = BLOCK_N // PS
        acc, m_i, l_i = _attn_runs(qptr, gmask, qpos, invf, acc, m_i, l_i,
                                   K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, n_pages, kvh,
                                   lo * PPB, hi * PPB,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                   qk_scale, DTYPE, PS, HALF, BLOCK_H, BLOCK_N, ROTATE, PREC, IDX64, 64, False)
    # partial results: OP [B, H, num_splits, D] (normalised), LSE [B, H, num_splits] (log2 domain)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    prow = (b.to(tl.int64) * num_heads + heads) * num_splits + sp
    tl.store(OP + prow[:, None] * (2 * HALF) + offs_d[None, :], o, mask=gmask[:, None])
    tl.store(LSE + prow, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
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
    r1, r2 = _rotate(k1, k2, c, s)
    tl.store(DK + dst * stride_dkp + roff, r1.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DK + dst * stride_dkp + HALF + roff, r2.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + roff, v1.to(DV.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + HALF + roff, v2.to(DV.dtype.element_ty), mask=rmask[:, None])


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOG2E = 1.4426950408889634
POISON_SCRATCH = False  # tests: fill decode scratch with NaN to catch unwritten partials


def _scratch(shape, device):
    """fp32 working memory for decode, NaN-filled under the tests' POISON_SCRATCH."""
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), device=device, dtype=torch.float32)
    return torch.empty(shape, device=device, dtype=torch.float32)


def _prec(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _idx64(k_pages, v_pages) -> bool:
    # int32 page offsets suffice while every element of the pools is addressable in int32
    return max(k_pages.shape[0] * k_pages.stride(0), v_pages.shape[0] * v_pages.stride(0)) >= 2**31


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def _hopper_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _is_hopper(device) -> bool:
    return device.type == "cuda" and _hopper_index(device.index if device.index is not None else 0)


def _prefill_block_n(ps: int, head_dim: int) -> int:
    # measured on the H200 (docs/benchmarks.md): 128-key blocks at head dim 64 (15% faster),
    # 64 at head dim 128 (128 is 13-50% slower)
    return max(ps, 128 if head_dim == 64 else 64)


def lazy_prefill(q, k_pages, v_pages, pages: PageTable, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True,
                 max_seqlen_q: int | None = None, block_m: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, tma: bool | None = None, out=None):
    total, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    B = pages.ids.shape[0]
    G = H // Hkv
    o = torch.empty_like(q) if out is None else out
    if total == 0 or B == 0:
        return o
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if block_m is None:
        # 64 x 64 tiles, 4 warps measured best on the H200 (docs/benchmarks.md); 64 rows even
        # for shorter queries: a tile size that followed the query length compiled a new
        # kernel in the middle of a serving run (a 1-2 s stall in bench_e2e's open loop)
        block_m = 64
    block_n = max(block_n or _prefill_block_n(PS, D), PS)
    n_tiles = max(1, triton.cdiv(max_seqlen_q, block_m))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 2
    grid = (H, B, n_tiles)
    kk, vv = k_pages, v_pages
    tma_fits = block_n == PS and all(t.stride(0) == PS * Hkv * D for t in (k_pages, v_pages))
    if tma is None:  # measured at head dim 128 only (docs/benchmarks.md): slower at 64
        tma = tma_fits and D == 128 and _is_hopper(q.device)
    if tma:  # Hopper TMA loads of whole pages: one page per key block, pages contiguous
        if not tma_fits:
            raise ValueError("tma needs block_n == page_size and contiguous pools")
        from triton.tools.tensor_descriptor import TensorDescriptor

        kk, vv = (TensorDescriptor.from_tensor(t.view(-1, Hkv * D), [PS, D]) for t in (k_pages, v_pages))
    _prefill_kernel[grid](
        q, kk, vv, o, pages.ids, pages.delta, pages.start, pages.length, pages.count,
        cu_seqlens_q, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), o.stride(0), o.stride(1), pages.ids.stride(0),
        float(sm_scale) * _LOG2E,
        GROUP=G, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2,
        BLOCK_M=block_m, BLOCK_N=block_n, ROTATE=bool(rotate), PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages),
        TMA=bool(tma), num_warps=num_warps, num_stages=num_stages)
    return o


def _flat_decode(head_dim: int) -> bool:
    # page by page at head dim 128, run by run at 64: each measured faster (docs/benchmarks.md)
    return head_dim == 128


def decode_angles(pages: PageTable, q_pos, inv_freq):
    """The flat decode loop's [cos | sin] row per page entry, [B, max_pages, D] fp32, or None at
    head dims that walk run by run (64). Depends only on the step: compute once for all layers."""
    D = 2 * inv_freq.shape[0]
    return _angles_table(pages, q_pos, inv_freq) if _flat_decode(D) else None


def _angles_table(pages: PageTable, q_pos, inv_freq):
    D = 2 * inv_freq.shape[0]
    B, max_pages = pages.ids.shape
    cs = _scratch((B, max_pages, D), inv_freq.device)
    if B and max_pages:
        _decode_angles_kernel[(B, triton.cdiv(max_pages, 32))](
            pages.delta, pages.count, q_pos, inv_freq, cs, pages.delta.stride(0), max_pages,
            HALF=D // 2, BLOCK_P=32, num_warps=4)
    return cs


def lazy_decode(q, k_pages, v_pages, pages: PageTable, q_pos, inv_freq, sm_scale, rotate=True,
                num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, flat: bool | None = None, angles=None, out=None):
    B, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    G = H // Hkv
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    if flat is None:
        flat = _flat_decode(D)
    block_n = PS if flat else max(block_n or 64, PS)
    max_pages = pages.ids.shape[1]
    max_blk = max(1, triton.cdiv(max_pages * PS, block_n))  # upper bound, no host sync
    if num_splits is None:
        # about 4 programs per SM; measured against 8 per SM (docs/benchmarks.md): best at
        # 32 x 8K (300 vs 338 us), 5% behind at 8 x 32K (351 vs 332 us)
        want = triton.cdiv(4 * _num_sms(q.device), B * Hkv)
        num_splits = max(1, min(want, max_blk, 64))
    op = _scratch((B, H, num_splits, D), q.device)
    lse = _scratch((B, H, num_splits), q.device)
    cs = op  # unused unless the flat loop rotates
    if flat and rotate:
        if angles is None:
            angles = _angles_table(pages, q_pos, inv_freq)
        if tuple(angles.shape) != (B, max_pages, D):
            raise ValueError(f"angles must be decode_angles(...) of this step: [{B}, {max_pages}, {D}] fp32")
        cs = angles
    block_h = max(16, triton.next_power_of_2(G))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_pages, v_pages, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count, q_pos, inv_freq,
        cs, q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), pages.ids.stride(0), H, num_splits,
        max_pages, float(sm_scale) * _LOG2E,
        GROUP=G, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2, BLOCK_H=block_h, BLOCK_N=block_n,
        ROTATE=bool(rotate), PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages), FLAT=bool(flat),
        num_warps=num_warps or (8 if D == 64 else 4), num_stages=num_stages or 2)
    # the split count is a runtime argument, not specialised (it follows the batch size; a
    # new value must not compile a new kernel mid-run); the merge rounds it up to a power of two
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
