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
def _query_at(qrows, qmask, qmin, d, invf, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """R(qmin - d) applied to query rows already rotated by R(m - qmin), cast to DTYPE."""
    offs_h = tl.arange(0, HALF)
    q1 = tl.load(qrows[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qrows[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    ang = (qmin - d).to(tl.float32) * invf  # int32 difference first, then fp32
    r1, r2 = _rotate(q1, q2, tl.cos(ang)[None, :], tl.sin(ang)[None, :])
    return _join(r1, r2, DTYPE)


@triton.jit
def _page_step(q, p, d, qpos, qmin, acc, m_i, l_i, K, V, ids_row, start_row, len_row, kvh,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
               DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
               PREC: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over page entry p (of delta d): one key block of PS keys."""
    offs_n = tl.arange(0, PS)
    offs_d = tl.arange(0, 2 * HALF)
    pid = tl.load(ids_row + p)
    k0 = tl.load(start_row + p) + d  # logical position of the page's first key
    n_valid = tl.load(len_row + p)
    if IDX64:
        pid = pid.to(tl.int64)
    if TMA:  # Hopper: the page's rows of this KV head as one TMA tile
        k = K.load([pid * PS, kvh * (2 * HALF)])
    else:
        k = tl.load(K + pid * stride_kp + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    # mask only pages that need it: partly filled, or holding keys after the earliest query
    if (n_valid < PS) | (k0 + PS - 1 > qmin):
        keep = (offs_n < n_valid)[None, :] & ((k0 + offs_n)[None, :] <= qpos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    # values are read whole, padding rows included: their weights are 0, and the pool is
    # zero-initialised, so they are finite
    if TMA:
        v = V.load([pid * PS, kvh * (2 * HALF)])
    else:
        v = tl.load(V + pid * stride_vp + kvh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :])
    acc = acc * alpha[:, None]
    acc = tl.dot(pr.to(DTYPE), v, acc, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attn_pages(qrows, qmask, qpos, qmin, invf, acc, m_i, l_i,
                K, V, ids_row, delta_row, start_row, len_row, kvh, p_lo, p_hi,
                stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                qk_scale,
                DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over page entries [p_lo, p_hi) of one request, one page per key block.

    qrows: row pointers to the query, already rotated by R(m - qmin) if ROTATE (qmin: the
    earliest position among the rows). A row at position m needs R(m - d) q against a page
    of delta d, and R(m - d) = R(qmin - d) R(m - qmin): a page costs HALF cos/sin of one
    scalar. The rotated query is carried through one flat loop and rebuilt only where the
    delta changes (a chunk's pages share one), so most pages cost what they cost without
    rotation: one full-width dot. The rebuild re-reads the rows (L2) rather than hold them
    in fp32 registers across the loop. Walking run by run instead (a branch-free inner loop
    per delta) measured 7-8% slower in prefill (docs/benchmarks.md).
    """
    if ROTATE:
        q = tl.zeros([BLOCK_M, 2 * HALF], dtype=DTYPE)
    else:
        q = tl.load(qrows[:, None] + tl.arange(0, 2 * HALF)[None, :], mask=qmask[:, None], other=0.0).to(DTYPE)
    d_cur = -2147483647 - 1  # no page has delta INT32_MIN: the first page builds the query
    for p in range(p_lo, p_hi):
        d = tl.load(delta_row + p)
        if ROTATE:
            if d != d_cur:
                q = _query_at(qrows, qmask, qmin, d, invf, HALF, DTYPE)
                d_cur = d
        acc, m_i, l_i = _page_step(q, p, d, qpos, qmin, acc, m_i, l_i, K, V, ids_row, start_row, len_row, kvh,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                                   DTYPE, PS, HALF, PREC, IDX64, TMA)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(Q, K, V, O, QR, IDS, DELTA, START, LEN, COUNT, CU, QPOS, INVF,
                    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
                    stride_vp, stride_vt, stride_vh, stride_ot, stride_oh, stride_tb,
                    qk_scale,
                    GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, ROTATE: tl.constexpr,
                    PREC: tl.constexpr, IDX64: tl.constexpr):
    # one query head per program: packing the GQA group into the tile's rows (each key block
    # read once per group) measured no faster on the H200 (docs/benchmarks.md)
    head = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.program_id(2)
    num_heads = tl.num_programs(0)
    q_start = tl.load(CU + b)
    q_end = tl.load(CU + b + 1)
    if q_start + tile * BLOCK_M < q_end:
        kvh = head // GROUP
        tok = q_start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = tok < q_end
        offs_h = tl.arange(0, HALF)
        offs_d = tl.arange(0, 2 * HALF)
        qrows = Q + tok.to(tl.int64) * stride_qt + head * stride_qh
        qpos = tl.load(QPOS + tok, mask=mmask, other=0)
        qmin = tl.min(tl.where(mmask, qpos, 2147483647), axis=0)
        invf = tl.load(INVF + offs_h)
        if ROTATE:
            # the row part R(m - qmin) q, once, into fp32 scratch QR [total, heads, D]
            q1 = tl.load(qrows[:, None] + offs_h[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            q2 = tl.load(qrows[:, None] + HALF + offs_h[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            ang = (qpos - qmin).to(tl.float32)[:, None] * invf[None, :]
            r1, r2 = _rotate(q1, q2, tl.cos(ang), tl.sin(ang))
            qrows = QR + (tok.to(tl.int64) * num_heads + head) * (2 * HALF)
            tl.store(qrows[:, None] + offs_h[None, :], r1, mask=mmask[:, None])
            tl.store(qrows[:, None] + HALF + offs_h[None, :], r2, mask=mmask[:, None])
            tl.debug_barrier()  # the loop's threads read rows other threads wrote
        acc = tl.zeros([BLOCK_M, 2 * HALF], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        tb = b.to(tl.int64) * stride_tb
        acc, m_i, l_i = _attn_pages(qrows, mmask, qpos, qmin, invf, acc, m_i, l_i,
                                    K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, 0, tl.load(COUNT + b),
                                    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                    qk_scale, DTYPE, PS, HALF, BLOCK_M, ROTATE, PREC, IDX64, False)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        orow = tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(O + orow[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=mmask[:, None])


@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _decode_split_kernel(Q, K, V, OP, LSE, IDS, DELTA, START, LEN, COUNT, QPOS, INVF,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, stride_tb, num_heads, num_splits,
                         qk_scale,
                         GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
                         TMA: tl.constexpr):
    # one program: the query heads of one KV head (each page read once for the group) over
    # one split of one request's pages
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_H)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    qrows = Q + b.to(tl.int64) * stride_qb + heads * stride_qh
    qmin = tl.load(QPOS + b)  # one token: the row part of the rotation is the identity
    qpos = qmin + offs_g * 0
    invf = tl.load(INVF + offs_h)
    n_pages = tl.load(COUNT + b)
    # each request's own pages split evenly (not the table's width: a CUDA graph captures one
    # wide table for requests of any length)
    per_split = tl.cdiv(n_pages, num_splits)
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, n_pages)
    acc = tl.zeros([BLOCK_H, 2 * HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    tb = b.to(tl.int64) * stride_tb
    if lo < hi:
        acc, m_i, l_i = _attn_pages(qrows, gmask, qpos, qmin, invf, acc, m_i, l_i,
                                    K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, lo, hi,
                                    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                    qk_scale, DTYPE, PS, HALF, BLOCK_H, ROTATE, PREC, IDX64, TMA)
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


def _use_tma(tma: bool | None, k_pages, v_pages, device) -> bool:
    """Hopper TMA loads of whole pages (contiguous pools). Default on at head dim 128: fewer
    registers than pointer loads and a little faster in decode (docs/benchmarks.md)."""
    _, PS, Hkv, D = k_pages.shape
    fits = all(t.stride(0) == PS * Hkv * D for t in (k_pages, v_pages))
    if tma is None:
        return fits and D == 128 and _is_hopper(device)
    if tma and not fits:
        raise ValueError("tma needs contiguous pools")
    return bool(tma)


def _page_descriptors(k_pages, v_pages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, PS, Hkv, D = k_pages.shape
    return tuple(TensorDescriptor.from_tensor(t.view(-1, Hkv * D), [PS, D]) for t in (k_pages, v_pages))


def lazy_prefill(q, k_pages, v_pages, pages: PageTable, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True,
                 max_seqlen_q: int | None = None, block_m: int = 64, num_warps: int | None = None,
                 num_stages: int = 2, out=None):
    total, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    B = pages.ids.shape[0]
    o = torch.empty_like(q) if out is None else out
    if total == 0 or B == 0:
        return o
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    # 64-row tiles, 4 warps measured best on the H200 (docs/benchmarks.md); 64 rows even for
    # shorter queries: a tile size that followed the query length compiled a new kernel in
    # the middle of a serving run (a 1-2 s stall in bench_e2e's open loop)
    n_tiles = max(1, triton.cdiv(max_seqlen_q, block_m))
    # the query rows rotated to their tile's first position (fp32), read back at each delta change
    q_rows = torch.empty((total, H, D), device=q.device, dtype=torch.float32) if rotate else q
    _prefill_kernel[(H, B, n_tiles)](
        q, k_pages, v_pages, o, q_rows, pages.ids, pages.delta, pages.start, pages.length, pages.count,
        cu_seqlens_q, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), o.stride(0), o.stride(1), pages.ids.stride(0),
        float(sm_scale) * _LOG2E,
        GROUP=H // Hkv, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2, BLOCK_M=block_m, ROTATE=bool(rotate),
        PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages),
        num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages)
    return o


# Decode programs per SM that run at once, by head dim. 128: what the registers allow the
# default (TMA) configuration, 3 (scripts/kernel_regs.py, sm_90a; tests/test_kernel_regs.py
# keeps it in step). 64: measured, not derived: one 8-warp program fits per SM, yet grids of
# about 4 per SM ran fastest (docs/benchmarks.md).
DECODE_PROGRAMS_PER_SM = {128: 3, 64: 4}


@functools.lru_cache(maxsize=1024)
def _decode_splits(n_programs: int, max_splits: int, slots: int) -> int:
    """Splits per (request, KV head): time ~ waves x (a split's share of the walk + a fixed
    cost), since a last wave that fills part of the GPU costs as much as a full one. The
    fixed cost (prologue, partial write, merge) is taken as 1/32 of a request's walk (4
    pages of an 8K context). It picks 3 splits at 32 x 8K (2 waves) and 6 at 8 x 32K (1),
    each measured best (docs/benchmarks.md)."""
    return min(range(1, max(1, min(64, max_splits)) + 1),
               key=lambda s: (triton.cdiv(n_programs * s, slots) * (1 / s + 1 / 32), s))


def lazy_decode(q, k_pages, v_pages, pages: PageTable, q_pos, inv_freq, sm_scale, rotate=True,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                tma: bool | None = None, block_h: int | None = None, out=None):
    B, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    G = H // Hkv
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    if num_splits is None:  # from the table's width (an upper bound on any request's pages; no host sync)
        slots = DECODE_PROGRAMS_PER_SM.get(D, 2) * _num_sms(q.device)
        num_splits = _decode_splits(B * Hkv, pages.ids.shape[1], slots)
    op = _scratch((B, H, num_splits, D), q.device)
    lse = _scratch((B, H, num_splits), q.device)
    kk, vv = k_pages, v_pages
    tma = _use_tma(tma, k_pages, v_pages, q.device)
    if tma:
        kk, vv = _page_descriptors(k_pages, v_pages)
    # 16 rows is the smallest dot tile; 64 (a Hopper warpgroup's) measured 1.3-1.4x slower
    block_h = block_h or max(16, triton.next_power_of_2(G))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, kk, vv, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), pages.ids.stride(0), H, num_splits,
        float(sm_scale) * _LOG2E,
        GROUP=G, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2, BLOCK_H=block_h, ROTATE=bool(rotate),
        PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages), TMA=tma,
        num_warps=num_warps or (8 if D == 64 else 4), num_stages=num_stages)
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
