"""The key loop both per-request attention kernels (decode.py, prefill.py) share: a request's pages
walked one page per key block, with online softmax and the rotated query rebuilt where a page's
delta changes. fp8 pages are converted to the query's dtype in registers, their scales applied
to the scores (keys) and to the probabilities (values), by key_dot and value_dot, which the
chunk-major kernel (shared_attention.py) uses too.

Also the host-side values that pick its variant (dtype, dot precision, offset width) and its
logit scales.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .rotation import cos_sin, join, rotate

LOG2E = 1.4426950408889634  # the loop works in exp2: scores are scaled by sm_scale * log2(e)
TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def logit_scales(sm_scale: float, ape_temperature: float, ape_scale: float) -> tuple[float, float, float]:
    """(qk_scale, ape_qk_scale, ape_bias) in the loop's exp2 units: a plain entry's logit is
    (q . k) * qk_scale, an APE entry's (q . k) * ape_qk_scale + ape_bias, which is
    log2(e) x ((q . k) * sm_scale / T + ln S)."""
    qk_scale = float(sm_scale) * LOG2E
    return qk_scale, qk_scale / ape_temperature, math.log2(ape_scale)


def precision(dtype: torch.dtype) -> str:
    """The dots' input precision: exact for fp32 inputs, tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_args(k_pages: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """(KS, VS, stride_ksp, stride_vsp, stride_st) of a launch: an fp8 pool's scales and their strides,
    or placeholders the compiled-out branch never reads."""
    if k_scale is None:
        return None, None, 0, 0, 0
    return k_scale, v_scale, k_scale.stride(0), v_scale.stride(0), k_scale.stride(1)


def needs_idx64(k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    # int32 page offsets suffice while every element of the pools is addressable in int32
    return max(k_pages.shape[0] * k_pages.stride(0), v_pages.shape[0] * v_pages.stride(0)) >= 2**31


@triton.jit
def query_at(qrows, qmask, qpos, d, invf, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """R(m - d) q for query rows at positions m against a page of delta d, cast to DTYPE."""
    offs_h = tl.arange(0, HALF)
    q1 = tl.load(qrows[:, None] + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qrows[:, None] + HALF + offs_h[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
    c, s = cos_sin((qpos - d).to(tl.float32)[:, None] * invf[None, :])  # int32 difference, then fp32
    r1, r2 = rotate(q1, q2, c, s)
    return join(r1, r2, DTYPE)


@triton.jit
def key_dot(q, k, KS, pid, kvh, stride_ksp, stride_st, DTYPE: tl.constexpr, PS: tl.constexpr,
            PREC: tl.constexpr, FP8: tl.constexpr):
    """q . k against one page's keys k [PS, D] of KV head kvh. FP8: e4m3 keys converted to DTYPE
    in registers, and (q . k8) * k_scale per key is q . k (scales KS [pages, PS, kv_heads])."""
    qk = tl.dot(q, tl.trans(k.to(DTYPE)), input_precision=PREC)
    if FP8:
        qk = qk * tl.load(KS + pid * stride_ksp + tl.arange(0, PS) * stride_st + kvh)[None, :]
    return qk


@triton.jit
def value_dot(acc, pr, v, VS, pid, kvh, stride_vsp, stride_st, DTYPE: tl.constexpr, PS: tl.constexpr,
              PREC: tl.constexpr, FP8: tl.constexpr):
    """acc + pr . v for one page's values v [PS, D] of KV head kvh. FP8: pr * v_scale per key
    before the dot is pr . v, so no dequantised page is ever built."""
    if FP8:
        pr = pr * tl.load(VS + pid * stride_vsp + tl.arange(0, PS) * stride_st + kvh)[None, :]
    return tl.dot(pr.to(DTYPE), v.to(DTYPE), acc, input_precision=PREC)


@triton.jit
def page_step(q, p, d, qpos, qmin, acc, m_i, l_i, K, V, KS, VS, ids_row, start_row, len_row, kvh,
              stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ksp, stride_vsp,
              stride_st, qk_scale, ape_lo, ape_hi, ape_qk_scale, ape_bias,
              DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
              PREC: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr, APE: tl.constexpr, FP8: tl.constexpr):
    """Online softmax over page entry p (of delta d): one key block of PS keys. APE: entries
    ape_lo <= p < ape_hi take ape_qk_scale and ape_bias (logit_scales). FP8: the page's rows
    carry scales KS, VS [pages, PS, kv_heads] (token stride stride_st), applied by key_dot and
    value_dot."""
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
    qk = key_dot(q, k, KS, pid, kvh, stride_ksp, stride_st, DTYPE, PS, PREC, FP8)
    if APE:
        in_ape = (p >= ape_lo) & (p < ape_hi)
        s = qk * tl.where(in_ape, ape_qk_scale, qk_scale)
        s = s + tl.where(in_ape, ape_bias, 0.0)
    else:
        s = qk * qk_scale
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
    acc = value_dot(acc * alpha[:, None], pr, v, VS, pid, kvh, stride_vsp, stride_st, DTYPE, PS, PREC, FP8)
    return acc, m_new, l_i


@triton.jit
def attn_pages(qrows, qmask, qpos, qmin, invf, acc, m_i, l_i,
               K, V, KS, VS, ids_row, delta_row, start_row, len_row, kvh, p_lo, p_hi,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ksp, stride_vsp, stride_st,
               qk_scale, ape_lo, ape_hi, ape_qk_scale, ape_bias,
               DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
               ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr,
               APE: tl.constexpr, FP8: tl.constexpr):
    """Online softmax over page entries [p_lo, p_hi) of one request, one page per key block.

    qrows: row pointers to the query (qmin: the earliest position among the rows, which
    decides where the causal mask can start). A row at position m needs R(m - d) q against a
    page of delta d. The rotated query is carried through one flat loop and rebuilt only
    where the delta changes (a chunk's pages share one), so most pages cost what they cost
    without rotation: one full-width dot. A rebuild re-reads the rows (L2) and rotates them
    from scratch, in fp32, by each row's own angle: with cheap cos/sin that beats keeping a
    per-row rotation in scratch, and one flat loop beats a loop per delta.
    APE (compiled out unless set): entries ape_lo <= p < ape_hi of the request take APE's
    temperature and scale (page_step). FP8 (compiled out unless set): e4m3 pages with their
    scales KS, VS (page_step).
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
                q = query_at(qrows, qmask, qpos, d, invf, HALF, DTYPE)
                d_cur = d
        acc, m_i, l_i = page_step(q, p, d, qpos, qmin, acc, m_i, l_i, K, V, KS, VS, ids_row, start_row, len_row, kvh,
                                  stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ksp,
                                  stride_vsp, stride_st, qk_scale, ape_lo, ape_hi, ape_qk_scale, ape_bias, DTYPE, PS,
                                  HALF, PREC, IDX64, TMA, APE, FP8)
    return acc, m_i, l_i
