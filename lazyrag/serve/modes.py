"""The three ways a request's context is placed in the pool, one class each.

  lazy   chunk pages are shared by every request that uses them; the kernels rotate
         each query by (its position - the chunk's shift). Zero copies.
  block  Block-Attention: each request gets its own copy of its chunks, keys
         re-rotated to their logical positions (fused rotate_copy), then ordinary
         attention. The copies take pool pages, as they would in a deployment.
  full   the whole prompt is recomputed with ordinary causal attention: the quality
         reference and the no-cache baseline.

All three build the same token ids, [preamble][chunk]...[chunk][question], at the same
logical positions. A mode says which pages a request needs (the scheduler's fit check),
places it (page rows, pins, copies) and names the tokens its prefill feeds. The engine
picks the class once, with `select_mode`; nothing else looks at a mode's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from lazyrag.config import Mode
from lazyrag.serve.cache import ChunkCache, Recomputed, Resident
from lazyrag.serve.paged import LENGTH, PAGE, Feed, OutOfPages, page_rows, pages_for
from lazyrag.serve.recompute import (Coverage, Recompute, chain_root, chained, choose, context_key,
                                     pages_to_recompute)
from lazyrag.serve.request import Placement, Request, Sequence
from lazyrag.store import ChunkInfo


@dataclass(frozen=True)
class ChunkCopy:
    """Copy a chunk's pages `src` to `dst`, rotating its keys by `delta` positions."""

    src: list[int]
    dst: list[int]
    delta: int


RotateCopy = Callable[[list[ChunkCopy]], None]


class ServingMode:
    """Placement shared by the modes; subclasses say where chunks go and what the prompt holds.

    The stored chunks were encoded after the preamble, at positions P..; a chunk that starts
    at logical position `pos` of a prompt is shifted by pos - P."""

    rotate_queries: ClassVar[bool] = False  # the kernels rotate each query per page by its delta
    shares_chunks: ClassVar[bool] = False   # requests read the cached chunk pages in place

    def __init__(self, preamble_ids: list[int], page_size: int, rotate_copy: RotateCopy,
                 recompute: Recompute = Recompute(), namespace: str = ""):
        """namespace: names the store (its fingerprint) in the keys of recomputed pages."""
        self.recompute = recompute
        self.namespace = f"{namespace}|{page_size}|{','.join(map(str, preamble_ids))}"
        self.preamble_ids = list(preamble_ids)
        self.P = len(self.preamble_ids)
        self.page_size = page_size
        self.rotate_copy = rotate_copy
        self.preamble = page_rows([], 0, 0, 0, page_size)  # rows of the shared preamble, once placed

    # -- what a request needs -----------------------------------------------------------
    def cached_chunks(self, request: Request) -> list[ChunkInfo]:
        """Chunks the request reads through the chunk cache."""
        return request.chunks

    def prompt_ids(self, request: Request) -> list[int]:
        """The tokens its prefill feeds (its own prompt; the rest of the context is placed)."""
        return request.question_ids

    def own_tokens(self, seq: Sequence) -> int:
        """Tokens in its own pages: prompt and answer."""
        return len(self.prompt_ids(seq.request)) + seq.max_new_tokens

    def private_pages(self, info: ChunkInfo) -> int:
        """Pages a chunk takes besides its shared copy."""
        return 0

    def recomputed_pages(self, request: Request) -> int:
        """Pages of the request's chunks it recomputes into pages of its own."""
        return 0

    def pages_needed(self, seq: Sequence, cache: ChunkCache) -> int:
        """Pages placing the request would allocate now (chunks already resident cost none)."""
        needed = pages_for(self.own_tokens(seq), self.page_size) + self.recomputed_pages(seq.request)
        for info in self.cached_chunks(seq.request):
            if not cache.is_resident(info.chunk_id):
                needed += pages_for(info.padded_length, self.page_size)
            needed += self.private_pages(info)
        return needed

    # -- placing it -----------------------------------------------------------------------
    def place_preamble(self, cache: ChunkCache) -> Feed | None:
        """Give the shared preamble its pages (positions 0..P-1, never evicted) and return the
        step that computes its K/V; None where the mode shares no preamble."""
        self.preamble = page_rows(cache.alloc(pages_for(self.P, self.page_size)), 0, self.P, 0, self.page_size)
        return Feed(self.preamble, 0, 0, 0, self.preamble_ids)

    def place(self, seq: Sequence, cache: ChunkCache) -> Placement:
        """Pin or copy the request's chunks and give it pages for its own tokens (and for the
        chunk pages it will recompute)."""
        ps = self.page_size
        chunks = self.cached_chunks(seq.request)
        pins = self._pin(seq, chunks, cache)
        chunk_rows, copies = self._chunk_rows(chunks, pins, cache)
        spare = cache.alloc(self.recomputed_pages(seq.request))
        own_start = self.own_start(seq.request)
        own_pages = cache.alloc(pages_for(self.own_tokens(seq), ps))
        own = page_rows(own_pages, own_start, len(own_pages) * ps, 0, ps)  # whole pages: see paged.Feed
        context = [self.preamble, *chunk_rows]
        placement = Placement(np.concatenate(context + [own]), sum(map(len, context)), own_start,
                              self.prompt_ids(seq.request), pins, own_pages,
                              [p for c in copies for p in c.dst] + spare, n_preamble=len(self.preamble),
                              chunk_rows=[len(r) for r in chunk_rows], spare=spare)
        if self.shares_chunks:  # the preamble's and each chunk's pages, read in place by every request using them
            placement.shared = np.concatenate([np.full(len(r), r[0, PAGE] + 1 if len(r) else 0, np.int32)
                                               for r in context] + [np.zeros(len(own), np.int32)])
        if copies:
            self.rotate_copy(copies)
            for entry in pins:  # the copy is all the request needs now
                cache.release(entry)
            placement.pins = []
        if self.recompute.fraction and not self.recompute.needs_scores:
            self.assign_recompute(seq.request, placement, cache)
        return placement

    @property
    def reuses_recompute(self) -> bool:
        """Whether recomputed pages are cached for later requests: only where chunks are shared
        (block's recompute writes into the request's own rotated copy)."""
        return self.shares_chunks and self.recompute.reuse

    @property
    def whole_prefix_uses(self) -> int | None:
        """How many prompts must share leading chunks for them to be recomputed whole
        (Recompute.whole_prefix_uses), where this mode reuses recomputed pages; else None."""
        return self.recompute.whole_prefix_uses if self.reuses_recompute else None

    def assign_recompute(self, request: Request, p: Placement, cache: ChunkCache,
                         row_mass: torch.Tensor | None = None) -> None:
        """Choose the chunk pages the placed request recomputes (row_mass: the attention its
        question pays each of its rows, for the `attention` policy) and point each chosen row
        at a page of its own where the mode shares the chunk. With reuse, it walks its chunks in
        order: where the cache holds pages recomputed after the same context (everything before
        the chunk, recomputed pages included) that keep what it reads recomputed at least its
        own choice's worth (`Coverage`), it takes them as they are; otherwise it recomputes its
        own choice there, less what the pages it took cover beyond it, and the cache keeps them.
        Within its shared prefix it wants the whole chunk (lazyrag/serve/recompute.py)."""
        first = np.cumsum([p.n_preamble] + p.chunk_rows)
        scores = None if row_mass is None else [row_mass[a: a + n] for a, n in zip(first, p.chunk_rows)]
        chosen = choose(self.recompute, p.chunk_rows, scores)
        if not self.reuses_recompute:
            for c, q in chosen:
                self._recompute_row(request, p, c, q, int(first[c] + q))
            cache.counters.recomputed_tokens += sum(len(tokens) for _, tokens in p.recompute)
            return
        if len(request.chunks) < 2 or not chosen:
            return
        coverage = Coverage([tuple(q for cc, q in chosen if cc == c) for c in range(len(request.chunks))], scores)
        state = chain_root(self.namespace, request.chunks[0].chunk_id)
        for c in range(1, len(request.chunks)):
            context = context_key(state, request.chunks[c].chunk_id)
            whole = tuple(range(p.chunk_rows[c]))
            entry, computes = None, False
            if c < request.shared_prefix:
                entry = cache.find_recomputed(context, lambda selection: 0.0 if selection == whole else None)
                if entry is None and self._reserve(p, cache, len(whole)):
                    entry, computes = self._recompute_chunk(request, p, c, int(first[c]), context, whole, cache), True
            if entry is None:  # outside the shared prefix, or no room for the whole chunk now
                entry = cache.find_recomputed(context, coverage.value(c))
            if entry is None:
                entry = self._recompute_chunk(request, p, c, int(first[c]), context, coverage.to_compute(c), cache)
            elif not computes:
                for q, page in zip(entry.selection, entry.pages):
                    p.rows[first[c] + q, PAGE] = page
                    p.shared[first[c] + q] = 0
            if entry.pages and len(entry.pages) == p.chunk_rows[c]:
                # a whole chunk recomputed: every request after this context reads the same pages
                # at the same positions, so they are read chunk-major like a stored chunk's
                p.shared[first[c]: first[c] + p.chunk_rows[c]] = entry.pages[0] + 1
            coverage.took(c, entry.selection)
            p.recomputed.append(entry)
            state = chained(context, entry.selection)
        unused, p.spare = p.spare, []  # back to the pool now rather than when the request ends
        p.private_pages = [pg for pg in p.private_pages if pg not in unused]
        cache.free(unused)

    def _reserve(self, p: Placement, cache: ChunkCache, n: int) -> bool:
        """Add n pages to the request's reserve for recomputed pages, if the pool has them."""
        try:
            pages = cache.alloc(n)
        except OutOfPages:
            return False
        p.spare += pages
        p.private_pages += pages
        return True

    def _recompute_chunk(self, request: Request, p: Placement, c: int, first_row: int, context: str,
                         selection: tuple[int, ...], cache: ChunkCache) -> Recomputed:
        """Have the request recompute pages `selection` of its chunk c, into pages the cache keeps
        under `context` (computed by this request's step: `created` until then)."""
        tokens = len(p.recompute)
        for q in selection:
            self._recompute_row(request, p, c, q, first_row + q)
        pages = [int(p.rows[row, PAGE]) for row, _ in p.recompute[tokens:]]
        p.private_pages = [pg for pg in p.private_pages if pg not in pages]  # the cache's now
        entry = cache.keep_recomputed(context, selection, pages, sum(len(t) for _, t in p.recompute[tokens:]))
        p.created.append(entry)
        return entry

    def _recompute_row(self, request: Request, p: Placement, c: int, q: int, row: int) -> None:
        """Have the request recompute page q of its chunk c, at page row `row`."""
        if self.shares_chunks:
            # the shared page stays as it is for every other request: this one reads a private
            # page in its place, with the same start and delta (keys at the same stored positions)
            p.rows[row, PAGE] = p.spare.pop()
            p.shared[row] = 0
        ps = self.page_size
        chunk = request.chunks[c]
        p.recompute.append((row, list(chunk.token_ids[q * ps: q * ps + int(p.rows[row, LENGTH])])))

    def own_start(self, request: Request) -> int:
        """Logical position of the request's first own token: after the preamble and its chunks."""
        return self.P + sum(c.length for c in request.chunks)

    def _pin(self, seq: Sequence, chunks: list[ChunkInfo], cache: ChunkCache) -> list[Resident]:
        # resident chunks first, so loading the others cannot evict them
        order = sorted(range(len(chunks)), key=lambda i: not cache.is_resident(chunks[i].chunk_id))
        pins: list[Resident | None] = [None] * len(chunks)
        for i in order:
            hits = cache.counters.hits
            pins[i] = cache.acquire(chunks[i])
            hit = cache.counters.hits > hits  # the cache's word: a chunk loaded ahead is a miss
            seq.hits, seq.misses = seq.hits + hit, seq.misses + (not hit)
        return pins

    def _chunk_rows(self, chunks: list[ChunkInfo], pins: list[Resident],
                    cache: ChunkCache) -> tuple[list[np.ndarray], list[ChunkCopy]]:
        """Page rows of each chunk in prompt order, and the copies they need made."""
        raise NotImplementedError


class Lazy(ServingMode):
    """Chunks read in place from their shared pages, shifted by the kernels."""

    rotate_queries = True
    shares_chunks = True

    def recomputed_pages(self, request: Request) -> int:
        if not self.recompute.fraction:
            return 0
        pages = [pages_for(c.length, self.page_size) for c in request.chunks]
        return pages_to_recompute(self.recompute.fraction, pages)


    def _chunk_rows(self, chunks, pins, cache):
        rows, pos = [], self.P
        for info, entry in zip(chunks, pins):
            rows.append(page_rows(entry.pages, self.P, info.length, pos - self.P, self.page_size))
            pos += info.length
        return rows, []


class Block(ServingMode):
    """A private copy of each chunk whose keys sit at their logical positions."""

    def private_pages(self, info: ChunkInfo) -> int:
        return pages_for(info.padded_length, self.page_size)

    def _chunk_rows(self, chunks, pins, cache):
        rows, copies, pos = [], [], self.P
        for info, entry in zip(chunks, pins):
            dst = cache.alloc(len(entry.pages))
            copies.append(ChunkCopy(entry.pages, dst, pos - self.P))
            rows.append(page_rows(dst, pos, info.length, 0, self.page_size))
            pos += info.length
        return rows, copies


class Full(ServingMode):
    """No cache: the whole prompt is the request's own tokens, computed at prefill."""

    def cached_chunks(self, request: Request) -> list[ChunkInfo]:
        return []

    def prompt_ids(self, request: Request) -> list[int]:
        return self.preamble_ids + [t for c in request.chunks for t in c.token_ids] + request.question_ids

    def own_start(self, request: Request) -> int:
        return 0

    def place_preamble(self, cache: ChunkCache) -> Feed | None:
        return None

    def _chunk_rows(self, chunks, pins, cache):
        return [], []


MODE_CLASSES: dict[Mode, type[ServingMode]] = {Mode.LAZY: Lazy, Mode.BLOCK: Block, Mode.FULL: Full}


def select_mode(mode: Mode | str) -> type[ServingMode]:
    """The class of a mode, given the enum or its value."""
    try:
        return MODE_CLASSES[Mode(mode)]
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(m.value for m in Mode)}") from None
