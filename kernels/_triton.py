"""Triton kernels: lazy_prefill, lazy_decode (flash-decoding), rotate_copy.

Loaded through ``kernels/__init__.py``, which imports this file twice when needed (once
compiled, once under the Triton interpreter), so use the public API, not this module.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import libdevice

from .pages import PageTable

# Integer arguments that change from call to call (the page table's width, the split count)
# are marked do_not_specialize: Triton would otherwise compile another variant whenever one
# became a multiple of 16, in the middle of a serving run.


# This module is loaded once per mode (kernels/__init__.py): compiled, or under the interpreter.
INTERPRETED = knobs.runtime.interpret
# Compiled kernels take cos/sin from the hardware's approximations after an explicit range
# reduction; the interpreter (which cannot call libdevice) uses tl.cos/tl.sin.
FAST_TRIG: tl.constexpr = tl.constexpr(not INTERPRETED)
_TWO_PI_HI: tl.constexpr = tl.constexpr(6.2831854820251465)  # float32(2 pi)
_TWO_PI_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)  # 2 pi - _TWO_PI_HI
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(x):
    """cos x and sin x of fp32 angles.

    The library's precise cosf/sinf cost about 40 instructions each, plus a slow path for huge
    arguments, and a prefill query rebuild needs 32 angles per thread. Reducing x by the
    nearest multiple of 2 pi (two FMAs, 2 pi split in two parts) and calling the hardware's
    approximations costs under 10, and stays within 1e-6 of the precise values for
    |x| < 2**17 (the angle x itself, a position times a frequency in fp32, already carries
    an error of up to |x| * 2**-24)."""
    if FAST_TRIG:
        k = libdevice.rint(x * _INV_TWO_PI)
        r = tl.fma(-k, _TWO_PI_HI, x)
        r = tl.fma(-k, _TWO_PI_LO, r)
        c = libdevice.fast_cosf(r)
        s = libdevice.fast_sinf(r)
    else:
        c = tl.cos(x)
        s = tl.sin(x)
    return c, s


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
def _query_at(qrows, qmask, qpos, d, invf, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """R(m - d) q for query rows at positions m against a page of delta d, cast to DTYPE."""
    offs_h = tl.arange(0, HALF)
    q1 = tl.load(qrows[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qrows[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    c, s = _cos_sin((qpos - d).to(tl.float32)[:, None] * invf[None, :])  # int32 difference, then fp32
    r1, r2 = _rotate(q1, q2, c, s)
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

    qrows: row pointers to the query (qmin: the earliest position among the rows, which
    decides where the causal mask can start). A row at position m needs R(m - d) q against a
    page of delta d. The rotated query is carried through one flat loop and rebuilt only
    where the delta changes (a chunk's pages share one), so most pages cost what they cost
    without rotation: one full-width dot. A rebuild re-reads the rows (L2) and rotates them
    from scratch, in fp32, by each row's own angle. Splitting R(m - d) into R(qmin - d)
    R(m - qmin), with the row part kept in an fp32 scratch, needs fewer angles per rebuild
    but measured 3% slower once cos/sin were cheap (docs/benchmarks.md). Walking run by run
    instead (a branch-free inner loop per delta) measured 7-8% slower in prefill.
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
                q = _query_at(qrows, qmask, qpos, d, invf, HALF, DTYPE)
                d_cur = d
        acc, m_i, l_i = _page_step(q, p, d, qpos, qmin, acc, m_i, l_i, K, V, ids_row, start_row, len_row, kvh,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
                                   DTYPE, PS, HALF, PREC, IDX64, TMA)
    return acc, m_i, l_i


@triton.jit
def _split_range(n_pages, num_splits, sp):
    """Page entries [lo, hi) of split sp: a request's own pages split evenly (not the table's
    width: a CUDA graph captures one wide table for requests of any length)."""
    per_split = tl.cdiv(n_pages, num_splits)
    lo = sp * per_split
    return lo, tl.minimum(lo + per_split, n_pages)


@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _prefill_kernel(Q, K, V, O, OP, LSE, IDS, DELTA, START, LEN, COUNT, CU, QPOS, INVF,
                    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
                    stride_vp, stride_vt, stride_vh, stride_ot, stride_oh, stride_tb, num_splits,
                    qk_scale,
                    GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, ROTATE: tl.constexpr,
                    PREC: tl.constexpr, IDX64: tl.constexpr, SPLIT: tl.constexpr):
    # one program: one query head (packing the GQA group into the tile's rows, each key block
    # read once per group, measured no faster on the H200: docs/benchmarks.md) of one tile of
    # one request, over one split of the request's pages (SPLIT: partial results to OP/LSE,
    # merged by _merge_splits_kernel; otherwise straight to O)
    head = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.program_id(2) // num_splits if SPLIT else tl.program_id(2)
    sp = tl.program_id(2) % num_splits if SPLIT else 0
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
        acc = tl.zeros([BLOCK_M, 2 * HALF], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        tb = b.to(tl.int64) * stride_tb
        n_pages = tl.load(COUNT + b)
        lo = 0
        hi = n_pages
        if SPLIT:  # (unsplit, the walk keeps its fixed start: runtime bounds took the
            # rotation-free kernel from 208 to 229 registers and measured it 5-18% slower)
            lo, hi = _split_range(n_pages, num_splits, sp)
        acc, m_i, l_i = _attn_pages(qrows, mmask, qpos, qmin, invf, acc, m_i, l_i,
                                    K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, lo, hi,
                                    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                    qk_scale, DTYPE, PS, HALF, BLOCK_M, ROTATE, PREC, IDX64, False)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        if SPLIT:
            _store_partial(OP, LSE, o, m_i, l_i, tok.to(tl.int64) * tl.num_programs(0) + head, num_splits, sp,
                           mmask, offs_d)
        else:
            orow = tok.to(tl.int64) * stride_ot + head * stride_oh
            tl.store(O + orow[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=mmask[:, None])


@triton.jit
def _store_partial(OP, LSE, o, m_i, l_i, rows, num_splits, sp, mask, offs_d):
    """One split's normalised output and log2-sum-exp: OP [rows, num_splits, D], LSE [rows, num_splits]."""
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    prow = rows * num_splits + sp
    tl.store(OP + prow[:, None] * offs_d.shape[0] + offs_d[None, :], o, mask=mask[:, None])
    tl.store(LSE + prow, lse, mask=mask)


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
    qmin = tl.load(QPOS + b)  # one token: every row (query head) is at the same position
    qpos = qmin + offs_g * 0
    invf = tl.load(INVF + offs_h)
    lo, hi = _split_range(tl.load(COUNT + b), num_splits, sp)
    acc = tl.zeros([BLOCK_H, 2 * HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    tb = b.to(tl.int64) * stride_tb
    if lo < hi:
        acc, m_i, l_i = _attn_pages(qrows, gmask, qpos, qmin, invf, acc, m_i, l_i,
                                    K, V, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, lo, hi,
                                    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                    qk_scale, DTYPE, PS, HALF, BLOCK_H, ROTATE, PREC, IDX64, TMA)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    _store_partial(OP, LSE, o, m_i, l_i, b.to(tl.int64) * num_heads + heads, num_splits, sp, gmask, offs_d)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(OP, LSE, O, stride_ob, stride_oh, num_heads, num_splits,
                         D: tl.constexpr, SPLITS_P2: tl.constexpr):
    # one program per (row, head): a decode request or a prefill query token
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
    c, s = _cos_sin(d.to(tl.float32) * invf)
    c = c[None, :]
    s = s[None, :]
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
POISON_SCRATCH = False  # tests: fill split scratch with NaN to catch unwritten partials


def _scratch(shape, device):
    """fp32 working memory for split partials, NaN-filled under the tests' POISON_SCRATCH."""
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


def _use_tma(tma: bool, k_pages, v_pages, device) -> bool:
    """Hopper TMA loads of whole pages: an option, off by default. On the H200 they took the
    same registers as pointer loads and measured the same in four runs of five, 25% slower in
    the fifth (docs/benchmarks.md)."""
    if not tma:
        return False
    _, PS, Hkv, D = k_pages.shape
    if any(t.stride(0) != PS * Hkv * D for t in (k_pages, v_pages)):
        raise ValueError("tma needs contiguous pools")
    if device.type == "cuda" and not _is_hopper(device):
        raise ValueError("tma needs a Hopper GPU (compute capability 9.0 or later)")
    return True


def _page_descriptors(k_pages, v_pages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, PS, Hkv, D = k_pages.shape
    return tuple(TensorDescriptor.from_tensor(t.view(-1, Hkv * D), [PS, D]) for t in (k_pages, v_pages))


# Prefill launch defaults by head dim, measured on the H200 (docs/benchmarks.md): 3 stages
# (2-5% faster than 2 at 128); at 64, registers capped at 168 so that 3 programs fit per SM
# instead of 2 (up to 19% faster, no spills; at 128 the cap spills and runs 35% slower).
PREFILL_TUNING = {128: dict(num_stages=3), 64: dict(num_stages=3, maxnreg=168)}

# Programs per SM that run at once, by head dim: what the registers allow each kernel's
# default configuration (prefill: 64 rows, 4 warps and PREFILL_TUNING; decode: 4 warps at
# 128, 8 at 64), as ptxas allocates them for sm_90a (scripts/kernel_regs.py;
# tests/test_kernel_regs.py keeps these in step).
PREFILL_PROGRAMS_PER_SM = {128: 2, 64: 3}
DECODE_PROGRAMS_PER_SM = {128: 3, 64: 3}


@functools.lru_cache(maxsize=1024)
def _num_splits(n_programs: int, max_splits: int, slots: int) -> int:
    """How many parts to split each program's pages into, given n_programs unsplit programs
    and `slots` programs resident at once on the GPU.

    Time ~ waves x (a split's share of the walk + a fixed cost), since a last wave that fills
    part of the GPU costs as much as a full one; the fixed cost (prologue, partial write,
    merge) is taken as 1/32 of the walk (4 pages of an 8K context). A grid that leaves
    slots idle is thus split until it fills them. Decode: 3 splits at 32 x 8K (2 waves), 6 at
    8 x 32K (1), each measured best. Prefill: Llama-8B's 32 heads fill the GPU unsplit at the
    benchmark's sizes; SmolLM2's 9 heads are split 5 ways (docs/benchmarks.md)."""
    return min(range(1, max(1, min(64, max_splits)) + 1),
               key=lambda s: (triton.cdiv(n_programs * s, slots) * (1 / s + 1 / 32), s))


def lazy_prefill(q, k_pages, v_pages, pages: PageTable, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True,
                 max_seqlen_q: int | None = None, block_m: int = 64, num_warps: int | None = None,
                 num_stages: int | None = None, num_splits: int | None = None, maxnreg: int | None = None,
                 out=None):
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
    tuning = PREFILL_TUNING.get(D, {})
    num_stages = num_stages or tuning.get("num_stages", 2)
    maxnreg = tuning.get("maxnreg") if maxnreg is None else maxnreg  # 0: no cap
    if num_splits is None:  # few tiles (short questions, small batches): split the pages too
        slots = PREFILL_PROGRAMS_PER_SM.get(D, 2) * _num_sms(q.device)
        num_splits = _num_splits(H * B * n_tiles, pages.ids.shape[1], slots)
    split = num_splits > 1
    op = _scratch((total, H, num_splits, D), q.device) if split else o
    lse = _scratch((total, H, num_splits), q.device) if split else o
    args = [q, k_pages, v_pages, o, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count,
            cu_seqlens_q, q_pos, inv_freq,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), o.stride(0), o.stride(1), pages.ids.stride(0),
            num_splits, float(sm_scale) * _LOG2E]
    meta = dict(GROUP=H // Hkv, DTYPE=_TL_DTYPE[q.dtype], PS=PS, HALF=D // 2, BLOCK_M=block_m, ROTATE=bool(rotate),
                PREC=_prec(q.dtype), IDX64=_idx64(k_pages, v_pages),
                num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages,
                **({"maxnreg": maxnreg} if maxnreg else {}))
    grid = (H, B, n_tiles * num_splits)
    _prefill_kernel[grid](*args, SPLIT=split, **meta)
    _compile_split_twin(args, meta, split)
    if split:
        _merge_splits(op, lse, o, num_splits)
    return o


_TWINS_COMPILED: set = set()


def _compile_split_twin(args, meta, split: bool) -> None:
    """Compile the other variant (split or not) of a prefill launch alongside the first one.

    Whether a batch is split depends on its size, so a serving run meets the second variant
    only when a small batch (or a large one) first comes along, and would stall there for the
    second or so Triton takes to compile it."""
    key = (*meta.values(), args[0].device)  # meta: built in one order by lazy_prefill
    if INTERPRETED or key in _TWINS_COMPILED:
        return
    _TWINS_COMPILED.add(key)
    twin = list(args)
    if split:  # the unsplit kernel takes the output for its unused partials
        twin[4] = twin[5] = args[3]
    else:  # partial buffers as the split kernel takes them (fp32), of any size: nothing runs
        twin[4] = twin[5] = _scratch((1,), args[3].device)
    _prefill_kernel.warmup(*twin, grid=(1,), SPLIT=not split, **meta)


def lazy_decode(q, k_pages, v_pages, pages: PageTable, q_pos, inv_freq, sm_scale, rotate=True,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                tma: bool = False, block_h: int | None = None, out=None):
    B, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    G = H // Hkv
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    if num_splits is None:  # from the table's width (an upper bound on any request's pages; no host sync)
        slots = DECODE_PROGRAMS_PER_SM.get(D, 2) * _num_sms(q.device)
        num_splits = _num_splits(B * Hkv, pages.ids.shape[1], slots)
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
    _merge_splits(op, lse, o, num_splits)
    return o


def _merge_splits(op, lse, o, num_splits):
    """o[r, h] from the splits' partials op [R, H, S, D] and lse [R, H, S]."""
    R, H, D = o.shape
    # the split count is a runtime argument, not specialised (it follows the batch size; a
    # new value must not compile a new kernel mid-run); the merge rounds it up to a power of two
    _merge_splits_kernel[(R, H)](op, lse, o, o.stride(0), o.stride(1), H, num_splits, D=D,
                                 SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4)


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
