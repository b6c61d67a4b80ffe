"""Continuous batching: which sequences run in the next step.

Sequences wait in arrival order. While the batch has room, the oldest arrived one is
admitted if the pool can take it now, counting the pages that evicting unpinned chunks
would free; newly admitted ones are prefilled together, and otherwise every running
sequence decodes one token. A sequence leaves as soon as it ends and the next takes
its place. The chunks of up to `lookahead` coming sequences (by default a batch's worth, at
least LOOKAHEAD) are read ahead meanwhile, in the order they will be needed, so that a cold batch
fills early with the sequences whose chunks have all come. A sequence with a chunk still on its
way (`is_loading`: read, or waiting its turn behind reads under way) waits for it, and one
behind it whose chunks are all resident goes first; otherwise the oldest is placed, reading what
it needs on the step loop. The scheduler sees the cache only
through `is_resident`, `is_loading`, `available_pages` and `prefetch` (and the mode, which
places a sequence, through the cache's allocator).

The source of sequences may be an open stream: it yields None while nothing new has arrived,
and the scheduler runs what it has and asks again at the next step (after IDLE_POLL_S
when it has nothing at all to run). It ends when the source is exhausted.

A chunk that cannot be read (corrupt, or its segment missing or truncated), or any other error
that concerns one request (lazyrag/serve/faults.py), fails only the sequences it concerns: their
placement is undone and they go to `on_error`. The engine hands back a batch whose step failed
(`retry_alone`): each of its sequences is then admitted alone, so one that fails is the culprit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from lazyrag.serve import faults
from lazyrag.serve.cache import ChunkCache, Recomputed, Resident
from lazyrag.serve.modes import ServingMode
from lazyrag.serve.paged import OutOfPages
from lazyrag.serve.request import Sequence
from lazyrag.store import ChunkInfo

OnError = Callable[[Sequence, Exception], None]
# How long a scheduler with nothing to run waits before looking again (an open stream with nothing
# new, or reads ahead not done yet): short beside a decode step, long enough not to spin a core.
IDLE_POLL_S = 0.001
# Waiting sequences whose chunks are read ahead, at least; by default a whole batch's worth, so the
# chunks of the batch after the running one are read while it runs. With 64 at batch 128, a
# 200-request cold run on an H200 started its last reads only when its second wave was admitted.
LOOKAHEAD = 64


def read_order(needs: Iterable[Iterable[ChunkInfo]]) -> list[ChunkInfo]:
    """Each chunk the waiting sequences need once, in the order they need them (theirs in arrival
    order), so that the oldest, admitted first, are ready first (the faster order in a cold run,
    docs/benchmarks.md)."""
    needed: dict[str, ChunkInfo] = {}
    for chunks in needs:
        for c in chunks:
            needed.setdefault(c.chunk_id, c)
    return list(needed.values())


@dataclass
class StepCounts:
    """How many steps ran and how many sequences they held (prefill and decode apart)."""

    prefills: int = 0
    prefilled: int = 0
    decodes: int = 0
    decoded: int = 0

    def add(self, step: "Step") -> "Step":
        if step.prefill:
            self.prefills, self.prefilled = self.prefills + 1, self.prefilled + len(step.batch)
        else:
            self.decodes, self.decoded = self.decodes + 1, self.decoded + len(step.batch)
        return step


@dataclass
class Step:
    batch: list[Sequence]
    prefill: bool  # newly admitted: feed their prompts; otherwise one token each


class Scheduler:
    def __init__(self, mode: ServingMode, cache: ChunkCache, batch_size: int,
                 sequences: Iterable[Sequence | None], lookahead: int | None = None, on_error: OnError | None = None,
                 steps: StepCounts | None = None):
        """sequences: in arrival order; None from it means nothing has arrived yet (an open stream).
        on_error(seq, exc): a sequence that failed alone (one of its chunks cannot be read, out of
        memory: lazyrag/serve/faults.py), after everything its placement took has been given
        back; None re-raises the error. steps: counts the steps scheduled (and the decode steps
        the engine runs on without asking, through `decodes_next`). lookahead: waiting sequences
        whose chunks are read ahead (None: the batch size, at least LOOKAHEAD)."""
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        self.mode, self.cache, self.batch_size = mode, cache, batch_size
        self.lookahead = lookahead or max(LOOKAHEAD, batch_size)
        self.on_error = on_error
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._source = iter(sequences)
        self._exhausted = False
        self._alone: set[int] = set()  # id() of sequences to admit in a prefill step of their own
        self.steps = steps if steps is not None else StepCounts()
        self._read_for: tuple[Sequence, ...] = ()  # the waiting sequences `_reads` was ordered for
        self._reads: list[ChunkInfo] = []

    def schedule(self) -> Step | None:
        """The next step, or None once the source is exhausted and every sequence has finished.
        While nothing can run before the next arrival (an open-loop workload), it sleeps until
        then; while an open stream has nothing yet, or every arrived sequence waits for reads ahead, it
        looks again every IDLE_POLL_S."""
        while True:
            stream_idle = self._read_ahead()
            admitted = self._admit(time.perf_counter())
            if admitted:
                return self.steps.add(Step(admitted, prefill=True))
            if self.running:
                return self.steps.add(Step(list(self.running), prefill=False))
            if not self.waiting:
                if self._exhausted:
                    return None
                if stream_idle:
                    time.sleep(IDLE_POLL_S)
                continue  # take what arrived since, or the next ones when every waiting sequence failed
            until_arrival = self.waiting[0].arrival - time.perf_counter()
            time.sleep(until_arrival if until_arrival > 0 else IDLE_POLL_S)  # or for reads ahead

    def decodes_next(self, batch: list[Sequence], pending: int) -> bool:
        """Whether the step after `batch`'s is certainly a decode of the same batch, known before
        its last `pending` sampled tokens are read: it is every running sequence, none ends by
        length with those tokens, and nobody could be admitted (the batch is full or nobody
        waits). A stop token among them is seen only later. Reads ahead as schedule does."""
        self._read_ahead()
        again = (len(batch) == len(self.running) and all(a is b for a, b in zip(batch, self.running))
                 and all(not seq.finished and len(seq.generated) + pending < seq.max_new_tokens for seq in batch)
                 and (len(self.running) >= self.batch_size or not self.waiting))
        if again:
            self.steps.add(Step(batch, prefill=False))
        return again

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

    def retry_alone(self, seqs: list[Sequence]) -> None:
        """Sequences whose batch failed (their placements given back): out of the batch, to the
        front of the queue in their order, each to be prefilled alone."""
        self._leave(seqs)
        self._alone.update(id(seq) for seq in seqs)
        self.waiting.extendleft(reversed(seqs))

    def fail(self, seq: Sequence, exc: Exception) -> None:
        """A sequence that failed alone (its placement given back) leaves for `on_error`."""
        self._leave([seq])
        self.on_error(seq, exc)

    def _leave(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq in self.running:
                self.running.remove(seq)
            self._alone.discard(id(seq))

    def _read_ahead(self) -> bool:
        """Take arrived sequences and start reading the chunks they need, in need order;
        True when the source said nothing has arrived yet."""
        stream_idle = self._refill()
        waiting = tuple(self.waiting)
        if len(waiting) != len(self._read_for) or any(a is not b for a, b in zip(waiting, self._read_for)):
            # ordered again only when the waiting sequences changed: not at each decode step
            self._read_for = waiting
            self._reads = read_order(self.mode.cached_chunks(seq.request) for seq in waiting)
        self.cache.prefetch(self._reads)
        return stream_idle

    def _refill(self) -> bool:
        """Take arrived sequences up to the lookahead; True when the source said nothing has arrived yet."""
        while not self._exhausted and len(self.waiting) < self.lookahead:
            try:
                nxt = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            if nxt is None:
                return True
            self.waiting.append(nxt)
        return False

    def _admit(self, now: float) -> list[Sequence]:
        admitted, failed = [], []
        passed = 0  # waiting sequences left in place, ahead of the one considered, for their reads
        while (len(self.waiting) > passed and len(self.running) + len(admitted) < self.batch_size
               and self.waiting[passed].arrival <= now):
            seq = self.waiting[passed]
            alone = id(seq) in self._alone
            if alone and (admitted or passed):
                break  # it takes the next prefill step by itself
            if not self.fits(seq):
                if self.running or admitted or passed:
                    break  # wait for running sequences to free pages, or for the oldest to go first
                exc = OutOfPages(f"request {seq.id} does not fit in the cache even alone: raise --cache-gb")
                if self.on_error is None:
                    raise exc
                self.waiting.popleft()
                failed.append((seq, exc))
                continue
            waits = self._still_reading(seq) if not passed else not self._resident(seq)
            if waits:
                # it waits for its chunks, and one behind it whose chunks are all here goes first
                # (only then: it must not read on the step loop)
                passed += 1
                continue
            del self.waiting[passed]
            held = _Held(self.cache)
            try:
                seq.placement = self.mode.place(seq, held)
            except BaseException as exc:
                held.give_back()
                if not (faults.concerns_request(exc) and self.on_error is not None):
                    raise
                failed.append((seq, exc))
                continue
            admitted.append(seq)
            if alone:
                self._alone.discard(id(seq))  # failing now, it fails alone: the engine fails it
                break
        self.running.extend(admitted)
        for seq, exc in failed:  # once the batch is consistent, in case the callback raises
            self._alone.discard(id(seq))
            self.on_error(seq, exc)
        return admitted

    def _resident(self, seq: Sequence) -> bool:
        return all(self.cache.is_resident(c.chunk_id) for c in self.mode.cached_chunks(seq.request))

    def _still_reading(self, seq: Sequence) -> bool:
        return any(self.cache.is_loading(c.chunk_id) for c in self.mode.cached_chunks(seq.request))


class _Held:
    """The cache as one placement sees it, noting the pins and pages it takes, so a placement
    that fails part way can give them all back."""

    def __init__(self, cache: ChunkCache):
        self.cache = cache
        self.pins: list[Resident | Recomputed] = []
        self.pages: list[int] = []
        self.created: list[Recomputed] = []  # recomputed pages this placement will compute

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

    @property
    def counters(self):
        return self.cache.counters

    def find_recomputed(self, context: str, value: Callable[[tuple[int, ...]], float | None]) -> Recomputed | None:
        entry = self.cache.find_recomputed(context, value)
        if entry is not None:
            self.pins.append(entry)
        return entry

    def keep_recomputed(self, context: str, selection: tuple[int, ...], pages: list[int], tokens: int) -> Recomputed:
        entry = self.cache.keep_recomputed(context, selection, pages, tokens)
        gone = set(pages)  # the cache owns them now
        self.pages = [p for p in self.pages if p not in gone]
        self.pins.append(entry)
        return entry

    def free(self, pages: list[int]) -> None:
        self.cache.free(pages)
        gone = set(pages)
        self.pages = [p for p in self.pages if p not in gone]

    def give_back(self) -> None:
        for entry in self.pins:
            self.cache.release(entry)
        for entry in self.created:  # never computed: no later request may read them
            self.cache.drop_recomputed(entry)
        self.cache.free(self.pages)
        self.pins, self.pages, self.created = [], [], []
