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
    ape_lo, ape_hi: optional [B]: entries ape_lo <= p < ape_hi take APE's temperature and
            scale when a kernel is given them (see ``ape_enabled``); needed only then.

    Key ``j`` of entry ``p`` of request ``b`` has stored position ``start + j`` and logical
    position ``start + delta + j``.
    """

    ids: Tensor
    delta: Tensor
    start: Tensor
    length: Tensor
    count: Tensor
    ape_lo: Tensor | None = None
    ape_hi: Tensor | None = None

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @property
    def max_pages(self) -> int:
        return int(self.ids.shape[1])

    @property
    def has_ape(self) -> bool:
        return self.ape_lo is not None

    def to(self, device) -> "PageTable":
        ape = (self.ape_lo.to(device), self.ape_hi.to(device)) if self.has_ape else ()
        return PageTable(*(t.to(device) for t in (self.ids, self.delta, self.start, self.length, self.count)), *ape)

    def validate(self) -> None:
        b, p = self.ids.shape
        for name in ("ids", "delta", "start", "length"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or tuple(t.shape) != (b, p):
                raise ValueError(f"PageTable.{name} must be int32 [{b}, {p}], got {t.dtype} {tuple(t.shape)}")
        if (self.ape_lo is None) != (self.ape_hi is None):
            raise ValueError("PageTable.ape_lo and ape_hi come together")
        for name in ("count", "ape_lo", "ape_hi") if self.has_ape else ("count",):
            t = getattr(self, name)
            if t.dtype != torch.int32 or tuple(t.shape) != (b,):
                raise ValueError(f"PageTable.{name} must be int32 [{b}], got {t.dtype} {tuple(t.shape)}")


def ape_enabled(temperature: float, scale: float) -> bool:
    """Whether APE (adaptive parallel encoding, Yang et al., ICLR 2025) changes anything. For
    entries ape_lo <= p < ape_hi a key's logit becomes (q . k) * sm_scale / T + ln S: T = S = 1
    is plain attention, and the kernels then compile the transform out."""
    return temperature != 1.0 or scale != 1.0
