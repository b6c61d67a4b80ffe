"""Triton rotate_copy: pages copied to new slots with their keys re-rotated (the block baseline).
fp8 keys are dequantised, rotated in fp32 and requantised row by row; values and their scales
are copied as they are."""
from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import FP8, FP8_MAX
from .rotation import cos_sin, rotate


@triton.jit
def e4m3_grid(x):
    """fp32 x in [-448, 448] rounded (to nearest even) to a value e4m3 holds exactly, so that the
    conversion after it has nothing left to round. Triton's interpreter rounds that conversion
    itself wrongly (127.9 -> 64: a carry into the exponent is lost); this keeps its result, and
    the interpreter's tests, those of the GPU."""
    bits = x.to(tl.int32, bitcast=True)
    # normal e4m3 keeps 3 of fp32's 23 mantissa bits: round the other 20 off
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2**-6 e4m3 is subnormal, in steps of 2**-9: adding 1.5 * 2**14 rounds to them
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _rotate_copy_kernel(K, V, DK, DV, KS, VS, DKS, DVS, SRC, DST, DELTA, INVF,
                        stride_kp, stride_vp, stride_dkp, stride_dvp,
                        stride_ksp, stride_vsp, stride_dksp, stride_dvsp, rows_per_page,
                        HALF: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    # one program: BLOCK_R rows (token, KV head) of one page; an fp8 page's scales sit in the same row order
    i = tl.program_id(0)
    rb = tl.program_id(1)
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    d = tl.load(DELTA + i)
    offs_h = tl.arange(0, HALF)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < rows_per_page
    invf = tl.load(INVF + offs_h)
    c, s = cos_sin(d.to(tl.float32) * invf)
    c = c[None, :]
    s = s[None, :]
    roff = offs_r[:, None] * (2 * HALF) + offs_h[None, :]
    k1 = tl.load(K + src * stride_kp + roff, mask=rmask[:, None]).to(tl.float32)
    k2 = tl.load(K + src * stride_kp + HALF + roff, mask=rmask[:, None]).to(tl.float32)
    v1 = tl.load(V + src * stride_vp + roff, mask=rmask[:, None])
    v2 = tl.load(V + src * stride_vp + HALF + roff, mask=rmask[:, None])
    if FP8:
        ks = tl.load(KS + src * stride_ksp + offs_r, mask=rmask, other=0.0)[:, None]
        k1 = k1 * ks
        k2 = k2 * ks
    r1, r2 = rotate(k1, k2, c, s)
    if FP8:  # the rotated row's own scale: rotation mixes the halves, so its amax changes
        scale = tl.maximum(tl.max(tl.abs(r1), axis=1), tl.max(tl.abs(r2), axis=1)) / FP8_MAX
        div = tl.where(scale > 0, scale, 1.0)[:, None]
        r1 = e4m3_grid(tl.minimum(tl.maximum(r1 / div, -FP8_MAX), FP8_MAX))
        r2 = e4m3_grid(tl.minimum(tl.maximum(r2 / div, -FP8_MAX), FP8_MAX))
        tl.store(DKS + dst * stride_dksp + offs_r, scale, mask=rmask)
        tl.store(DVS + dst * stride_dvsp + offs_r, tl.load(VS + src * stride_vsp + offs_r, mask=rmask), mask=rmask)
    tl.store(DK + dst * stride_dkp + roff, r1.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DK + dst * stride_dkp + HALF + roff, r2.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + roff, v1.to(DV.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + HALF + roff, v2.to(DV.dtype.element_ty), mask=rmask[:, None])


def rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=None, dst_v=None, k_scale=None, v_scale=None,
                dst_k_scale=None, dst_v_scale=None, block_r: int = 64):
    if dst_k is None:
        dst_k, dst_k_scale = k_pages, k_scale
    if dst_v is None:
        dst_v, dst_v_scale = v_pages, v_scale
    N = src.shape[0]
    if N == 0:
        return dst_k, dst_v
    _, PS, Hkv, D = k_pages.shape
    rows = PS * Hkv
    block_r = min(block_r, triton.next_power_of_2(rows))
    grid = (N, triton.cdiv(rows, block_r))
    fp8 = k_pages.dtype == FP8
    scales = (k_scale, v_scale, dst_k_scale, dst_v_scale)
    _rotate_copy_kernel[grid](k_pages, v_pages, dst_k, dst_v, *scales, src, dst, delta, inv_freq,
                              k_pages.stride(0), v_pages.stride(0), dst_k.stride(0), dst_v.stride(0),
                              *(t.stride(0) if fp8 else 0 for t in scales), rows,
                              HALF=D // 2, BLOCK_R=block_r, FP8=fp8, FP8_MAX=FP8_MAX, num_warps=4)
    return dst_k, dst_v
