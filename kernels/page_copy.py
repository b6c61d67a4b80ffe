"""Triton rotate_copy: pages copied to new slots with their keys re-rotated (the block baseline)."""
from __future__ import annotations

import triton
import triton.language as tl

from .rotation import cos_sin, rotate


@triton.jit
def _rotate_copy_kernel(K, V, DK, DV, SRC, DST, DELTA, INVF,
                        stride_kp, stride_vp, stride_dkp, stride_dvp, rows_per_page,
                        HALF: tl.constexpr, BLOCK_R: tl.constexpr):
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
    r1, r2 = rotate(k1, k2, c, s)
    tl.store(DK + dst * stride_dkp + roff, r1.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DK + dst * stride_dkp + HALF + roff, r2.to(DK.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + roff, v1.to(DV.dtype.element_ty), mask=rmask[:, None])
    tl.store(DV + dst * stride_dvp + HALF + roff, v2.to(DV.dtype.element_ty), mask=rmask[:, None])


def rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=None, dst_v=None, block_r: int = 64):
    dst_k = k_pages if dst_k is None else dst_k
    dst_v = v_pages if dst_v is None else dst_v
    N = src.shape[0]
    if N == 0:
        return dst_k, dst_v
    _, PS, Hkv, D = k_pages.shape
    rows = PS * Hkv
    block_r = min(block_r, triton.next_power_of_2(rows))
    grid = (N, triton.cdiv(rows, block_r))
    _rotate_copy_kernel[grid](k_pages, v_pages, dst_k, dst_v, src, dst, delta, inv_freq,
                              k_pages.stride(0), v_pages.stride(0), dst_k.stride(0), dst_v.stride(0), rows,
                              HALF=D // 2, BLOCK_R=block_r, num_warps=4)
    return dst_k, dst_v
