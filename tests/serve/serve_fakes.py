"""Model-free pieces for the serving tests: chunks that exist only as catalog rows, a loader
that records what the cache asks of it, and a small CPU page pool."""

from __future__ import annotations

import dataclasses

import torch

from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import LoadReport
from lazyrag.serve.paged import PagePool, pages_for
from lazyrag.serve.request import Request, Sequence
from lazyrag.store import ChunkInfo

PAGE_SIZE = 4
PREAMBLE = [1, 2, 3]  # P = 3: one page


def chunk(chunk_id: str, length: int) -> ChunkInfo:
    """A chunk of `length` tokens (ids 100..), stored padded to whole pages."""
    tokens = tuple(range(100, 100 + length))
    return ChunkInfo(chunk_id, f"doc-{chunk_id}", 0, tokens, "", "seg", 0, length,
                     pages_for(length, PAGE_SIZE) * PAGE_SIZE)


class FakeLoader:
    """Moves no bytes: records each load and prefetch, fails the loads it is told to, says the
    chunks in `in_flight` are still being read, those in `in_line` wait their turn behind them and
    those in `done` were read ahead (until loaded), and
    records the copies compute was ordered after and those waited for."""

    def __init__(self):
        self.loads: list[tuple[str, list[int]]] = []
        self.prefetched: list[str] = []
        self.failing: set[str] = set()
        self.in_flight: set[str] = set()
        self.in_line: set[str] = set()
        self.done: list[ChunkInfo] = []
        self.ordered_after: list[object] = []
        self.settled: list[object] = []
        self.report = LoadReport(bytes_read=10, bytes_to_gpu=10)
        self.closed = False

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        self.prefetched += [info.chunk_id for info in infos]

    def reading(self, chunk_id: str) -> bool:
        return chunk_id in self.in_flight

    def queued(self, chunk_id: str) -> bool:
        return chunk_id in self.in_line and bool(self.in_flight)

    def finished(self) -> list[ChunkInfo]:
        return list(self.done)

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport:
        self.done = [d for d in self.done if d.chunk_id != info.chunk_id]
        if info.chunk_id in self.failing:
            raise OSError(f"cannot read {info.chunk_id}")
        self.loads.append((info.chunk_id, list(pages)))
        return dataclasses.replace(self.report, copied=f"copy of {info.chunk_id}")

    def after_copy(self, copied) -> None:
        if copied is not None:
            self.ordered_after.append(copied)

    def settle(self, copied) -> None:
        if copied is not None:
            self.settled.append(copied)

    def close(self) -> None:
        self.closed = True


def make_cache(num_pages: int) -> tuple[ChunkCache, FakeLoader]:
    pool = PagePool(1, 1, 2, num_pages, PAGE_SIZE, torch.float32, torch.device("cpu"))
    loader = FakeLoader()
    return ChunkCache(pool, loader), loader


def sequence(rid: str, chunks: list[ChunkInfo], question: list[int], max_new_tokens: int,
             arrival: float = 0.0) -> Sequence:
    return Sequence(Request(rid, chunks, question, max_new_tokens, arrival=arrival))
