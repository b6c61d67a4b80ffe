"""Compiled or interpreted Triton: decided once, when the kernels are first imported.

Triton's own rule: ``@triton.jit`` builds an interpreted function while TRITON_INTERPRET=1 is
set, and Triton's standard library was built the same way when triton was first imported. The
kernels follow the variable as they are imported and refuse a standard library built otherwise.
"""
from __future__ import annotations

import triton.language.standard as tls
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)

if INTERPRETED != (type(tls.cdiv).__name__ == "InterpretedFunction"):
    raise RuntimeError("TRITON_INTERPRET changed after triton was first imported: set it (or unset it) "
                       "before anything imports triton")


def _fix_interpreter_index() -> None:
    """Let the Triton interpreter use scalar tensors as ``range`` bounds under NumPy 2.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy >= 2.x refuses for 1-D arrays (a loop ``for i in range(lo, hi)`` over loaded
    bounds then fails). Interpreter-only; compiled kernels are unaffected.
    """
    from triton.runtime import interpreter as _interp

    orig = _interp._patch_lang_tensor
    if getattr(orig, "_lazyrag_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lazyrag_fixed = True
    _interp._patch_lang_tensor = patched


if INTERPRETED:
    _fix_interpreter_index()
