"""Triton decode: one query token per request over its pages (flash-decoding), deferred RoPE."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .fp8 import FP8
from .page_loop import TL_DTYPE, attn_pages, logit_scales, needs_idx64, precision, scale_args
from .pages import PageTable, ape_enabled
from .splits import merge_splits, scratch, split_count, split_range, store_partial


# stride_tb and num_splits change from call to call: not specialised (see prefill.py)
@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _decode_split_kernel(Q, K, V, KS, VS, OP, LSE, IDS, DELTA, START, LEN, COUNT, APE_LO, APE_HI, QPOS, INVF,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                         stride_vp, stride_vt, stride_vh, stride_ksp, stride_vsp, stride_st,
                         stride_tb, num_heads, num_splits, qk_scale, ape_qk_scale, ape_bias,
                         GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
                         TMA: tl.constexpr, APE: tl.constexpr, FP8: tl.constexpr):
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
    lo, hi = split_range(tl.load(COUNT + b), num_splits, sp)
    acc = tl.zeros([BLOCK_H, 2 * HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    tb = b.to(tl.int64) * stride_tb
    ape_lo = 0
    ape_hi = 0
    if APE:
        ape_lo = tl.load(APE_LO + b)
        ape_hi = tl.load(APE_HI + b)
    if lo < hi:
        acc, m_i, l_i = attn_pages(qrows, gmask, qpos, qmin, invf, acc, m_i, l_i,
                                   K, V, KS, VS, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, lo, hi,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                   stride_ksp, stride_vsp, stride_st, qk_scale, ape_lo, ape_hi, ape_qk_scale,
                                   ape_bias, DTYPE, PS, HALF, BLOCK_H, ROTATE, PREC, IDX64, TMA, APE, FP8)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_partial(OP, LSE, o, m_i, l_i, b.to(tl.int64) * num_heads + heads, num_splits, sp, gmask, offs_d)


def launch_config(dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int, page_size: int, *,
                  rotate: bool = True, idx64: bool = False, tma: bool = False, ape: bool = False,
                  fp8: bool = False, capability: tuple[int, int] | None = None, block_h: int | None = None,
                  num_warps: int | None = None, num_stages: int = 2) -> tuning.Launch:
    """The decode kernel as a launch of these shapes runs it (dtype: the query's; fp8: e4m3
    pages). Options left None take the tuning table's values for the GPU.

    16 query rows per program (the smallest dot tile) unless the GQA group is larger; a
    Hopper warpgroup's 64 rows is slower."""
    group = num_heads // kv_heads
    constexprs = dict(GROUP=group, DTYPE=TL_DTYPE[dtype], PS=page_size, HALF=head_dim // 2,
                      BLOCK_H=block_h or max(16, triton.next_power_of_2(group)), ROTATE=bool(rotate),
                      PREC=precision(dtype), IDX64=idx64, TMA=tma, APE=ape, FP8=fp8)
    options = dict(num_warps=num_warps or tuning.decode(head_dim, capability).num_warps, num_stages=num_stages)
    return tuning.Launch(_decode_split_kernel, constexprs, options)


def _use_tma(tma: bool, k_pages, v_pages, device) -> bool:
    """Hopper TMA loads of whole pages: an option, off by default (no faster than pointer
    loads on the H200, and less steady)."""
    if not tma:
        return False
    _, PS, Hkv, D = k_pages.shape
    if any(t.stride(0) != PS * Hkv * D for t in (k_pages, v_pages)):
        raise ValueError("tma needs contiguous pools")
    if device.type == "cuda" and tuning.capability(device)[0] < 9:
        raise ValueError("tma needs a Hopper GPU (compute capability 9.0 or later)")
    return True


def _page_descriptors(k_pages, v_pages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, PS, Hkv, D = k_pages.shape
    return tuple(TensorDescriptor.from_tensor(t.view(-1, Hkv * D), [PS, D]) for t in (k_pages, v_pages))


def lazy_decode(q, k_pages, v_pages, pages: PageTable, q_pos, inv_freq, sm_scale, rotate=True,
                ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale=None, v_scale=None,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2, tma: bool = False,
                block_h: int | None = None, out=None, merge=None):
    # merge(op, lse, o, num_splits): how the split partials reach o; chunk-major attention
    # (shared_attention.py) merges its own partials in with them
    B, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    cap = tuning.capability(q.device)
    if num_splits is None:  # from the table's width (an upper bound on any request's pages; no host sync)
        slots = tuning.decode(D, cap).programs_per_sm * tuning.num_sms(q.device)
        num_splits = split_count(B * Hkv, pages.ids.shape[1], slots)
    op = scratch((B, H, num_splits, D), q.device)
    lse = scratch((B, H, num_splits), q.device)
    kk, vv = k_pages, v_pages
    tma = _use_tma(tma, k_pages, v_pages, q.device)
    if tma:
        kk, vv = _page_descriptors(k_pages, v_pages)
    ape = ape_enabled(ape_temperature, ape_scale)
    launch = launch_config(q.dtype, H, Hkv, D, PS, rotate=rotate, idx64=needs_idx64(k_pages, v_pages), tma=tma,
                           ape=ape, fp8=k_pages.dtype == FP8, capability=cap, block_h=block_h, num_warps=num_warps,
                           num_stages=num_stages)
    ks, vs, stride_ksp, stride_vsp, stride_st = scale_args(k_pages, k_scale, v_scale)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, kk, vv, ks, vs, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count,
        pages.ape_lo if ape else None, pages.ape_hi if ape else None, q_pos, inv_freq,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), stride_ksp, stride_vsp, stride_st,
        pages.ids.stride(0), H, num_splits, *logit_scales(sm_scale, ape_temperature, ape_scale),
        **launch.constexprs, **launch.options)
    (merge or merge_splits)(op, lse, o, num_splits)
    return o
