"""Continuous batching: which sequences run in the next step.

Sequences wait in arrival order. While the batch has room, the oldest arrived one is
admitted if the pool can take it now, counting the pages that evicting unpinned chunks
would free; newly admitted ones are prefilled together, and otherwise every running
sequence decodes one token. A sequence leaves as soon as it ends and the next takes
its place. The chunks of up to `lookahead` coming sequences are prefetched meanwhile.
The scheduler sees the cache only through `is_resident`, `available_pages` and
`prefetch` (and the mode, which places a sequence, through the cache's allocator).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.modes import ServingMode
from lazyrag.serve.paged import OutOfPages
from lazyrag.serve.request import Sequence


@dataclass
class Step:
    batch: list[Sequence]
    prefill: bool  # newly admitted: feed their prompts; otherwise one token each


class Scheduler:
    def __init__(self, mode: ServingMode, cache: ChunkCache, batch_size: int, sequences: Iterable[Sequence],
                 lookahead: int = 64):
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        self.mode, self.cache, self.batch_size, self.lookahead = mode, cache, batch_size, lookahead
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
                return None
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
        admitted = []
        while (self.waiting and len(self.running) + len(admitted) < self.batch_size
               and self.waiting[0].arrival <= now):
            seq = self.waiting[0]
            if not self.fits(seq):
                if self.running or admitted:
                    break  # wait for running sequences to free pages
                raise OutOfPages(f"request {seq.id} does not fit in the cache even alone: raise --cache-gb")
            seq.placement = self.mode.place(seq, self.cache)
            self.waiting.popleft()
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted
