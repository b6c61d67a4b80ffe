"""Triton rows_to_pages: a chunk's rows, token-major as the store keeps them, into pool pages.

Each token's row holds, per layer and K/V, a contiguous piece of `unit` elements (its KV heads
times head_dim, or an fp8 row's scales); the pool keeps each (K/V, layer) plane page-major. One
program moves BLOCK elements of one page of one plane: whole pieces read, contiguous pages
written, in place of an indexed assignment that moves a piece an element at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # moved as bits, any dtype


@triton.jit(do_not_specialize=["page_elems"])
def _rows_to_pages_kernel(SRC, DST, PAGES, layers, unit, page_elems, stride_plane, stride_page,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)      # which of the chunk's pages
    plane = tl.program_id(1)  # kv * layers + layer: its plane in the pool
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    token, u = offs // unit, offs % unit
    kv, layer = plane // layers, plane % layers
    # a row is [layers, 2, unit]: the piece of (layer, kv) starts at (layer * 2 + kv) * unit
    row_elems = layers * 2 * unit
    src = (i * (page_elems // unit) + token).to(tl.int64) * row_elems + (layer * 2 + kv) * unit + u
    page = tl.load(PAGES + i).to(tl.int64)
    dst = plane.to(tl.int64) * stride_plane + page * stride_page + offs
    tl.store(DST + dst, tl.load(SRC + src, mask=mask), mask=mask)


def rows_to_pages(rows: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, block: int = 4096) -> None:
    """See kernels.rows_to_pages."""
    kinds, layers, num_pages, page_size = pool.shape[:4]
    unit = pool[0, 0, 0, 0].numel()
    src, dst = (t.view(_SAME_WIDTH[t.element_size()]) for t in (rows, pool))
    page_elems = page_size * unit
    grid = (pages.numel(), kinds * layers, triton.cdiv(page_elems, block))
    _rows_to_pages_kernel[grid](src, dst, pages, layers, unit, page_elems, num_pages * page_elems, page_elems,
                                BLOCK=block)
