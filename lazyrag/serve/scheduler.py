"""Continuous batching: which sequences run in the next step.

Sequences wait in arrival order. While the batch has room, the oldest arrived one is
admitted if the pool can take it now, counting the pages that evicting unpinned chunks
would free; newly admitted ones are prefilled together, and otherwise every running
sequence decodes one token. A sequence leaves as soon as it ends and the next takes
its place. The chunks of up to `lookahead` coming sequences are prefetched meanwhile.
The scheduler sees the cache only through `is_resident`, `available_pages` and
`prefetch` (and the mode, which places a sequence, through the cache's allocator).

A chunk that cannot be read (corrupt, or its segment missing or truncated) fails only the
sequences that need it: their placement is undone and they go to `on_error`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from lazyrag.serve.cache import ChunkCache, Resident
from lazyrag.serve.modes import ServingMode
from lazyrag.serve.paged import OutOfPages
from lazyrag.serve.request import Sequence
from lazyrag.store import ChunkInfo, ChunkReadError

OnError = Callable[[Sequence, ChunkReadError], None]


@dataclass
class Step:
    batch: list[Sequence]
    prefill: bool  # newly admitted: feed their prompts; otherwise one token each


class Scheduler:
    def __init__(self, mode: ServingMode, cache: ChunkCache, batch_size: int, sequences: Iterable[Sequence],
                 lookahead: int = 64, on_error: OnError | None = None):
        """on_error(seq, exc): a sequence that failed because one of its chunks cannot be read,
        after everything its placement took has been given back; None re-raises the error."""
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        self.mode, self.cache, self.batch_size, self.lookahead = mode, cache, batch_size, lookahead
        self.on_error = on_error
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._source = iter(sequences)
        self._exhausted = False

    def schedule(self) -> Step | None:
        """The next step, or None once every sequence has finished. While nothing can run
        before the next arrival (an open-loop workload), it sleeps until then."""
        while True:
            self._refill()
            for seq in self.waiting:
                self.cache.prefetch(self.mode.cached_chunks(seq.request))
            admitted = self._admit(time.perf_counter())
            if admitted:
                return Step(admitted, prefill=True)
            if self.running:
                return Step(list(self.running), prefill=False)
            if not self.waiting:
                if self._exhausted:
                    return None
                continue  # every waiting sequence failed: take the next ones
            time.sleep(max(0.0, self.waiting[0].arrival - time.perf_counter()))

    def fits(self, seq: Sequence) -> bool:
        """Whether the pool can take the sequence now (counting pages LRU eviction could free)."""
        keep = {c.chunk_id for c in self.mode.cached_chunks(seq.request)}
        return self.mode.pages_needed(seq, self.cache) <= self.cache.available_pages(keep)

    def retire(self) -> list[Sequence]:
        """The running sequences that have finished, their pages given back."""
        done = [seq for seq in self.running if seq.finished]
        self.finish(done)
        return done

    def finish(self, seqs: list[Sequence]) -> None:
        """Take sequences out of the batch and give back what they hold."""
        for seq in seqs:
            self.running.remove(seq)
            seq.placement.release(self.cache)

    def _refill(self) -> None:
        while not self._exhausted and len(self.waiting) < self.lookahead:
            nxt = next(self._source, None)
            if nxt is None:
                self._exhausted = True
            else:
                self.waiting.append(nxt)

    def _admit(self, now: float) -> list[Sequence]:
        admitted, failed = [], []
        while (self.waiting and len(self.running) + len(admitted) < self.batch_size
               and self.waiting[0].arrival <= now):
            seq = self.waiting[0]
            if not self.fits(seq):
                if self.running or admitted:
                    break  # wait for running sequences to free pages
                raise OutOfPages(f"request {seq.id} does not fit in the cache even alone: raise --cache-gb")
            self.waiting.popleft()
            held = _Held(self.cache)
            try:
                seq.placement = self.mode.place(seq, held)
            except BaseException as exc:
                held.give_back()
                if not (isinstance(exc, ChunkReadError) and self.on_error is not None):
                    raise
                failed.append((seq, exc))
                continue
            admitted.append(seq)
        self.running.extend(admitted)
        for seq, exc in failed:  # once the batch is consistent, in case the callback raises
            self.on_error(seq, exc)
        return admitted


class _Held:
    """The cache as one placement sees it, noting the pins and pages it takes, so a placement
    that fails part way can give them all back."""

    def __init__(self, cache: ChunkCache):
        self.cache = cache
        self.pins: list[Resident] = []
        self.pages: list[int] = []

    def is_resident(self, chunk_id: str) -> bool:
        return self.cache.is_resident(chunk_id)

    def acquire(self, info: ChunkInfo) -> Resident:
        entry = self.cache.acquire(info)
        self.pins.append(entry)
        return entry

    def release(self, entry: Resident) -> None:
        self.cache.release(entry)
        self.pins.remove(entry)

    def alloc(self, n: int) -> list[int]:
        pages = self.cache.alloc(n)
        self.pages += pages
        return pages

    def free(self, pages: list[int]) -> None:
        self.cache.free(pages)
        gone = set(pages)
        self.pages = [p for p in self.pages if p not in gone]

    def give_back(self) -> None:
        for entry in self.pins:
            self.cache.release(entry)
        self.cache.free(self.pages)
        self.pins, self.pages = [], []
