"""One engine answering queries: the model the store was built with, the engine sized by the
answer settings, each query turned into a checked request and each finished sequence into its
row of the answers file. `answer` runs one in its own process; `answer --data-parallel N` runs
one inside each engine actor (lazyrag/parallel/engines.py)."""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Iterator

from lazyrag.commands.audit import answer_text
from lazyrag.commands.queries import Query, in_prompt_order
from lazyrag.config import AnswerConfig
from lazyrag.errors import InputError
from lazyrag.eval import scoring
from lazyrag.models import LoadedModel, load_model, resolve_device
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, Request, Sampling, Sequence
from lazyrag.serve import faults
from lazyrag.serve.loader import pin_staging_ahead
from lazyrag.serve.memory import available_bytes, prefill_bytes
from lazyrag.serve.paged import OutOfPages, pages_for
from lazyrag.store import ChunkInfo, Store, StoreError, StoreMismatch


class RequestRejected(Exception):
    """A query that cannot be answered as asked (its prompt is too long); it goes to the errors file."""


class RequestTooLarge(RequestRejected):
    """A query whose request would not fit in the page pool or the memory left even alone: refused
    before it is attempted (a run that answers nothing for this reason exits 5)."""


def load_model_for(store: Store, cfg: AnswerConfig) -> LoadedModel:
    """The model the store was built with (or cfg.model, which must have the same fingerprint)."""
    s = store.settings
    loaded = load_model(cfg.model or s.model, cfg.device, s.kv_dtype, cfg.trust_remote_code)
    if loaded.fingerprint != s.fingerprint:
        raise StoreMismatch(f"{cfg.store} was built with model fingerprint {s.fingerprint[:16]}, but "
                            f"{loaded.name} now has {loaded.fingerprint[:16]}; re-index into a new --store")
    if tuple(PromptFormat(loaded.tokenizer).preamble_ids()) != tuple(s.preamble_ids):
        raise StoreMismatch(f"{cfg.store}: the stored preamble differs from this lazyrag's prompt; re-index")
    return loaded


class QueryEngine:
    """The engine of one `answer` run and the request and row building around it."""

    def __init__(self, store: Store, cfg: AnswerConfig, loaded: LoadedModel | None = None):
        """`loaded`: the store's model already loaded (`bench` builds an engine per configuration)."""
        self.cfg = cfg
        if loaded is None:  # a fresh process: its first reads find their buffers pinned while the model loads
            pin_staging_ahead(store, resolve_device(cfg.device))
        self.loaded = loaded or load_model_for(store, cfg)
        self.fmt = PromptFormat(self.loaded.tokenizer)
        self.context = self.loaded.cfg.max_position_embeddings
        self.limit = self.context - cfg.max_new_tokens
        if cfg.max_prompt_tokens is not None:
            self.limit = min(self.limit, cfg.max_prompt_tokens)
        if self.limit < 1:  # answer_checks says so before the load where it can read the model's config
            raise InputError(f"--max-new-tokens {cfg.max_new_tokens:,} leaves no room for a prompt in the model's "
                             f"context of {self.context:,} tokens; ask for fewer")
        try:
            self.engine = _engine(self.loaded, store, cfg, cfg.cache_gb * 2**30, cfg.cuda_graphs)
        except OutOfPages:
            # the pool cannot hold even the preamble: one that just does is enough for every
            # request's check to fail, saying the size it needs
            s = store.settings
            page = s.page_size * s.row_bytes
            self.engine = _engine(self.loaded, store, cfg, (pages_for(len(s.preamble_ids), s.page_size) + 1) * page,
                                  False)
        self.capacity = self.engine.cache.available_pages()  # what one request may use: the pool less the preamble

    def request(self, q: Query, chunks: list[ChunkInfo], given: list[ChunkInfo] | None = None,
                shared_prefix: int = 0) -> Request:
        """The query's request over `chunks` (`given`: the same chunks in the order the query gave,
        which the audit compares against; shared_prefix: Request.shared_prefix). RequestRejected
        when its prompt is over the length limit; RequestTooLarge when it could not run even alone
        in the page pool or the memory free."""
        cfg, mode = self.cfg, self.engine.mode
        try:
            question_ids = self.fmt.question_ids(q.question)
        except Exception as exc:  # the tokenizer's own errors concern this question only
            raise RequestRejected(f"the tokenizer cannot encode the question ({faults.reason(exc)})") from None
        request = Request(q.id, chunks, question_ids, cfg.max_new_tokens,
                          arrival=time.perf_counter(), meta={"answers": q.answers, "query": q,
                                                             "given_chunks": given or chunks},
                          shared_prefix=shared_prefix)
        tokens = mode.own_start(request) + len(mode.prompt_ids(request))
        if tokens > self.limit:
            raise RequestRejected(
                f"the prompt is {tokens:,} tokens, over the limit of {self.limit:,} (the model's context of "
                f"{self.context:,} less --max-new-tokens {cfg.max_new_tokens}"
                + (f", or --max-prompt-tokens {cfg.max_prompt_tokens}" if cfg.max_prompt_tokens else "")
                + "); name fewer docs or chunks, or shorten the question")
        self._check_fits(request)
        self._check_memory(request, tokens)
        return request

    def requests(self, resolved: Iterable[tuple[Query, list[ChunkInfo]]],
                 on_reject: Callable[[Query, Exception], None]) -> Iterator[Request]:
        """The resolved queries' requests in the run's chunk order, with their shared prefixes
        (both counted over every query where recomputed pages are reused); a query whose request
        cannot be built (RequestRejected, StoreError) goes to on_reject instead."""
        uses = self.engine.mode.whole_prefix_uses
        for q, chunks, given, shared in in_prompt_order(resolved, self.cfg.prompt_order, uses):
            try:
                yield self.request(q, chunks, given, shared)
            except (StoreError, RequestRejected) as exc:
                on_reject(q, exc)

    def run(self, requests: Iterable[Request], on_finish: Callable[[Sequence], None],
            on_error: Callable[[Sequence, Exception], None]) -> None:
        """Answer the requests (Engine.run); an error that concerns one request (a chunk that
        cannot be read, out of memory: lazyrag/serve/faults.py) fails only the queries it
        concerns, each handed to `on_error`."""
        self.engine.run(requests, on_finish, lookahead=self.cfg.prefetch, on_error=on_error)

    def row(self, seq: Sequence) -> dict:
        """A finished request's line in the answers file."""
        row = {
            "id": seq.id, "answer": answer_text(self.loaded, seq.generated),
            "mode": self.cfg.mode.value, "chunks": [c.chunk_id for c in seq.chunks],
            "ttft_ms": round(seq.ttft_ms, 2), "latency_ms": round(seq.latency_ms, 2),
            "new_tokens": len(seq.generated), "cache": {"hits": seq.hits, "misses": seq.misses},
        }
        if seq.meta.get("answers"):
            row["score"] = scoring.score(row["answer"], seq.meta["answers"])
        return row

    def close(self) -> None:
        self.engine.close()

    def _check_fits(self, request: Request) -> None:
        """RequestTooLarge when the request could not run even alone in the page pool, with the
        --cache-gb it needs."""
        engine = self.engine
        page_size = engine.pool.page_size
        resident = sum(pages_for(c.padded_length, page_size) for c in engine.mode.cached_chunks(request)
                       if engine.cache.is_resident(c.chunk_id))
        need = engine.mode.pages_needed(Sequence(request), engine.cache) + resident  # as if nothing were cached
        if need > self.capacity:
            kept = engine.pool.num_pages - self.capacity
            page = engine.pool.bytes_per_page
            gb = math.ceil((need + kept) * page / 2**30 * 1e4) / 1e4
            raise RequestTooLarge(f"--cache-gb {self.cfg.cache_gb:g} is too small for query {request.id}: it needs "
                                  f"{need} pages of KV cache besides the {kept} the preamble keeps "
                                  f"({page / 2**20:.3g} MiB each); raise --cache-gb to at least {gb:g}, or lower "
                                  "--max-prompt-tokens to refuse prompts this long")

    def _check_memory(self, request: Request, prompt_tokens: int) -> None:
        """RequestTooLarge when one prefill step of the request (a slice of its prompt attending
        over all of it) needs more working memory than the machine has free now."""
        keys = prompt_tokens + self.cfg.max_new_tokens
        step = min(len(self.engine.mode.prompt_ids(request)), self.engine.runner.prefill_tokens)
        need = prefill_bytes(self.loaded.cfg, step, keys, self.engine.device.type)
        free = available_bytes(self.engine.device)
        if free is not None and need > free:
            raise RequestTooLarge(f"query {request.id} needs about {need / 2**30:.2f} GiB of working memory to "
                                  f"prefill its {prompt_tokens:,}-token prompt, but {free / 2**30:.2f} GiB is free; "
                                  "lower --max-prompt-tokens to refuse prompts this long, or --cache-gb or "
                                  "--batch-size to leave it more memory")


def _engine(loaded: LoadedModel, store: Store, cfg: AnswerConfig, cache_bytes: float, cuda_graphs: bool) -> Engine:
    return Engine(loaded, store, cfg.mode, cache_bytes, cfg.batch_size,
                  Sampling(cfg.temperature, cfg.top_p, cfg.seed), cfg.host_cache_gb * 2**30,
                  cuda_graphs=cuda_graphs,
                  recompute=Recompute.of(cfg),
                  ape=(cfg.ape_temperature, cfg.ape_scale), shared_attention=cfg.shared_attention)
