"""Selective recompute: which of a request's shared chunk pages it recomputes privately.

A chunk's stored KV was computed with the chunk attending only to the preamble and itself; in
a prompt it follows other chunks, and `full` attention would have let it see them. Recomputing
a page for one request (every layer, attending to everything before it in that prompt) gives
that page the KV `full` would have, in a request-private page; the shared page stays as it is
for everyone else. The first chunk needs none: it already follows only the preamble.

The candidates are every page of every chunk after the first, taken in `head` order: page 0
of each chunk, then page 1, and so on, since a chunk's first tokens are the ones that lack an
attention sink and context most (EPIC, MEPIC). Other policies (the question's attention per page, CacheBlend's KV
deviation) would rank the same candidates differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """How much of each request's chunk pages to recompute: 0 none, 1 every page after the
    first chunk (which reproduces `full`)."""

    fraction: float = 0.0


def pages_to_recompute(fraction: float, chunk_pages: list[int]) -> int:
    """ceil(fraction x the pages of the chunks after the first)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the recompute fraction must be in [0, 1], got {fraction}")
    return math.ceil(fraction * sum(chunk_pages[1:]) - 1e-9)


def head_order(chunk_pages: list[int]) -> list[tuple[int, int]]:
    """(chunk, page) candidates in `head` order: page 0 of chunks 1.., then page 1, ..."""
    longest = max(chunk_pages[1:], default=0)
    return [(c, p) for p in range(longest) for c in range(1, len(chunk_pages)) if p < chunk_pages[c]]


def choose(fraction: float, chunk_pages: list[int]) -> list[tuple[int, int]]:
    """The (chunk, page) pairs to recompute, in prompt order (a page attends to those before it)."""
    return sorted(head_order(chunk_pages)[: pages_to_recompute(fraction, chunk_pages)])
