"""Selective recompute: which of a request's shared chunk pages it recomputes privately.

A chunk's stored KV was computed with the chunk attending only to the preamble and itself; in
a prompt it follows other chunks, and `full` attention would have let it see them. Recomputing
a page for one request (every layer, attending to everything before it in that prompt) gives
that page the KV `full` would have, in a request-private page; the shared page stays as it is
for everyone else. The first chunk needs none: it already follows only the preamble.

The candidates are every page of every chunk after the first. Policies rank them:
  head       page 0 of each chunk, then page 1, and so on: a chunk's first tokens are the ones
             that lack an attention sink and context most (EPIC, MEPIC).
  attention  by the attention the question's tokens pay each page at one layer, measured in a
             first pass over that many layers (InfoFlow-style): recompute where the question looks.

Reuse. A recomputed page's KV depends on everything before it in the prompt: the preamble, the
chunks before it and which of their pages were recomputed. So the pages recomputed for a chunk
are kept in the chunk cache under that context (`chain_root`, `context_key`, `chained`) and the
pages chosen, and a later request whose prompt starts with the same chunks may read them as they
are, bit for bit what recomputing that choice gives. Every request still makes its own choice
(the pages its question attends to most), and that choice is the bar (`Coverage`): walking its
chunks in order, it takes a cached choice where the pages it reads recomputed so far hold at
least the attention its own choice holds there, and where it must compute, the attention it
holds beyond its own choice pays for its least attended pages. So a request reads recomputed
at least its own choice's share of its question's attention, and computes only what the cache
does not already cover. Where at least 1/F of a run's prompts start with the same chunks
(`Recompute.whole_prefix_uses`, counted by lazyrag/serve/ordering.py), the first of them
recomputes those chunks whole and the others read them: once costs less than each prompt's own
F of them, and it covers every choice.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum

import torch


DEFAULT_LAYER = 2  # early enough to be cheap; the question already attends by content there


class Policy(str, Enum):
    HEAD = "head"
    ATTENTION = "attention"


@dataclass(frozen=True)
class Recompute:
    """How much of each request's chunk pages to recompute: 0 none, 1 every page after the
    first chunk (which reproduces `full`)."""

    fraction: float = 0.0
    policy: Policy = Policy.HEAD
    layer: int | None = None  # the layer whose attention ranks pages (policy `attention`); None: DEFAULT_LAYER
    reuse: bool = True        # keep recomputed pages in the cache for later requests with the same leading chunks

    def __post_init__(self):
        object.__setattr__(self, "policy", Policy(self.policy))
        pages_to_recompute(self.fraction, [])  # range check
        if self.layer is not None and self.layer < 0:
            raise ValueError(f"the recompute layer must be >= 0, got {self.layer}")

    @classmethod
    def of(cls, cfg) -> Recompute:
        """The recompute of answer settings (lazyrag.config.AnswerConfig)."""
        return cls(cfg.recompute, cfg.recompute_policy, cfg.recompute_layer, cfg.recompute_reuse)

    def ranking_layer(self, num_layers: int) -> int:
        """The layer that ranks pages in a model of num_layers: the one asked for (an error past
        the last), else DEFAULT_LAYER or the last layer of a shallower model."""
        if self.layer is None:
            return min(DEFAULT_LAYER, num_layers - 1)
        if self.layer >= num_layers:
            raise ValueError(f"--recompute-layer {self.layer} is past the model's last layer ({num_layers - 1})")
        return self.layer

    @property
    def whole_prefix_uses(self) -> int | None:
        """How many of a run's prompts must start with the same chunks for those chunks to be
        recomputed whole, once for all of them: 1/F, where that costs no more than each
        prompt's own F of their pages. None without reuse."""
        return math.ceil(1 / self.fraction - 1e-9) if self.reuse and self.fraction > 0 else None

    @property
    def needs_scores(self) -> bool:
        return self.fraction > 0 and self.policy is Policy.ATTENTION


def pages_to_recompute(fraction: float, chunk_pages: list[int]) -> int:
    """ceil(fraction x the pages of the chunks after the first)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the recompute fraction must be in [0, 1], got {fraction}")
    return math.ceil(fraction * sum(chunk_pages[1:]) - 1e-9)


def head_order(chunk_pages: list[int]) -> list[tuple[int, int]]:
    """(chunk, page) candidates in `head` order: page 0 of chunks 1.., then page 1, ..."""
    longest = max(chunk_pages[1:], default=0)
    return [(c, p) for p in range(longest) for c in range(1, len(chunk_pages)) if p < chunk_pages[c]]


def choose(recompute: Recompute, chunk_pages: list[int], page_scores: list[torch.Tensor] | None = None,
           start: int = 1, count: int | None = None) -> list[tuple[int, int]]:
    """The (chunk, page) pairs to recompute, in prompt order (a page attends to those before it).
    page_scores[c][p]: the attention mass of page p of chunk c (policy `attention`). Candidates
    are the pages of chunks `start`.. (those before it took a cached choice); count: how many
    (default: the fraction's share of the request's pages)."""
    candidates = [cp for cp in head_order(chunk_pages) if cp[0] >= start]
    n = pages_to_recompute(recompute.fraction, chunk_pages) if count is None else count
    if not n or not candidates:
        return []
    if recompute.policy is Policy.ATTENTION:
        if page_scores is None:
            raise ValueError("the attention policy needs the question's attention per page")
        candidates.sort(key=lambda cp: -float(page_scores[cp[0]][cp[1]]))  # stable: ties keep head order
    return sorted(candidates[:n])


class Coverage:
    """What a request's recompute must cover as it walks its chunks, reusing where it can.

    Its own choice (`choose`) is the bar: with the `attention` policy, the pages it reads
    recomputed must hold at least the attention its own choice holds, counted chunk by chunk
    from the first, so that what its question attends to in shared pages never exceeds what it
    would without reuse. `surplus` is how much more the pages taken so far hold than its own
    choice there. A cached choice is usable where it keeps the surplus at or above zero; where
    the request computes, the surplus pays for its least attended pages (lowest first, over the
    chunks still ahead). With `head` (no attention), a cached choice must hold every page of
    its own choice in that chunk, and it computes its own choice."""

    def __init__(self, own: list[tuple[int, ...]], page_scores: list[torch.Tensor] | None):
        self.own = own
        self.scores = None if page_scores is None else [s.float().tolist() for s in page_scores]
        self.surplus = 0.0

    def mass(self, c: int, pages) -> float:
        return sum(self.scores[c][q] for q in pages)

    def value(self, c: int):
        """Rates a cached selection of chunk c: None where taking it would leave the request less
        than its own choice, else the attention it holds (more is better)."""
        own = set(self.own[c])
        if self.scores is None:
            return lambda selection: 0.0 if own <= set(selection) else None
        need = self.mass(c, own) - self.surplus
        return lambda selection: m if (m := self.mass(c, selection)) >= need - 1e-9 else None

    def to_compute(self, c: int) -> tuple[int, ...]:
        """The pages of chunk c the request recomputes where no cached choice will do: its own,
        less those the surplus covers."""
        if self.scores is None or self.surplus <= 0:
            return self.own[c]
        ahead = sorted((self.scores[cc][q], cc, q) for cc in range(c, len(self.own)) for q in self.own[cc])
        left, covered = self.surplus, set()
        for score, cc, q in ahead:
            if score > left:
                break
            left -= score
            if cc == c:
                covered.add(q)
        return tuple(q for q in self.own[c] if q not in covered)

    def took(self, c: int, selection: tuple[int, ...]) -> None:
        """The request reads `selection` of chunk c recomputed."""
        if self.scores is not None:
            self.surplus += self.mass(c, selection) - self.mass(c, self.own[c])


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def chain_root(namespace: str, first_chunk: str) -> str:
    """The state after a prompt's first chunk (never recomputed: it follows only the preamble);
    namespace names the store, its preamble and page size."""
    return _digest(f"{namespace}|{first_chunk}")


def context_key(state: str, chunk_id: str) -> str:
    """The cache key of the pages recomputed for `chunk_id` after the prompt state `state`."""
    return "recomputed:" + _digest(f"{state}|{chunk_id}")


def chained(context: str, selection: tuple[int, ...]) -> str:
    """The state after a chunk whose pages `selection` were recomputed (under key `context`)."""
    return _digest(f"{context}|{','.join(map(str, selection))}")
