"""Argument checks of the public kernel API: each contract rule of docs/kernels.md refused early,
with the offending shape, dtype or stride in the message."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import tuning
from .fp8 import FP8, fp8_supported
from .pages import PageTable, ape_enabled

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of queries, and of pages besides fp8


def check_pool(k_pages: Tensor, v_pages: Tensor, D: int, k_scale: Tensor | None = None,
               v_scale: Tensor | None = None) -> None:
    if D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {D}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4 or t.shape[-1] != D:
            raise ValueError(f"{name} must be [num_pages, page_size, kv_heads, {D}], got {tuple(t.shape)}")
        if t.dtype not in (*DTYPES, FP8):
            raise ValueError(f"{name} dtype must be fp16, bf16, fp32 or float8_e4m3fn, got {t.dtype}")
        ps, hkv = t.shape[1], t.shape[2]
        if ps < 16 or ps > 128 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two in 16..128, got {ps}")
        if t.stride()[1:] != (hkv * D, D, 1):
            raise ValueError(f"{name} must be contiguous in its last three dims, strides {t.stride()}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} differ")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share one dtype: {k_pages.dtype}, {v_pages.dtype}")
    check_scales(k_pages, k_scale, v_scale)


def check_scales(k_pages: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """fp8 pages come with their scales (float32 [num_pages, page_size, kv_heads]), other pages
    without; fp8 on CUDA needs compute capability 8.9 or later."""
    if k_pages.dtype != FP8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale go with float8_e4m3fn pages, not {k_pages.dtype}")
        return
    shape = tuple(k_pages.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != shape or s.stride()[1:] != (shape[2], 1):
            got = "none" if s is None else f"{s.dtype} {tuple(s.shape)} strides {s.stride()}"
            raise ValueError(f"float8_e4m3fn pages need {name}: float32 {list(shape)}, contiguous in its last two "
                             f"dims; got {got}")
        if s.device != k_pages.device:
            raise ValueError(f"{name} is on {s.device}, the pages on {k_pages.device}")
    capability = tuning.capability(k_pages.device)
    if not fp8_supported(capability):
        raise ValueError(f"float8_e4m3fn pages need a GPU of compute capability 8.9 or later; "
                         f"{k_pages.device} has {capability[0]}.{capability[1]}")


def check_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, inv_freq: Tensor,
                    ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D, got {tuple(q.shape)}")
    D = q.shape[-1]
    check_pool(k_pages, v_pages, D, k_scale, v_scale)
    if q.dtype not in DTYPES or (k_pages.dtype not in (FP8, q.dtype) and q.dtype != torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, and share the pages' dtype unless q is fp32 or the "
                         f"pages float8_e4m3fn: {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    H, Hkv = q.shape[1], k_pages.shape[2]
    if H % Hkv:
        raise ValueError(f"num_heads {H} must be a multiple of kv_heads {Hkv}")
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be float32 [{D // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    pages.validate()
    check_ape(ape_temperature, ape_scale)
    if ape_enabled(ape_temperature, ape_scale) and not pages.has_ape:
        raise ValueError("ape_temperature and ape_scale apply to the entries PageTable.ape_lo..ape_hi, "
                         "and this page table has none")


def check_ape(temperature: float, scale: float) -> None:
    """APE's temperature T and scale S: positive and finite (the logits take / T and + ln S)."""
    for name, x in (("ape_temperature", temperature), ("ape_scale", scale)):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be a positive finite number, got {x}")


def check_rotate_copy(k_pages: Tensor, v_pages: Tensor, src: Tensor, dst: Tensor, delta: Tensor,
                      inv_freq: Tensor, dst_k: Tensor, dst_v: Tensor, k_scale: Tensor | None = None,
                      v_scale: Tensor | None = None, dst_k_scale: Tensor | None = None,
                      dst_v_scale: Tensor | None = None) -> None:
    D = k_pages.shape[-1]
    check_pool(k_pages, v_pages, D, k_scale, v_scale)
    check_pool(dst_k, dst_v, D, dst_k_scale, dst_v_scale)
    if dst_k.shape[1:] != k_pages.shape[1:]:
        raise ValueError(f"destination page shape {tuple(dst_k.shape[1:])} != source {tuple(k_pages.shape[1:])}")
    if dst_k.dtype != k_pages.dtype:
        raise ValueError(f"destination pages are {dst_k.dtype}, the source {k_pages.dtype}: they must match")
    for name, t in (("src", src), ("dst", dst), ("delta", delta)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != src.shape[0]:
            raise ValueError(f"{name} must be int32 [N]")
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be float32 [{D // 2}]")
