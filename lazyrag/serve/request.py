"""A request as a caller submits it, and the engine's state for it while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lazyrag.serve.cache import ChunkCache, Recomputed, Resident
from lazyrag.serve.paged import Feed
from lazyrag.store import ChunkInfo


@dataclass
class Request:
    """What a caller submits: the chunks to read, the question, how long the answer may be."""

    id: str
    chunks: list[ChunkInfo]
    question_ids: list[int]
    max_new_tokens: int
    arrival: float = 0.0                              # perf_counter time the request became available
    meta: dict = field(default_factory=dict)          # the caller's own data, handed back when it finishes
    # leading chunks that enough of the run's prompts start with for recompute to take them whole
    # (lazyrag/serve/ordering.py, shared_prefixes)
    shared_prefix: int = 0


@dataclass
class Placement:
    """Where a placed request's KV lives, and the pool resources it holds until it finishes.

    rows are its page rows (lazyrag/serve/paged.py): its context (preamble and chunks)
    first, then the pages of its own tokens (prompt and answer)."""

    rows: np.ndarray
    n_context: int                                    # rows before its own tokens
    own_start: int                                    # logical position of its first own token
    prompt_ids: list[int]                             # its own prompt tokens, fed at prefill
    pins: list[Resident] = field(default_factory=list)      # shared chunks it reads in place
    own_pages: list[int] = field(default_factory=list)      # its prompt and answer tokens
    private_pages: list[int] = field(default_factory=list)  # only it reads them: block's copies, recomputed pages
    recompute: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, chunk tokens) to recompute
    n_preamble: int = 0                               # rows of the shared preamble (context rows before the chunks)
    chunk_rows: list[int] = field(default_factory=list)  # rows of each chunk, in prompt order, after the preamble's
    spare: list[int] = field(default_factory=list)       # private pages not yet given a recomputed chunk page
    recomputed: list[Recomputed] = field(default_factory=list)  # cached recomputed pages it reads or computes
    created: list[Recomputed] = field(default_factory=list)     # those of them its prefill computes
    shared: np.ndarray | None = None                  # per row: the label of the shared page sequence it reads, 0 if
                                                      # only this request reads it (Feed.shared); None in other modes

    def release(self, cache: ChunkCache) -> None:
        for entry in self.pins + self.recomputed:
            cache.release(entry)
        cache.free(self.own_pages + self.private_pages)
        self.pins, self.own_pages, self.private_pages, self.recomputed, self.created = [], [], [], [], []

    def forget_created(self, cache: ChunkCache) -> None:
        """Its prefill did not run: the recomputed pages it was to compute hold nothing, so no
        later request may find them."""
        for entry in self.created:
            self.recomputed.remove(entry)
            cache.drop_recomputed(entry)
        self.created = []


@dataclass
class Sequence:
    """A request inside the engine: its answer so far, its timings and cache hits, and where
    its KV is. The engine hands it to `on_finish`, so it reads like the request it wraps."""

    request: Request
    max_new_tokens: int | None = None                 # the request's, unless teacher forcing sets it
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    hits: int = 0
    misses: int = 0
    placement: Placement | None = None
    fed: int = 0                                      # own tokens whose K/V are in the pool

    def __post_init__(self):
        if self.max_new_tokens is None:
            self.max_new_tokens = self.request.max_new_tokens

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def chunks(self) -> list[ChunkInfo]:
        return self.request.chunks

    @property
    def question_ids(self) -> list[int]:
        return self.request.question_ids

    @property
    def arrival(self) -> float:
        return self.request.arrival

    @property
    def meta(self) -> dict:
        return self.request.meta

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_at - self.arrival) * 1e3

    @property
    def latency_ms(self) -> float:
        return (self.finished_at - self.arrival) * 1e3

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def feed(self, tokens: list[int]) -> Feed:
        """The step input that feeds `tokens` after the own tokens already in the pool; its
        chunk rows (after the preamble's, before its own) are its APE rows."""
        p = self.placement
        return Feed(p.rows, p.n_context, p.own_start, self.fed, tokens, ape_rows=(p.n_preamble, p.n_context),
                    shared=p.shared)

    def accept(self, token: int, now: float, stop_ids: set[int]) -> None:
        """Take the token sampled for it; a stop token ends the answer without joining it."""
        if self.first_token_at is None:
            self.first_token_at = now
        if token in stop_ids:
            self.finished_at = now
            return
        self.generated.append(token)
        if len(self.generated) >= self.max_new_tokens:
            self.finished_at = now
