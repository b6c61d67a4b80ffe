"""Which implementation runs a call: the Triton kernels or the PyTorch reference.

CUDA tensors run the Triton kernels. CPU tensors run the reference, unless ``cpu_backend("triton")``
is in force: then they run the Triton kernels under Triton's interpreter, which needs
TRITON_INTERPRET=1 set before triton is first imported (kernels/mode.py).
"""
from __future__ import annotations

import contextlib
import importlib.util

from torch import Tensor

from . import reference

if importlib.util.find_spec("triton") is not None:
    from . import triton_ops
    from .mode import INTERPRETED
else:  # Triton ships for Linux only; elsewhere the reference serves CPU tensors
    triton_ops = None
    INTERPRETED = False

_cpu = {"backend": "reference"}


@contextlib.contextmanager
def cpu_backend(name: str):
    """Run the kernels on CPU tensors with 'reference' (the default) or 'triton' (the Triton interpreter)."""
    if name not in ("reference", "triton"):
        raise ValueError(f"cpu backend must be 'reference' or 'triton', got {name!r}")
    if name == "triton" and not INTERPRETED:
        raise RuntimeError("Triton runs CPU tensors only under its interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported" + ("" if triton_ops else " (triton is not installed)"))
    old, _cpu["backend"] = _cpu["backend"], name
    try:
        yield
    finally:
        _cpu["backend"] = old


def backend(t: Tensor) -> str:
    """Which implementation a call on tensor ``t`` uses: 'triton', 'triton-interpret' or 'reference'."""
    if t.is_cuda or _cpu["backend"] == "triton":
        return "triton-interpret" if INTERPRETED else "triton"
    return "reference"


def implementation(t: Tensor):
    """The module whose kernels (lazy_prefill, lazy_decode, shared_prefill, shared_decode,
    rotate_copy) serve a call on tensor ``t``."""
    if backend(t) == "reference":
        return reference
    if triton_ops is None:
        raise RuntimeError("the Triton kernels need triton, which is not installed")
    return triton_ops
