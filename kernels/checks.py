"""Argument checks of the public kernel API: each contract rule of docs/kernels.md refused early,
with the offending shape, dtype or stride in the message."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .pages import PageTable, ape_enabled

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_pool(k_pages: Tensor, v_pages: Tensor, D: int) -> None:
    if D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {D}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4 or t.shape[-1] != D:
            raise ValueError(f"{name} must be [num_pages, page_size, kv_heads, {D}], got {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} dtype must be fp16, bf16 or fp32, got {t.dtype}")
        ps, hkv = t.shape[1], t.shape[2]
        if ps < 16 or ps > 128 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two in 16..128, got {ps}")
        if t.stride()[1:] != (hkv * D, D, 1):
            raise ValueError(f"{name} must be contiguous in its last three dims, strides {t.stride()}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} differ")


def check_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, inv_freq: Tensor,
                    ape_temperature: float = 1.0, ape_scale: float = 1.0) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D, got {tuple(q.shape)}")
    D = q.shape[-1]
    check_pool(k_pages, v_pages, D)
    if q.dtype not in DTYPES or q.dtype != k_pages.dtype or q.dtype != v_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages must share one dtype in fp16/bf16/fp32: "
                         f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
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
                      inv_freq: Tensor, dst_k: Tensor, dst_v: Tensor) -> None:
    D = k_pages.shape[-1]
    check_pool(k_pages, v_pages, D)
    check_pool(dst_k, dst_v, D)
    if dst_k.shape[1:] != k_pages.shape[1:]:
        raise ValueError(f"destination page shape {tuple(dst_k.shape[1:])} != source {tuple(k_pages.shape[1:])}")
    for name, t in (("src", src), ("dst", dst), ("delta", delta)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != src.shape[0]:
            raise ValueError(f"{name} must be int32 [N]")
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be float32 [{D // 2}]")
