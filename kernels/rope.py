"""RoPE in PyTorch: the one rotation the models, the reference kernels and the benchmarks share.

Hugging Face "rotate_half" (non-interleaved) in fp32, the same maths the Triton kernels apply
to queries, so keys rotated here and queries rotated inside a kernel agree.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate fp32 ``x`` [L, H, D] by int positions ``pos`` [L] (HF rotate_half convention)."""
    half = x.shape[-1] // 2
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = ang.cos()[:, None, :]
    sin = ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
