"""Triton prefill: varlen-packed queries of many requests over their pages, with deferred RoPE."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .mode import INTERPRETED
from .fp8 import FP8
from .page_loop import TL_DTYPE, attn_pages, logit_scales, needs_idx64, precision, scale_args
from .pages import PageTable, ape_enabled
from .splits import merge_splits, scratch, split_count, split_range, store_partial


# Integer arguments that change from call to call (the page table's width, the split count)
# are marked do_not_specialize: Triton would otherwise compile another variant whenever one
# became a multiple of 16, in the middle of a serving run.
@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _prefill_kernel(Q, K, V, KS, VS, O, OP, LSE, IDS, DELTA, START, LEN, COUNT, APE_LO, APE_HI, CU, QPOS, INVF,
                    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh,
                    stride_vp, stride_vt, stride_vh, stride_ksp, stride_vsp, stride_st,
                    stride_ot, stride_oh, stride_tb, num_splits, qk_scale, ape_qk_scale, ape_bias,
                    GROUP: tl.constexpr, DTYPE: tl.constexpr, PS: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, ROTATE: tl.constexpr,
                    PREC: tl.constexpr, IDX64: tl.constexpr, SPLIT: tl.constexpr, APE: tl.constexpr,
                    FP8: tl.constexpr):
    # one program: one query head (packing the GQA group into the tile's rows was no faster)
    # of one tile of one request, over one split of the request's pages (SPLIT: partial
    # results to OP/LSE, merged by the merge kernel; otherwise straight to O)
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
        if SPLIT:  # (unsplit, the walk keeps its fixed start: runtime bounds cost registers)
            lo, hi = split_range(n_pages, num_splits, sp)
        ape_lo = 0
        ape_hi = 0
        if APE:
            ape_lo = tl.load(APE_LO + b)
            ape_hi = tl.load(APE_HI + b)
        acc, m_i, l_i = attn_pages(qrows, mmask, qpos, qmin, invf, acc, m_i, l_i,
                                   K, V, KS, VS, IDS + tb, DELTA + tb, START + tb, LEN + tb, kvh, lo, hi,
                                   stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                                   stride_ksp, stride_vsp, stride_st, qk_scale, ape_lo, ape_hi, ape_qk_scale,
                                   ape_bias, DTYPE, PS, HALF, BLOCK_M, ROTATE, PREC, IDX64, False, APE, FP8)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
        if SPLIT:
            store_partial(OP, LSE, o, m_i, l_i, tok.to(tl.int64) * tl.num_programs(0) + head, num_splits, sp,
                          mmask, offs_d)
        else:
            orow = tok.to(tl.int64) * stride_ot + head * stride_oh
            tl.store(O + orow[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=mmask[:, None])


def launch_config(dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int, page_size: int, *,
                  rotate: bool = True, idx64: bool = False, ape: bool = False, fp8: bool = False,
                  capability: tuple[int, int] | None = None, block_m: int = 64, num_warps: int | None = None,
                  num_stages: int | None = None, maxnreg: int | None = None) -> tuning.Launch:
    """The prefill kernel as a launch of these shapes runs it (SPLIT aside: each launch sets it
    from its split count; dtype: the query's; fp8: e4m3 pages). Options left None take the
    tuning table's values for the GPU.

    64-row tiles even for shorter queries: a tile size that followed the query length would
    compile a new kernel in the middle of a serving run."""
    tuned = tuning.prefill(head_dim, capability)
    maxnreg = tuned.maxnreg if maxnreg is None else maxnreg  # 0: no cap
    constexprs = dict(GROUP=num_heads // kv_heads, DTYPE=TL_DTYPE[dtype], PS=page_size, HALF=head_dim // 2,
                      BLOCK_M=block_m, ROTATE=bool(rotate), PREC=precision(dtype), IDX64=idx64, APE=ape, FP8=fp8)
    options = dict(num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages or tuned.num_stages,
                   **({"maxnreg": maxnreg} if maxnreg else {}))
    return tuning.Launch(_prefill_kernel, constexprs, options)


def lazy_prefill(q, k_pages, v_pages, pages: PageTable, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True,
                 ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale=None, v_scale=None,
                 max_seqlen_q: int | None = None,
                 block_m: int = 64, num_warps: int | None = None, num_stages: int | None = None,
                 num_splits: int | None = None, maxnreg: int | None = None, out=None, merge=None):
    # merge(op, lse, o, num_splits): given, the kernel always writes split partials and merge
    # takes them to o (chunk-major attention, shared_attention.py, merges its own in)
    total, H, D = q.shape
    _, PS, Hkv, _ = k_pages.shape
    B = pages.ids.shape[0]
    o = torch.empty_like(q) if out is None else out
    if total == 0 or B == 0:
        return o
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    n_tiles = max(1, triton.cdiv(max_seqlen_q, block_m))
    cap = tuning.capability(q.device)
    ape = ape_enabled(ape_temperature, ape_scale)
    launch = launch_config(q.dtype, H, Hkv, D, PS, rotate=rotate, idx64=needs_idx64(k_pages, v_pages), ape=ape,
                           fp8=k_pages.dtype == FP8, capability=cap, block_m=block_m, num_warps=num_warps,
                           num_stages=num_stages, maxnreg=maxnreg)
    if num_splits is None:  # few tiles (short questions, small batches): split the pages too
        slots = tuning.prefill(D, cap).programs_per_sm * tuning.num_sms(q.device)
        num_splits = split_count(H * B * n_tiles, pages.ids.shape[1], slots)
    split = num_splits > 1 or merge is not None
    op = scratch((total, H, num_splits, D), q.device) if split else o
    lse = scratch((total, H, num_splits), q.device) if split else o
    ks, vs, stride_ksp, stride_vsp, stride_st = scale_args(k_pages, k_scale, v_scale)
    args = [q, k_pages, v_pages, ks, vs, o, op, lse, pages.ids, pages.delta, pages.start, pages.length, pages.count,
            pages.ape_lo if ape else None, pages.ape_hi if ape else None, cu_seqlens_q, q_pos, inv_freq,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), stride_ksp, stride_vsp, stride_st,
            o.stride(0), o.stride(1), pages.ids.stride(0), num_splits,
            *logit_scales(sm_scale, ape_temperature, ape_scale)]
    grid = (H, B, n_tiles * num_splits)
    _prefill_kernel[grid](*args, SPLIT=split, **launch.constexprs, **launch.options)
    _compile_split_twin(args, launch, split)
    if split:
        (merge or merge_splits)(op, lse, o, num_splits)
    return o


_TWINS_COMPILED: set = set()


def _compile_split_twin(args, launch: tuning.Launch, split: bool) -> None:
    """Compile the other variant (split or not) of a prefill launch alongside the first one.

    Whether a batch is split depends on its size, so a serving run meets the second variant
    only when a small batch (or a large one) first comes along, and would stall there for the
    second or so Triton takes to compile it."""
    key = (*launch.constexprs.values(), *launch.options.values(), args[0].device)
    if INTERPRETED or key in _TWINS_COMPILED:
        return
    _TWINS_COMPILED.add(key)
    twin = list(args)
    o, op, lse = 5, 6, 7  # where the output and the partials sit in the kernel's arguments
    if split:  # the unsplit kernel takes the output for its unused partials
        twin[op] = twin[lse] = args[o]
    else:  # partial buffers as the split kernel takes them (fp32), of any size: nothing runs
        twin[op] = twin[lse] = scratch((1,), args[o].device)
    _prefill_kernel.warmup(*twin, grid=(1,), SPLIT=not split, **launch.constexprs, **launch.options)
