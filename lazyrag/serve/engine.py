"""Batch answering: continuous batching over the paged pool, in three modes.

  lazy   chunk pages are shared by every request that uses them; the kernels rotate
         each query by (its position - the chunk's shift). Zero copies.
  block  Block-Attention: each request gets its own copy of its chunks, keys
         re-rotated to their logical positions (fused rotate_copy), then ordinary
         attention. The copies take pool pages, as they would in a deployment.
  full   the whole prompt is recomputed with ordinary causal attention: the quality
         reference and the no-cache baseline.

All three build the same token ids: [preamble][chunk]...[chunk][question], and the
same logical positions. The scheduler admits requests while pages are free, prefills
the newly admitted ones together, then decodes every running request one token per
step; a request leaves as soon as it ends, and the next one takes its place. On a GPU
the decode step is replayed from a CUDA graph (lazyrag/cuda_graphs.py); prefill runs
eagerly, its lengths vary too much to capture.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from lazyrag import kernels
from lazyrag.serve.cache import ChunkCache, Resident
from lazyrag.config import MODES
from lazyrag.models import LoadedModel
from lazyrag.serve.cuda_graphs import DecodeGraphs
from lazyrag.serve.paged import Feed, OutOfPages, PagedAttention, PagePool, StepInputs, page_rows
from lazyrag.store import ChunkInfo, Store

@dataclass
class Request:
    id: str
    chunks: list[ChunkInfo]
    question_ids: list[int]
    max_new_tokens: int
    arrival: float = 0.0            # perf_counter time the request became available
    meta: dict = field(default_factory=dict)
    # filled by the engine
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    hits: int = 0
    misses: int = 0
    _entries: list[Resident] = field(default_factory=list)
    _own_pages: list[int] = field(default_factory=list)      # prompt (question) and answer tokens
    _copy_pages: list[int] = field(default_factory=list)     # block mode's private chunk copies
    _rows: np.ndarray | None = None                          # page rows: context, then its own pages
    _n_context: int = 0                                       # rows before its own tokens
    _own_start: int = 0                                       # logical position of its first own token
    _fed: int = 0                                             # own tokens whose K/V are in the pool

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_at - self.arrival) * 1e3

    @property
    def latency_ms(self) -> float:
        return (self.finished_at - self.arrival) * 1e3


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class Engine:
    def __init__(self, loaded: LoadedModel, store: Store, mode: str, cache_bytes: float, batch_size: int,
                 sampling: Sampling = Sampling(), host_cache_bytes: float = 0, stop_at_eos: bool = True,
                 cuda_graphs: bool = True):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        s = store.settings
        self.loaded, self.store, self.mode, self.batch_size, self.sampling = loaded, store, mode, batch_size, sampling
        self.device = loaded.device
        self.pool = PagePool.for_bytes(cache_bytes, s.num_layers, s.num_kv_heads, s.head_dim, s.page_size,
                                       loaded.dtype, loaded.device)
        self.cache = ChunkCache(store, self.pool, host_cache_bytes)
        self.page_size = s.page_size
        self.preamble_ids = list(s.preamble_ids)
        self.P = len(self.preamble_ids)
        self.sm_scale = loaded.cfg.head_dim ** -0.5
        self.vocab = len(loaded.tokenizer)
        self.eos = loaded.eos_ids if stop_at_eos else set()  # benchmarks fix the answer length
        self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.preamble = page_rows([], 0, 0, 0, self.page_size)
        if mode != "full":  # one shared copy of the preamble, at positions 0..P-1, never evicted
            pages = self.cache.alloc(self.pool.pages_for(self.P))
            self.preamble = page_rows(pages, 0, self.P, 0, self.page_size)
            self._forward([Feed(self.preamble, 0, 0, 0, self.preamble_ids)], lazy=False)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            pad_slot = self.cache.alloc(1)[0] * self.page_size  # padding rows' K/V land here
            max_pages = min(self.pool.num_pages, self.pool.pages_for(loaded.cfg.max_position_embeddings))
            self.graphs = DecodeGraphs(loaded.model, self.pool, loaded.model.inv_freq, self.sm_scale,
                                       mode == "lazy", batch_size, max_pages, pad_slot)

    # -- the loop -------------------------------------------------------------------
    def run(self, requests: Iterable[Request], on_finish: Callable[[Request], None],
            lookahead: int = 64) -> None:
        """Answer every request; `on_finish` is called as each one ends (finishing order)."""
        source: Iterator[Request] = iter(requests)
        waiting: deque[Request] = deque()
        running: list[Request] = []
        exhausted = False
        while True:
            while not exhausted and len(waiting) < lookahead:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                else:
                    waiting.append(nxt)
            if self.mode != "full":
                for r in list(waiting)[: lookahead]:
                    self.cache.prefetch(r.chunks)
            admitted = self._admit(waiting, running)
            if not admitted and not running and waiting and waiting[0].arrival > time.perf_counter():
                time.sleep(max(0.0, waiting[0].arrival - time.perf_counter()))  # open loop: idle till the next
                continue
            if admitted:
                self._accept(admitted, self._prefill(admitted))
                running.extend(admitted)
            elif running:
                self._accept(running, self._decode(running))
            elif waiting:
                raise OutOfPages("the cache cannot hold a single request: raise --cache-gb")
            else:
                break
            for r in [r for r in running if r.finished_at is not None]:
                running.remove(r)
                self._free(r)
                on_finish(r)

    def _admit(self, waiting: deque, running: list) -> list[Request]:
        admitted = []
        now = time.perf_counter()
        while waiting and len(running) + len(admitted) < self.batch_size and waiting[0].arrival <= now:
            r = waiting[0]
            if not self._fits(r):
                if running or admitted:
                    break  # wait for running requests to free pages
                raise OutOfPages(f"request {r.id} does not fit in the cache even alone: raise --cache-gb")
            self._place(r)
            waiting.popleft()
            admitted.append(r)
        return admitted

    def _fits(self, r: Request) -> bool:
        """Whether the pool can take the request now (counting pages LRU eviction could free)."""
        pages = self.pool.pages_for
        own = self._own_len(r)
        needed = pages(own)
        wanted = {c.chunk_id for c in r.chunks} if self.mode != "full" else set()
        for info in (r.chunks if self.mode != "full" else []):
            if info.chunk_id not in self.cache.resident:
                needed += pages(info.padded_length)
            if self.mode == "block":
                needed += pages(info.padded_length)
        return needed <= len(self.pool.free_pages) + self.cache.evictable_pages(exclude=wanted)

    def _own_len(self, r: Request) -> int:
        own = len(r.question_ids) + r.max_new_tokens
        if self.mode == "full":
            own += self.P + sum(c.length for c in r.chunks)
        return own

    def _place(self, r: Request) -> None:
        """Pin or copy the request's chunks and give it pages for its own tokens."""
        ps, pos, context = self.page_size, self.P, [self.preamble]
        copies: list[tuple[list[int], list[int], int]] = []
        chunks = r.chunks if self.mode != "full" else []
        # pin the resident chunks first, so loading the others cannot evict them
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].chunk_id not in self.cache.resident)
        entries: list[Resident | None] = [None] * len(chunks)
        for i in order:
            hit = chunks[i].chunk_id in self.cache.resident
            entries[i] = self.cache.acquire(chunks[i])
            r.hits, r.misses = r.hits + hit, r.misses + (not hit)
        r._entries = list(entries)
        for info, entry in zip(chunks, entries):
            delta = pos - self.P  # the chunk was encoded at P.., it now starts at pos
            if self.mode == "lazy":
                context.append(page_rows(entry.pages, self.P, info.length, delta, ps))
            else:  # block: a private copy whose keys sit at their logical positions
                dst = self.cache.alloc(len(entry.pages))
                r._copy_pages += dst
                copies.append((entry.pages, dst, delta))
                context.append(page_rows(dst, pos, info.length, 0, ps))
            pos += info.length
        if self.mode == "full":
            pos = 0
        r._own_pages = self.cache.alloc(self.pool.pages_for(self._own_len(r)))
        own = page_rows(r._own_pages, pos, len(r._own_pages) * ps, 0, ps)  # whole pages: see paged.Feed
        r._rows, r._n_context, r._own_start = np.concatenate(context + [own]), sum(map(len, context)), pos
        if copies:
            self._rotate_copy(copies)
            for e in r._entries:  # the copy is all the request needs now
                self.cache.release(e)
            r._entries = []

    def _rotate_copy(self, copies) -> None:
        """Every layer's pages of every chunk in one fused launch."""
        src = torch.tensor([p for s, _, _ in copies for p in s], dtype=torch.int32)
        dst = torch.tensor([p for _, d, _ in copies for p in d], dtype=torch.int32)
        delta = torch.tensor([dl for s, _, dl in copies for _ in s], dtype=torch.int32)
        layer_base = (torch.arange(self.pool.num_layers, dtype=torch.int32) * self.pool.num_pages)[:, None]
        k_pages, v_pages = self.pool.all_layers()
        kernels.rotate_copy(k_pages, v_pages, (layer_base + src).flatten().to(self.device),
                            (layer_base + dst).flatten().to(self.device),
                            delta.repeat(self.pool.num_layers).to(self.device), self.loaded.model.inv_freq)

    def _feed(self, r: Request, tokens: list[int]) -> Feed:
        return Feed(r._rows, r._n_context, r._own_start, r._fed, tokens)

    def _prompt_own_ids(self, r: Request) -> list[int]:
        if self.mode == "full":
            return self.preamble_ids + [t for c in r.chunks for t in c.token_ids] + r.question_ids
        return r.question_ids

    def _prefill(self, batch: list[Request]) -> torch.Tensor:
        """Feed the placed requests' prompt tokens; the logits of each one's last token."""
        feeds = [self._feed(r, self._prompt_own_ids(r)) for r in batch]
        logits = self._forward(feeds, lazy=self.mode == "lazy")
        for r, f in zip(batch, feeds):
            r._fed = len(f.tokens)
        return logits

    def _decode(self, running: list[Request]) -> torch.Tensor:
        feeds = [self._feed(r, [r.generated[-1]]) for r in running]
        logits = self.graphs.run(feeds) if self.graphs else None
        if logits is None:
            logits = self._forward(feeds, lazy=self.mode == "lazy")
        else:
            logits = logits[:, : self.vocab]  # the graph computes the model's padded vocabulary
        for r in running:
            r._fed += 1
        return logits

    def _forward(self, feeds: list[Feed], lazy: bool, select: torch.Tensor | None = None) -> torch.Tensor:
        """One eager step. Returns the logits of each feed's last token, or of the packed token
        indices in `select`."""
        step = StepInputs.upload(feeds, self.page_size, self.device)
        attention = PagedAttention(self.pool, step, self.loaded.model.inv_freq, self.sm_scale, lazy)
        hidden = self.loaded.model(step.tokens, step.positions, attention)
        rows = step.cu_seqlens[1:] - 1 if select is None else select.to(self.device)
        return self.loaded.model.logits(hidden[rows])[:, : self.vocab]

    def continuation_logprobs(self, requests: list[Request], continuations: list[list[int]]) -> list[float]:
        """Mean log-probability per token of each continuation after its request's prompt, by
        teacher forcing (more sensitive than accuracy for a small model)."""
        out = []
        todo = list(zip(requests, continuations))
        while todo:
            batch, conts = [], []
            for r, cont in todo[: self.batch_size]:
                r.max_new_tokens = len(cont)
                if not self._fits(r):
                    break
                self._place(r)
                batch.append(r)
                conts.append(cont)
            if not batch:
                raise OutOfPages(f"request {todo[0][0].id} does not fit in the cache even alone")
            todo = todo[len(batch):]
            ids = [self._prompt_own_ids(r) + cont for r, cont in zip(batch, conts)]
            starts = torch.tensor([0] + [len(t) for t in ids]).cumsum(0)
            # the logits at position j predict token j + 1: those before each continuation token
            select = torch.cat([torch.arange(s + len(t) - len(c) - 1, s + len(t) - 1)
                                for s, t, c in zip(starts.tolist(), ids, conts)])
            logits = self._forward([self._feed(r, t) for r, t in zip(batch, ids)], lazy=self.mode == "lazy",
                                   select=select)
            target = torch.tensor([t for c in conts for t in c], device=logits.device)
            lp = torch.log_softmax(logits.float(), -1).gather(1, target[:, None])[:, 0].cpu()
            for c, part in zip(conts, lp.split([len(c) for c in conts])):
                out.append(part.mean().item())
            for r in batch:
                self._free(r)
        return out

    def _accept(self, batch: list[Request], logits: torch.Tensor) -> None:
        next_ids = self._sample(logits).tolist()  # one sync per step
        now = time.perf_counter()
        for r, tok in zip(batch, next_ids):
            if r.first_token_at is None:
                r.first_token_at = now
            if tok in self.eos:
                r.finished_at = now
                continue
            r.generated.append(tok)
            if len(r.generated) >= r.max_new_tokens:
                r.finished_at = now

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        t = self.sampling.temperature
        if t <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / t, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.sampling.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _free(self, r: Request) -> None:
        for e in r._entries:
            self.cache.release(e)
        r._entries = []
        self.pool.release(r._own_pages + r._copy_pages)
        r._own_pages, r._copy_pages = [], []

    def close(self) -> None:
        self.cache.close()
