"""fp8 KV pages: float8 e4m3 values with one fp32 scale per (token, KV head) row.

A row x of head_dim values is kept as ``x8 = x / s`` in e4m3 with ``s = amax(|x|) / 448`` (448
is e4m3's largest finite value), so every row uses the format's full range; a row of zeros
keeps scale 0. The kernels read the values and apply the scales in registers (docs/kernels.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_CAPABILITY = (8, 9)  # Ada and Hopper convert e4m3 in hardware


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows over the last dim of ``x`` -> (e4m3 values of x's shape, fp32 scales of x's shape less its last dim)."""
    x = x.to(torch.float32)
    scale = x.abs().amax(-1) / FP8_MAX
    values = x / torch.where(scale > 0, scale, 1.0)[..., None]
    return values.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(values: Tensor, scale: Tensor) -> Tensor:
    """The fp32 rows that e4m3 ``values`` with their per-row ``scale`` stand for."""
    return values.to(torch.float32) * scale[..., None]


def fp8_supported(capability: tuple[int, int] | None) -> bool:
    """Whether a device of this CUDA compute capability (None: the CPU) reads fp8 pages."""
    return capability is None or tuple(capability) >= MIN_CAPABILITY
