"""Triton bit_rows: a 512 x 32 matrix over GF(2) applied to every 64-byte row of a byte array.

A CRC is linear over GF(2) in the bits it reads, so one such matrix gives each row's CRC and
another folds 16 row CRCs into the CRC of their concatenation (lazyrag/serve/device_checksums.py
builds them): a chunk's crc32c on the GPU is a few launches of this kernel over its bytes. The
product runs on the tensor cores: each byte unpacked to eight 0/1 fp16 values, times the matrix
in fp16 with fp32 sums (at most 512, exact), and the sums' parity packed back into 32 bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BYTES = 64
BITS = 32


@triton.jit(do_not_specialize=["n", "pad", "rows", "xor"])  # one compiled variant for every chunk and level
def _bit_rows_kernel(DATA, MAT, OUT, n, pad, rows, xor,
                     BLOCK_M: tl.constexpr, STEP: tl.constexpr, ROW: tl.constexpr, BITS: tl.constexpr):
    # one program: BLOCK_M rows; the data sits `pad` bytes into the first row, zeros before and after it
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, STEP)
    offs_k = tl.arange(0, STEP * 8)  # the bits of STEP bytes of a row: byte k // 8, bit k % 8
    offs_n = tl.arange(0, BITS)
    acc = tl.zeros((BLOCK_M, BITS), dtype=tl.float32)
    for step in tl.static_range(0, ROW, STEP):
        at = offs_m[:, None].to(tl.int64) * ROW + step + offs_b[None, :] - pad
        byte = tl.load(DATA + at, mask=(at >= 0) & (at < n), other=0).to(tl.int32)
        bits = (byte[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
        bits = tl.reshape(bits, (BLOCK_M, STEP * 8)).to(tl.float16)
        mat = tl.load(MAT + (step * 8 + offs_k[:, None]) * BITS + offs_n[None, :])
        acc += tl.dot(bits, mat)
    parity = acc.to(tl.int32) & 1
    word = tl.sum(parity << offs_n[None, :], axis=1) ^ xor  # distinct bits: the sum is their OR
    tl.store(OUT + offs_m, word, mask=offs_m < rows)


def bit_rows(data: torch.Tensor, pad: int, matrix: torch.Tensor, xor: int, out: torch.Tensor,
             block_m: int = 64, step: int = 16) -> None:
    """See kernels.bit_rows."""
    rows = out.numel()
    if rows:
        signed_xor = xor - (1 << 32) if xor >= 1 << 31 else xor  # an int32 argument, whatever its top bit
        _bit_rows_kernel[(triton.cdiv(rows, block_m),)](data, matrix, out, data.numel(), pad, rows, signed_xor,
                                                        BLOCK_M=block_m, STEP=step, ROW=ROW_BYTES, BITS=BITS)
