"""Lazy-attention kernels: attention over shared, position-free KV pages with deferred RoPE.

``lazy_prefill`` and ``lazy_decode`` read each request's pages through a :class:`PageTable` and
rotate the query by each page's delta inside the kernel, so one stored copy of a chunk serves
every request at every offset (optionally with APE's temperature and scale on a range of each
request's entries); ``shared_prefill`` and ``shared_decode`` do the same chunk-major, reading
each chunk page once per step for every request using it (``group_shared``, ``plan_shared``);
``rotate_copy`` re-rotates pages for the block baseline; ``rows_to_pages`` writes a chunk's
token-major rows into pool pages; ``bit_rows`` applies a GF(2) matrix to 64-byte rows (the
device's crc32c of a chunk). Pages are fp16, bf16,
fp32, or float8 e4m3 with a scale per (token, KV head) (``quantize_fp8``). CUDA
tensors run the Triton kernels, CPU tensors the PyTorch ``reference`` (or, inside
``cpu_backend("triton")``, the Triton interpreter). docs/kernels.md is the contract: positions,
page pool and table, the causal rule, every keyword, the tuning tables and the dispatch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .checks import check_ape, check_attention, check_rotate_copy
from .dispatch import backend, cpu_backend, implementation
from .fp8 import FP8, dequantize_fp8, fp8_supported, quantize_fp8
from .pages import PageTable, ape_enabled
from .rope import rope
from .shared_pages import SharedPages, group_shared
from .shared_plan import PlanLayout, SharedPlan, check_plan, empty_plan, plan_shared

__all__ = ["PageTable", "lazy_prefill", "lazy_decode", "rotate_copy", "reference", "rope", "backend",
           "cpu_backend", "ape_enabled", "check_ape", "FP8", "quantize_fp8", "dequantize_fp8", "fp8_supported",
           "SharedPages", "group_shared", "SharedPlan", "PlanLayout", "plan_shared", "empty_plan", "shared_prefill",
           "shared_decode", "bit_rows", "rows_to_pages"]


def _check_prefill_layout(q: Tensor, pages: PageTable, cu_seqlens_q: Tensor, q_pos: Tensor) -> None:
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (pages.batch + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [B+1] = [{pages.batch + 1}]")
    if q_pos.dtype != torch.int32 or q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be int32 [total_q] = [{q.shape[0]}]")


def _check_decode_layout(q: Tensor, pages: PageTable, q_pos: Tensor) -> None:
    if q.shape[0] != pages.batch:
        raise ValueError(f"q has {q.shape[0]} requests, the page table {pages.batch}")
    if q_pos.dtype != torch.int32 or q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be int32 [B] = [{q.shape[0]}]")


def lazy_prefill(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, cu_seqlens_q: Tensor,
                 q_pos: Tensor, inv_freq: Tensor, sm_scale: float, rotate: bool = True,
                 ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale: Tensor | None = None,
                 v_scale: Tensor | None = None, **tuning) -> Tensor:
    """Varlen prefill over paged KV with deferred RoPE (docs/kernels.md)."""
    check_attention(q, k_pages, v_pages, pages, inv_freq, ape_temperature, ape_scale, k_scale, v_scale)
    _check_prefill_layout(q, pages, cu_seqlens_q, q_pos)
    return implementation(q).lazy_prefill(q, k_pages, v_pages, pages, cu_seqlens_q, q_pos, inv_freq, sm_scale,
                                          rotate, ape_temperature, ape_scale, k_scale=k_scale, v_scale=v_scale,
                                          **tuning)


def lazy_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, q_pos: Tensor,
                inv_freq: Tensor, sm_scale: float, rotate: bool = True, ape_temperature: float = 1.0,
                ape_scale: float = 1.0, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                **tuning) -> Tensor:
    """One query token per request over paged KV, flash-decoding (docs/kernels.md)."""
    check_attention(q, k_pages, v_pages, pages, inv_freq, ape_temperature, ape_scale, k_scale, v_scale)
    _check_decode_layout(q, pages, q_pos)
    return implementation(q).lazy_decode(q, k_pages, v_pages, pages, q_pos, inv_freq, sm_scale, rotate,
                                         ape_temperature, ape_scale, k_scale=k_scale, v_scale=v_scale, **tuning)


def shared_prefill(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, shared: SharedPlan,
                   cu_seqlens_q: Tensor, q_pos: Tensor, inv_freq: Tensor, sm_scale: float,
                   ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None, **tuning) -> Tensor:
    """lazy_prefill chunk-major: `pages` is each request's remainder, `shared` the plan of the
    runs they share (docs/kernels.md, "Chunk-major attention")."""
    check_attention(q, k_pages, v_pages, pages, inv_freq, ape_temperature, ape_scale, k_scale, v_scale)
    check_plan(shared, q, k_pages, decode=False)
    _check_prefill_layout(q, pages, cu_seqlens_q, q_pos)
    return implementation(q).shared_prefill(q, k_pages, v_pages, pages, shared, cu_seqlens_q, q_pos, inv_freq,
                                            sm_scale, ape_temperature, ape_scale, k_scale=k_scale, v_scale=v_scale,
                                            **tuning)


def shared_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, shared: SharedPlan, q_pos: Tensor,
                  inv_freq: Tensor, sm_scale: float, ape_temperature: float = 1.0, ape_scale: float = 1.0,
                  k_scale: Tensor | None = None, v_scale: Tensor | None = None, **tuning) -> Tensor:
    """lazy_decode chunk-major: `pages` is each request's remainder, `shared` the plan of the
    runs they share (docs/kernels.md, "Chunk-major attention")."""
    check_attention(q, k_pages, v_pages, pages, inv_freq, ape_temperature, ape_scale, k_scale, v_scale)
    check_plan(shared, q, k_pages, decode=True)
    _check_decode_layout(q, pages, q_pos)
    return implementation(q).shared_decode(q, k_pages, v_pages, pages, shared, q_pos, inv_freq, sm_scale,
                                           ape_temperature, ape_scale, k_scale=k_scale, v_scale=v_scale, **tuning)


def rotate_copy(k_pages: Tensor, v_pages: Tensor, src: Tensor, dst: Tensor, delta: Tensor, inv_freq: Tensor,
                dst_k: Tensor | None = None, dst_v: Tensor | None = None, k_scale: Tensor | None = None,
                v_scale: Tensor | None = None, dst_k_scale: Tensor | None = None, dst_v_scale: Tensor | None = None):
    """Copy pages ``src[i] -> dst[i]`` with keys re-rotated by ``delta[i]`` (docs/kernels.md); fp8 keys are
    requantised row by row, values and their scales copied."""
    dk = k_pages if dst_k is None else dst_k
    dv = v_pages if dst_v is None else dst_v
    dks = k_scale if dst_k is None else dst_k_scale
    dvs = v_scale if dst_v is None else dst_v_scale
    check_rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dk, dv, k_scale, v_scale, dks, dvs)
    return implementation(k_pages).rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=dk, dst_v=dv,
                                               k_scale=k_scale, v_scale=v_scale, dst_k_scale=dks, dst_v_scale=dvs)


def bit_rows(data: Tensor, pad: int, matrix: Tensor, xor: int = 0, out: Tensor | None = None) -> Tensor:
    """``data`` (a contiguous uint8 vector) after ``pad`` zero bytes (0 <= pad < 64), and zeros
    after it to a whole row, as rows of 64 bytes; each row's 512 bits (bit b of byte j is bit
    8 * j + b) times ``matrix`` ([512, 32], 0/1 in fp16, on the same device) over GF(2). An int32
    per row: its bit c the parity of the row's bits that column c selects, XORed with ``xor``
    (32 bits). Written into ``out`` (a contiguous int32 vector of one element per row) when given,
    so that a caller on a stream of its own allocates nothing."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous uint8 vector, got {data.dtype} of shape {tuple(data.shape)}")
    if tuple(matrix.shape) != (512, 32) or matrix.dtype != torch.float16 or not matrix.is_contiguous():
        raise ValueError(f"matrix must be a contiguous [512, 32] fp16 tensor, got {matrix.dtype} {tuple(matrix.shape)}")
    if matrix.device != data.device:
        raise ValueError(f"matrix is on {matrix.device}, data on {data.device}")
    if not 0 <= pad < 64:
        raise ValueError(f"pad must be 0..63 bytes, got {pad}")
    rows = -(-(pad + data.numel()) // 64)
    if out is None:
        out = torch.empty(rows, dtype=torch.int32, device=data.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (rows,) or not out.is_contiguous() or out.device != data.device:
        raise ValueError(f"out must be a contiguous int32 vector of {rows} elements on {data.device}, got {out.dtype} "
                         f"of shape {tuple(out.shape)} on {out.device}")
    implementation(data).bit_rows(data, pad, matrix, xor, out)
    return out


def rows_to_pages(rows: Tensor, pool: Tensor, pages: Tensor) -> None:
    """Write a chunk's rows into pool pages: ``pool[kv, layer, pages[i], j] = rows[i * page_size + j,
    layer, kv]``. rows: [len(pages) * page_size, layers, 2, *unit], the store's token-major layout;
    pool: [2, layers, num_pages, page_size, *unit]; both contiguous, of one dtype and device;
    pages: a vector of distinct page ids (integers) on that device."""
    kinds, layers, num_pages, page_size = pool.shape[:4]
    want = (pages.numel() * page_size, layers, kinds, *pool.shape[4:])
    if tuple(rows.shape) != want or rows.dtype != pool.dtype:
        raise ValueError(f"rows must be {pool.dtype} of shape {want} for this pool, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if not (rows.is_contiguous() and pool.is_contiguous()):
        raise ValueError("rows and pool must be contiguous")
    if pages.dim() != 1 or pages.dtype.is_floating_point or pages.is_complex():
        raise ValueError(f"pages must be a vector of integer page ids, got {pages.dtype} {tuple(pages.shape)}")
    if not rows.device == pool.device == pages.device:
        raise ValueError(f"rows ({rows.device}), pool ({pool.device}) and pages ({pages.device}) must share a device")
    return implementation(pool).rows_to_pages(rows, pool, pages)
