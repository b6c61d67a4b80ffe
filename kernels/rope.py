"""RoPE in PyTorch: the one rotation the models, the reference kernels and the benchmarks share.

Hugging Face "rotate_half" (non-interleaved) in fp32, the same maths the Triton kernels apply
to queries, so keys rotated here and queries rotated inside a kernel agree. The model rotates
every layer's new keys at the same positions, so it makes the table once a step (`rope_table`)
and applies it per layer (`apply_rope`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RopeTable(NamedTuple):
    """cos and signed sin of positions, [L, 1, D] fp32: x rotated is x * cos + rotate_half(x) * sin,
    where sin holds -sin over the first half. That is x1 cos - x2 sin, x2 cos + x1 sin to the bit."""
    cos: Tensor
    sin: Tensor


def rope_table(pos: Tensor, inv_freq: Tensor) -> RopeTable:
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos, sin = ang.cos(), ang.sin()
    return RopeTable(torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :])


def apply_rope(x: Tensor, table: RopeTable) -> Tensor:
    """Rotate fp32 ``x`` [L, H, D] by a table of its L positions."""
    half = x.shape[-1] // 2
    return x * table.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * table.sin


def rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate fp32 ``x`` [L, H, D] by int positions ``pos`` [L] (HF rotate_half convention)."""
    return apply_rope(x, rope_table(pos, inv_freq))
