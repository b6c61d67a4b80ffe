"""Launch settings of the Triton kernels, by GPU compute capability and head dim.

Only the H200 (compute capability 9.0) has been measured: every other GPU, and the interpreter,
use its settings (``FALLBACK``). Keyword arguments of a call override them (docs/kernels.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

HOPPER = (9, 0)
FALLBACK = HOPPER


@dataclass(frozen=True)
class PrefillTuning:
    num_stages: int
    maxnreg: int  # register cap per thread; 0: none
    programs_per_sm: int  # resident at once with the default launch (64 rows, 4 warps)


@dataclass(frozen=True)
class DecodeTuning:
    num_warps: int
    programs_per_sm: int  # resident at once with the default launch (16 rows)


# Prefill takes 3 stages at both widths. At head dim 64 registers are capped at 168 so that 3
# programs fit per SM instead of 2; at 128 a cap spills. programs_per_sm is what ptxas's register
# allocation for sm_90a allows the default launches (scripts/kernel_regs.py; a test keeps it in step).
PREFILL = {HOPPER: {128: PrefillTuning(num_stages=3, maxnreg=0, programs_per_sm=2),
                    64: PrefillTuning(num_stages=3, maxnreg=168, programs_per_sm=3)}}
DECODE = {HOPPER: {128: DecodeTuning(num_warps=4, programs_per_sm=3),
                   64: DecodeTuning(num_warps=8, programs_per_sm=3)}}


@dataclass(frozen=True)
class Launch:
    """One kernel as a launch runs it: the jitted function, its constexprs and Triton's launch
    options (num_warps, num_stages, maxnreg)."""

    kernel: object
    constexprs: dict
    options: dict


def prefill(head_dim: int, capability: tuple[int, int] | None = None) -> PrefillTuning:
    return PREFILL.get(capability, PREFILL[FALLBACK])[head_dim]


def decode(head_dim: int, capability: tuple[int, int] | None = None) -> DecodeTuning:
    return DECODE.get(capability, DECODE[FALLBACK])[head_dim]


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device; None elsewhere (the interpreter on the CPU)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else 0)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter runs as on a small GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=1024)
def split_count(n_programs: int, max_splits: int, slots: int) -> int:
    """How many parts to split each program's pages into, given n_programs unsplit programs
    and `slots` programs resident at once on the GPU.

    Time ~ waves x (a split's share of the walk + a fixed cost), since a last wave that fills
    part of the GPU costs as much as a full one; the fixed cost (prologue, partial write,
    merge) is taken as 1/32 of the walk (4 pages of an 8K context). A grid that leaves
    slots idle is thus split until it fills them; never more splits than max_splits or 64."""
    return min(range(1, max(1, min(64, max_splits)) + 1),
               key=lambda s: (-(-n_programs * s // slots) * (1 / s + 1 / 32), s))
