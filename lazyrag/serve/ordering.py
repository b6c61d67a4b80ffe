"""The order of a request's chunks in its prompt, chosen so that recomputed pages are reused.

Recomputed pages are reused by a later request only where its prompt starts with the same
chunks (lazyrag/serve/recompute.py). Queries that share popular documents seldom list them in
the same order, so `popular` puts each request's documents in one order shared by the whole
run: most used first (counted over all the run's requests), the given order among equals. A
document's chunks stay together and in their own order; a request whose documents are all
equally popular keeps the order it was given.

  given    the order the query gave (its docs, chunks or retrieval ranks)
  popular  most popular documents first, ties in the given order

`shared_prefixes` counts, for each prompt, the leading chunks that enough of the run's prompts
start with for recompute to take them whole (lazyrag/serve/recompute.py).
"""

from __future__ import annotations

from collections import Counter
from itertools import takewhile
from typing import Iterable

from lazyrag.store import ChunkInfo


def documents(chunks: list[ChunkInfo]) -> list[tuple[ChunkInfo, ...]]:
    """The chunks as runs of one document each (consecutive chunks of the same document)."""
    runs: list[list[ChunkInfo]] = []
    for c in chunks:
        if runs and runs[-1][-1].doc_id == c.doc_id:
            runs[-1].append(c)
        else:
            runs.append([c])
    return [tuple(r) for r in runs]


def _key(run: tuple[ChunkInfo, ...]) -> tuple[str, ...]:
    return tuple(c.chunk_id for c in run)


class PopularFirst:
    """Orders each request's documents by how many of the run's requests use them."""

    def __init__(self, chunk_lists: Iterable[list[ChunkInfo]]):
        self.uses = Counter(_key(run) for chunks in chunk_lists for run in set(documents(chunks)))

    def order(self, chunks: list[ChunkInfo]) -> list[ChunkInfo]:
        runs = documents(chunks)
        ranked = sorted(range(len(runs)), key=lambda i: -self.uses[_key(runs[i])])  # stable: ties keep given order
        return [c for i in ranked for c in runs[i]]


def shared_prefixes(prompts: list[list[ChunkInfo]], uses: int | None) -> list[int]:
    """For each prompt (its chunks in prompt order), how many of its leading chunks form a run
    that at least `uses` of the prompts start with (0 for every prompt when uses is None)."""
    if uses is None:
        return [0] * len(prompts)
    counts = Counter(prefix for chunks in prompts for prefix in _prefixes(chunks))
    return [sum(1 for _ in takewhile(lambda prefix: counts[prefix] >= uses, _prefixes(chunks)))
            for chunks in prompts]


def _prefixes(chunks: list[ChunkInfo]) -> Iterable[tuple[str, ...]]:
    return (tuple(c.chunk_id for c in chunks[: i + 1]) for i in range(len(chunks)))
