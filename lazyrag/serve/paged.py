"""Paged KV memory and the attention step that runs over it.

`PagePool` is the memory: one tensor [2 (k/v), layers, num_pages, page_size,
kv_heads, head_dim] and a free list (k/v outermost, so all layers' key pages form
one [layers * num_pages, ...] array: block mode copies every layer in one launch).
The pool holds the store's KV dtype, whatever the model computes in (on the CPU fp32 over
bf16 pages: each step's new K/V is cast as it is written). A pool of an fp8 store holds e4m3 pages and one fp32 scale per (token, KV head) row
beside them, [2, layers, num_pages, page_size, kv_heads]; the request's own tokens are
quantised the same way as they are written, so one pool holds one dtype.
In serving, the chunk cache is the only thing that allocates and releases its pages.
A request sees the pool through page rows (see `page_rows`): which physical page, its
rotation shift `delta`, the stored position of its first token and how many of its
tokens are valid. A step's inputs (tokens, positions, K/V slots, page table) are packed
on the host into one int32 buffer (`pack_step`, `StepLayout`) and reach the GPU in one
copy. `PagedAttention` is the callable the model's layers call: it writes the step's new
K/V into their slots, then runs the kernels over each request's page list.

Every mode uses this one path; they differ only in the page lists they build and
in whether the kernel rotates queries per page (`lazy`) or the keys already sit
at their logical positions (`block`, `full`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from lazyrag import kernels
from lazyrag.kernels.rope import rope_table
from lazyrag.models import rotate
from lazyrag.store import kv_row_bytes, pack_fp8_rows, unpack_fp8_rows


class OutOfPages(RuntimeError):
    pass


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU from calloc (numpy's zeros), whose pages the kernel maps on
    first touch: a pool of --cache-gb costs memory as it fills, not all of it up front."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(size, np.uint8)).view(dtype).view(shape)


class PagePool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        """dtype: the pages' (the store's KV dtype); fp8 pages come with their scales."""
        self.page_size = page_size
        self.kv = _zeros((2, num_layers, num_pages, page_size, num_kv_heads, head_dim), dtype, device)
        self.scales = (_zeros((2, num_layers, num_pages, page_size, num_kv_heads), torch.float32, device)
                       if dtype == kernels.FP8 else None)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self.num_pages = num_pages
        self.peak_used = 0

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page of every layer's K and V (fp8: scales included)."""
        return page_size * kv_row_bytes(str(dtype).removeprefix("torch."), num_layers, num_kv_heads, head_dim)

    @classmethod
    def for_bytes(cls, budget_bytes: float, num_layers, num_kv_heads, head_dim, page_size, dtype, device) -> "PagePool":
        per_page = cls.page_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype)
        return cls(num_layers, num_kv_heads, head_dim, max(1, int(budget_bytes // per_page)), page_size, dtype, device)

    @property
    def bytes_per_page(self) -> int:
        _, layers, _, page_size, kv_heads, head_dim = self.kv.shape
        return self.page_bytes(layers, kv_heads, head_dim, page_size, self.kv.dtype)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def alloc(self, n: int) -> list[int]:
        """Lowest page ids first; released pages are the next handed out (a stack)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.used)
        return pages

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[0, i], self.kv[1, i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scales of layer i's key and value pages [num_pages, page_size, kv_heads]; None unless fp8."""
        return (None, None) if self.scales is None else (self.scales[0, i], self.scales[1, i])

    def all_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value pages of every layer as [layers * num_pages, page_size, kv_heads, head_dim];
        page p of layer l is row l * num_pages + p."""
        return self.kv[0].flatten(0, 1), self.kv[1].flatten(0, 1)

    def all_layer_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scales of all_layers' pages, in the same rows; None unless fp8."""
        return (None, None) if self.scales is None else (self.scales[0].flatten(0, 1), self.scales[1].flatten(0, 1))

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A step's new K and V [tokens, kv_heads, head_dim] into their slots (page * page_size +
        offset) of `layer`, cast to the pool's dtype (a CPU model computes in fp32 over a bf16 pool);
        an fp8 pool quantises each (token, KV head) row as the store does."""
        for kv, pages, scales in zip((k, v), self.layer(layer), self.layer_scales(layer)):
            if scales is None:
                pages.view(-1, *pages.shape[2:])[slots] = kv.to(pages.dtype)
            else:
                values, scale = kernels.quantize_fp8(kv)
                pages.view(-1, *pages.shape[2:])[slots] = values
                scales.view(-1, scales.shape[-1])[slots] = scale

    def keys(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Key pages `pages` of `layer` in fp32 [n, page_size, kv_heads, head_dim], dequantised if fp8."""
        k = self.kv[0, layer][pages]
        return k.float() if self.scales is None else kernels.dequantize_fp8(k, self.scales[0, layer][pages])

    def write_tokens(self, pages: list[int], kv: torch.Tensor) -> None:
        """kv: rows in the store's layout [tokens (whole pages), *StoreSettings.row_shape]: [layers, 2,
        kv_heads, head_dim], or for an fp8 pool packed rows (values and scale), unpacked on the device."""
        # non_blocking for the page ids too: a blocking copy would wait for the whole copy stream
        at = torch.tensor(pages).to(self.kv.device, non_blocking=True)
        x = kv.to(self.kv.device, non_blocking=True)
        if self.scales is None:
            kernels.rows_to_pages(x.contiguous(), self.kv, at)
            return
        values, scales = unpack_fp8_rows(x)
        kernels.rows_to_pages(values.contiguous(), self.kv, at)
        kernels.rows_to_pages(scales, self.scales, at)

    def read_tokens(self, pages: list[int]) -> torch.Tensor:
        """The inverse of write_tokens: [len(pages) * page_size, *StoreSettings.row_shape]."""
        # non_blocking: a blocking copy would wait for the GPU, and index's next batch would only be
        # launched once this one had run
        at = torch.tensor(pages).to(self.kv.device, non_blocking=True)
        x = self.kv[:, :, at].permute(2, 3, 1, 0, 4, 5)
        if self.scales is not None:
            x = pack_fp8_rows(x, self.scales[:, :, at].permute(2, 3, 1, 0, 4))
        return x.reshape(len(pages) * self.page_size, *x.shape[2:])


# A request's view of the pool is an array of page rows [n, 4] int32, in logical order:
PAGE, DELTA, START, LENGTH = range(4)
# page: physical page; delta: logical - stored position; start: stored position of the
# page's first token; length: valid tokens in the page.


def page_rows(pages: list[int], start: int, tokens: int, delta: int, page_size: int) -> np.ndarray:
    """Rows for a run of `tokens` tokens stored from position `start` in consecutive pages."""
    n = pages_for(tokens, page_size)
    i = np.arange(n, dtype=np.int32)
    rows = np.empty((n, 4), dtype=np.int32)
    rows[:, PAGE] = pages[:n]
    rows[:, DELTA] = delta
    rows[:, START] = start + i * page_size
    rows[:, LENGTH] = np.minimum(tokens - i * page_size, page_size)
    return rows


@dataclass
class Feed:
    """What one request feeds in a step: its own tokens first .. first + len(tokens) - 1.

    rows: its page rows, context first (n_context of them), then the pages of its own
    tokens (prompt and answer), which start at logical position own_start. Own rows may
    claim whole pages: slots past the tokens fed so far sit at later positions, which the
    causal rule hides, so one array serves every step of the request.
    ape_rows: the rows [lo, hi) that take APE's temperature and scale (kernels.PageTable):
    the chunk pages, when the tokens fed are the request's own; none where they are not (the
    preamble, a recomputed chunk page).
    shared: per row, 0 where only this request reads it, else a label naming the stored page
    sequence (chunk, preamble) it is a page of, the same in every request: what chunk-major
    attention shares (kernels.group_shared; lazyrag/serve/sharing.py). None: nothing shared.
    """
    rows: np.ndarray
    n_context: int
    own_start: int
    first: int
    tokens: list[int]
    ape_rows: tuple[int, int] = (0, 0)
    shared: np.ndarray | None = None

    def rows_read(self, page_size: int) -> int:
        """The rows its tokens attend over: the context, then its own pages up to its last token fed."""
        return self.n_context + pages_for(self.first + len(self.tokens), page_size)


ALIGN = 4  # int32s: every field starts 16-byte aligned


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StepViews(NamedTuple):
    """The fields of a packed step, as views of its buffer (StepLayout.views)."""
    table: Any          # [4, batch, width]: PAGE, DELTA, START, LENGTH planes
    tail: Any           # everything after the table, in one piece
    count: Any          # [batch] page rows per request
    cu: Any             # [batch + 1] cu_seqlens
    ape_lo: Any         # [batch] each request's APE row range (Feed.ape_rows)
    ape_hi: Any
    tokens: Any         # [tokens]
    positions: Any
    key_positions: Any
    slots: Any


@dataclass(frozen=True)
class StepLayout:
    """Where each input of a step sits in one flat int32 buffer, so the host packs them all
    and they reach the GPU in one copy: the page table [4, batch, width] (PAGE, DELTA,
    START, LENGTH planes; rows `row` apart), then count [batch], cu_seqlens [batch + 1],
    ape_lo and ape_hi [batch], tokens, positions, key positions and slots [tokens].

    Every field and table row starts 16-byte aligned: Triton compiles a kernel variant per
    pointer alignment, and fields whose alignment followed the batch size and width compiled
    new variants in the middle of a serving run (a 1-2 s stall in bench_e2e's open loop)."""
    batch: int
    width: int
    tokens: int

    @property
    def row(self) -> int:
        return _aligned(self.width)

    @property
    def table_size(self) -> int:
        return 4 * self.batch * self.row

    @property
    def tail_sizes(self) -> tuple[int, ...]:
        B, T = self.batch, self.tokens
        return B, B + 1, B, B, T, T, T, T

    @property
    def size(self) -> int:
        return self.table_size + sum(_aligned(n) for n in self.tail_sizes)

    def views(self, buf) -> StepViews:
        """The step's fields as views of buf."""
        table = buf[: self.table_size].reshape(4, self.batch, self.row)[:, :, : self.width]
        tail = buf[self.table_size: self.size]
        return StepViews(table, tail, *(tail[a:b] for a, b in _spans(self.tail_sizes)))


def _spans(sizes):
    at = 0
    for n in sizes:
        yield at, at + n
        at += _aligned(n)


def pack_step(feeds: list[Feed], page_size: int, batch: int | None = None, pad_slot: int = 0,
              pin: bool = False) -> tuple[torch.Tensor, StepLayout]:
    """One step's inputs in one int32 host buffer (pinned if `pin`). `batch` > len(feeds) pads
    with one-token rows that read no pages and write their K/V to `pad_slot` (CUDA graphs
    run a fixed batch)."""
    B = batch or len(feeds)
    counts = [f.rows_read(page_size) for f in feeds]
    T = sum(len(f.tokens) for f in feeds) + (B - len(feeds))
    layout = StepLayout(B, max(counts, default=0), T)
    host = torch.empty(layout.size, dtype=torch.int32, pin_memory=pin)
    table, _, count, cu, ape_lo, ape_hi, tokens, positions, key_positions, slots = layout.views(host.numpy())
    table[:] = 0
    count[:], ape_lo[:], ape_hi[:] = 0, 0, 0
    tokens[:], positions[:], key_positions[:], slots[:] = 0, 0, 0, pad_slot
    cu[:] = np.arange(B + 1) + (T - B)  # padding rows: one token each, after the feeds'
    cu[0] = 0
    if feeds:  # whole arrays at once: a prefill step with recompute has thousands of feeds
        n = len(feeds)
        count[:n] = counts
        ape_lo[:n], ape_hi[:n] = np.array([f.ape_rows for f in feeds], np.int32).reshape(n, 2).T
        rows = np.concatenate([f.rows[:c] for f, c in zip(feeds, counts)])
        row_at = np.cumsum(counts) - counts
        feed = np.repeat(np.arange(n), counts)
        table[:, feed, np.arange(len(rows)) - row_at[feed]] = rows.T
        lens = np.array([len(f.tokens) for f in feeds])
        cu[1: n + 1] = np.cumsum(lens)
        k = int(cu[n])
        tokens[:k] = np.fromiter(chain.from_iterable(f.tokens for f in feeds), np.int64, k)
        of = np.repeat(np.arange(n), lens)  # each token's feed
        own = np.array([f.first for f in feeds])[of] + np.arange(k) - (cu[of])  # index among the feed's own tokens
        own_rows = rows[row_at[of] + np.array([f.n_context for f in feeds])[of] + own // page_size]
        positions[:k] = np.array([f.own_start for f in feeds])[of] + own
        key_positions[:k] = positions[:k] - own_rows[:, DELTA]  # a recomputed chunk page keeps its delta
        slots[:k] = own_rows[:, PAGE] * page_size + own % page_size
    return host, layout


def copy_step(src: torch.Tensor, src_layout: StepLayout, dst: torch.Tensor, dst_layout: StepLayout) -> None:
    """Copy a packed step into a buffer whose page table is at least as wide (same batch and
    tokens): how a CUDA graph's fixed-width buffer takes each step."""
    src_views, views = src_layout.views(src), dst_layout.views(dst)
    views.table[:, :, : src_layout.width].copy_(src_views.table)  # entries past a request's count are never read
    views.tail.copy_(src_views.tail)


@dataclass
class StepInputs:
    """A packed step on the device: the model's tokens and positions, and what attention reads.
    key_positions: where each token's key is rotated to (its position, less its page's delta)."""
    tokens: torch.Tensor
    positions: torch.Tensor
    key_positions: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    pages: kernels.PageTable
    decode: bool  # one token per request
    shared: kernels.SharedPlan | None = None  # chunk-major: `pages` is then each request's remainder
    max_seqlen: int | None = None  # the longest request's tokens, known on the host (prefill needs no sync)

    @classmethod
    def on(cls, buf: torch.Tensor, layout: StepLayout) -> "StepInputs":
        v = layout.views(buf)
        ids, delta, start, length = v.table.unbind(0)
        pages = kernels.PageTable(ids, delta, start, length, v.count, v.ape_lo, v.ape_hi)
        return cls(v.tokens, v.positions, v.key_positions, v.slots, v.cu, pages, decode=layout.tokens == layout.batch)

    @classmethod
    def upload(cls, feeds: list[Feed], page_size: int, device: torch.device) -> "StepInputs":
        host, layout = pack_step(feeds, page_size, pin=device.type == "cuda")
        # pinned memory comes from torch's caching host allocator, which keeps a block until
        # the copies reading it have run, so the next step cannot overwrite it early
        step = cls.on(host.to(device, non_blocking=True), layout)
        step.max_seqlen = max((len(f.tokens) for f in feeds), default=1)
        return step


class PagedAttention:
    """The attention of one forward step over the pool (see the module docstring).

    lazy: rotate queries per page in the kernel; otherwise rotate them once at their
    logical positions (the keys already sit at theirs). ape: APE's (temperature, scale) on
    each request's APE rows (Feed.ape_rows); (1, 1) is off.
    """

    def __init__(self, pool: PagePool, step: StepInputs, inv_freq: torch.Tensor, sm_scale: float, lazy: bool,
                 ape: tuple[float, float] = (1.0, 1.0)):
        self.pool, self.step = pool, step
        self.inv_freq, self.sm_scale, self.lazy = inv_freq, sm_scale, lazy
        self.ape_temperature, self.ape_scale = ape
        self._queries_at = None  # block and full: the rope table of the step's positions, made once

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write(layer, k, v)
        return self.attend(layer, q)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K and V into their slots, before any attention of the layer reads them."""
        self.pool.write_slots(layer, self.step.slots, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The step's queries over the pool, the step's own K and V written."""
        st = self.step
        k_pages, v_pages = self.pool.layer(layer)
        k_scale, v_scale = self.pool.layer_scales(layer)
        if not self.lazy:  # keys sit at logical positions: rotate q once, like any engine
            if self._queries_at is None:
                self._queries_at = rope_table(st.positions, self.inv_freq)
            q = rotate(q, self._queries_at)
        if st.shared is not None:  # lazy only: runs shared by several requests read once for all
            kw = dict(ape_temperature=self.ape_temperature, ape_scale=self.ape_scale, k_scale=k_scale, v_scale=v_scale)
            if st.decode:
                return kernels.shared_decode(q, k_pages, v_pages, st.pages, st.shared, st.positions, self.inv_freq,
                                             self.sm_scale, **kw)
            return kernels.shared_prefill(q, k_pages, v_pages, st.pages, st.shared, st.cu_seqlens, st.positions,
                                          self.inv_freq, self.sm_scale, max_seqlen_q=st.max_seqlen, **kw)
        if st.decode:
            return kernels.lazy_decode(q, k_pages, v_pages, st.pages, st.positions, self.inv_freq, self.sm_scale,
                                       rotate=self.lazy, ape_temperature=self.ape_temperature,
                                       ape_scale=self.ape_scale, k_scale=k_scale, v_scale=v_scale)
        return kernels.lazy_prefill(q, k_pages, v_pages, st.pages, st.cu_seqlens, st.positions, self.inv_freq,
                                    self.sm_scale, rotate=self.lazy, ape_temperature=self.ape_temperature,
                                    ape_scale=self.ape_scale, k_scale=k_scale, v_scale=v_scale,
                                    max_seqlen_q=st.max_seqlen)
