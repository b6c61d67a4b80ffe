"""Page table of the paged KV pool (docs/kernels.md has the full contract)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PageTable:
    """Which pages each request reads, and where they sit in the request's logical sequence.

    All fields are int32 tensors on the pool's device. ``B`` requests, ``max_pages`` entries
    each; entries at index >= ``count[b]`` are ignored.

    ids:    [B, max_pages] physical page index into the pool, in logical order.
    delta:  [B, max_pages] rotation shift = logical position - stored position.
    start:  [B, max_pages] stored position of the page's first token.
    length: [B, max_pages] valid tokens in the page (1..page_size; the rest is masked).
    count:  [B] pages used by each request.

    Key ``j`` of entry ``p`` of request ``b`` has stored position ``start + j`` and logical
    position ``start + delta + j``.
    """

    ids: Tensor
    delta: Tensor
    start: Tensor
    length: Tensor
    count: Tensor

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @property
    def max_pages(self) -> int:
        return int(self.ids.shape[1])

    def to(self, device) -> "PageTable":
        return PageTable(*(t.to(device) for t in (self.ids, self.delta, self.start, self.length, self.count)))

    def validate(self) -> None:
        b, p = self.ids.shape
        for name in ("ids", "delta", "start", "length"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or tuple(t.shape) != (b, p):
                raise ValueError(f"PageTable.{name} must be int32 [{b}, {p}], got {t.dtype} {tuple(t.shape)}")
        if self.count.dtype != torch.int32 or tuple(self.count.shape) != (b,):
            raise ValueError(f"PageTable.count must be int32 [{b}], got {self.count.dtype} {tuple(self.count.shape)}")
