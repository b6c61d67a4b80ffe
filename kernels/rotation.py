"""RoPE inside the Triton kernels: cos/sin of fp32 angles, and R x on rotate_half halves."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .mode import INTERPRETED

# Compiled kernels take cos/sin from the hardware's approximations after an explicit range
# reduction; the interpreter (which cannot call libdevice) uses tl.cos/tl.sin.
FAST_TRIG: tl.constexpr = tl.constexpr(not INTERPRETED)
_TWO_PI_HI: tl.constexpr = tl.constexpr(6.2831854820251465)  # float32(2 pi)
_TWO_PI_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)  # 2 pi - _TWO_PI_HI
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915494309189535)


@triton.jit
def cos_sin(x):
    """cos x and sin x of fp32 angles.

    The library's precise cosf/sinf cost about 40 instructions each, plus a slow path for huge
    arguments, and a prefill query rebuild needs 32 angles per thread. Reducing x by the
    nearest multiple of 2 pi (two FMAs, 2 pi split in two parts) and calling the hardware's
    approximations costs under 10, and stays within 1e-6 of the precise values for
    |x| < 2**17 (the angle x itself, a position times a frequency in fp32, already carries
    an error of up to |x| * 2**-24)."""
    if FAST_TRIG:
        k = libdevice.rint(x * _INV_TWO_PI)
        r = tl.fma(-k, _TWO_PI_HI, x)
        r = tl.fma(-k, _TWO_PI_LO, r)
        c = libdevice.fast_cosf(r)
        s = libdevice.fast_sinf(r)
    else:
        c = tl.cos(x)
        s = tl.sin(x)
    return c, s


@triton.jit
def rotate(x1, x2, c, s):
    """R x for rows given as fp32 halves x1, x2 [M, HALF] and cos/sin broadcastable to them."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def join(r1, r2, DTYPE: tl.constexpr):
    """[r1 | r2] as one [M, 2*HALF] DTYPE tile (the rotate_half layout of the keys)."""
    M: tl.constexpr = r1.shape[0]
    H2: tl.constexpr = 2 * r1.shape[1]
    return tl.reshape(tl.permute(tl.join(r1.to(DTYPE), r2.to(DTYPE)), (0, 2, 1)), (M, H2))
