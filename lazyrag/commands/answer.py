"""`lazyrag answer`: queries file -> requests -> engine -> answers file + run log.

Answers are appended and flushed one line per finished query, so an interrupted run
loses nothing: re-running with the same --out skips the ids already answered. A bad
query line is reported with its line number and the others are still answered; a query
that fails goes to the errors file (lazyrag.commands.answers_file) and is retried next run.
"""

from __future__ import annotations

import json
import math
import signal
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from lazyrag.commands.answers_file import AnswersFile, run_record_path
from lazyrag.commands.audit import answer_text, audit_run
from lazyrag.commands.queries import Query, read_queries, resolve_chunks
from lazyrag.config import AnswerConfig
from lazyrag.errors import ResourceError
from lazyrag.eval import scoring
from lazyrag.models import LoadedModel, load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, Request, Sampling, Sequence
from lazyrag.serve.paged import OutOfPages, pages_for
from lazyrag.store import Store, StoreError, StoreMismatch
from lazyrag.store.format import timestamp


# The run's record is saved every this many answers (replacing the previous save), so a run
# killed without warning (SIGKILL, power loss) leaves its counters up to then; SIGINT and
# SIGTERM save it whole.
FLUSH_EVERY = 8


@dataclass
class RunSummary:
    record: dict | None  # None: nothing was left to answer, so no engine ran
    skipped: int
    bad: list[str] = field(default_factory=list)
    failed: int = 0  # queries listed in `errors`
    errors: Path | None = None
    record_file: Path | None = None  # where the record went when the store could not take it
    queries_in_file: int = 0

    @property
    def answered(self) -> int:
        return self.record["queries"] if self.record else 0

    @property
    def nothing_answered(self) -> bool:
        """No query was answered, and some failed or were bad, or the file held none: bad input."""
        return self.answered == 0 and bool(self.failed or self.bad or not self.queries_in_file)


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


def answer_file(cfg: AnswerConfig, report: Callable[[str], None] = print, progress: bool = True) -> RunSummary:
    """Answer cfg.queries into cfg.out. The store, the answers file and every query line are
    checked before the model loads; a file with nothing left to answer never loads it."""
    # the answers file is locked before the slow model load, so a clash fails fast; held until
    # the run is recorded
    with Store.open(cfg.store) as store, AnswersFile(cfg.out, report) as answers:
        bad: list[str] = []

        def note_bad(msg: str) -> None:
            bad.append(msg)
            report(msg)

        queries = list(read_queries(cfg.queries, note_bad))
        todo = [q for q in queries if q.id not in answers.done]
        summary = RunSummary(None, skipped=len(queries) - len(todo), bad=bad, errors=answers.errors,
                             queries_in_file=len(queries))
        if todo:
            _answer_into(answers, store, cfg, todo, summary, report, progress)
        summary.failed = answers.failed
        return summary


def _answer_into(answers: AnswersFile, store: Store, cfg: AnswerConfig, todo: list[Query], summary: RunSummary,
                 report: Callable[[str], None], progress: bool) -> None:
    loaded = load_model_for(store, cfg)
    fmt = PromptFormat(loaded.tokenizer)
    context = loaded.cfg.max_position_embeddings
    limit = context - cfg.max_new_tokens
    if cfg.max_prompt_tokens is not None:
        limit = min(limit, cfg.max_prompt_tokens)
    try:
        engine = _engine(loaded, store, cfg, cfg.cache_gb * 2**30, cfg.cuda_graphs)
    except OutOfPages:
        # the pool cannot hold even the preamble: one that just does is enough for every
        # request's check below to fail, saying the size it needs
        s = store.settings
        page = s.num_layers * 2 * s.page_size * s.num_kv_heads * s.head_dim * loaded.dtype.itemsize
        engine = _engine(loaded, store, cfg, (pages_for(len(s.preamble_ids), s.page_size) + 1) * page, False)
    capacity = engine.cache.available_pages()  # what one request may use: the pool less the preamble
    retriever = None

    def fail(q: Query, reason: str) -> None:
        report(f"{cfg.queries}:{q.line}: query {q.id}: {reason}")
        answers.write_error(q.id, reason, q.line)

    def requests() -> Iterator[Request]:
        nonlocal retriever
        for q in todo:
            if not q.chunks and not q.docs:
                if store.num_chunks == 0:
                    fail(q, "the store holds no chunks to retrieve from; index a corpus first")
                    continue
                if retriever is None:
                    from lazyrag.retrieve import Retriever  # bm25s loads only when a query needs it

                    retriever = Retriever(store)
            try:
                chunks = resolve_chunks(store, q, retriever, cfg.top_k)
            except StoreError as exc:
                fail(q, str(exc))
                continue
            request = Request(q.id, chunks, fmt.question_ids(q.question), cfg.max_new_tokens,
                              arrival=time.perf_counter(), meta={"answers": q.answers, "query": q})
            tokens = engine.mode.own_start(request) + len(engine.mode.prompt_ids(request))
            if tokens > limit:
                fail(q, f"the prompt is {tokens:,} tokens, over the limit of {limit:,} (the model's context of "
                        f"{context:,} less --max-new-tokens {cfg.max_new_tokens}"
                        + (f", or --max-prompt-tokens {cfg.max_prompt_tokens}" if cfg.max_prompt_tokens else "")
                        + "); name fewer docs or chunks, or shorten the question")
                continue
            _check_fits(engine, request, capacity, cfg)
            yield request

    results: list[dict] = []
    answered: dict[str, Request] = {}  # kept only for the audit, which re-submits some of them
    run_id = uuid.uuid4().hex
    t0 = time.perf_counter()
    record_to = RecordSink(store, run_id, cfg.out, report)

    def record(**extra) -> dict:
        rec = run_record(cfg, loaded.name, engine, results, time.perf_counter() - t0, len(summary.bad),
                         answers.failed)
        return {"run_id": run_id, **rec, **extra}

    def finish(r: Sequence) -> None:
        row = {
            "id": r.id, "answer": answer_text(loaded, r.generated),
            "mode": cfg.mode.value, "chunks": [c.chunk_id for c in r.chunks],
            "ttft_ms": round(r.ttft_ms, 2), "latency_ms": round(r.latency_ms, 2), "new_tokens": len(r.generated),
            "cache": {"hits": r.hits, "misses": r.misses},
        }
        if r.meta.get("answers"):
            row["score"] = scoring.score(row["answer"], r.meta["answers"])
        answers.write(row)
        results.append(row)
        if cfg.audit:
            answered[r.id] = r.request
        bar.update(1)
        if len(results) % FLUSH_EVERY == 0:
            record_to.save(record(interrupted=True))  # replaced by the next save
        stop.check()

    from tqdm import tqdm

    # the total is what is left to answer, so the bar shows an ETA
    bar = tqdm(total=len(todo), desc=f"answer ({cfg.mode.value})", unit="q", disable=not progress,
               dynamic_ncols=True)
    completed = False
    stop = GracefulStop()
    try:
        with stop:
            # a chunk that cannot be read fails only the queries that need it
            engine.run(requests(), finish, lookahead=cfg.prefetch,
                       on_error=lambda seq, exc: fail(seq.meta["query"], str(exc)))
        completed = True
    finally:
        bar.close()
        engine.close()  # before the audit builds its engines: one pool at a time
        final = record() if completed else record(interrupted=True)
        if completed and results and cfg.audit > 0:
            final["audit"] = audit_run(cfg, loaded, store, results, answered)
        record_to.save(final)
        summary.record, summary.record_file = final, record_to.file


class RecordSink:
    """Where the run's record goes: the store's run log, each save replacing the last, or
    `<out>.run.json` beside the answers when the store cannot be written (a read-only
    filesystem), said once on `report`."""

    def __init__(self, store: Store, run_id: str, out: Path, report: Callable[[str], None]):
        self.store, self.run_id, self.out, self.report = store, run_id, out, report
        self.file: Path | None = None

    def save(self, record: dict) -> None:
        if self.file is None:
            try:
                self.store.save_run(self.run_id, record)
                return
            except (StoreError, sqlite3.Error, OSError) as exc:
                self.file = run_record_path(self.out)
                reason = exc if isinstance(exc, StoreError) else f"{self.store.path}: {exc}"
                self.report(f"cannot write the run log ({reason}); the run's record goes to {self.file}")
        try:
            tmp = self.file.with_name(self.file.name + ".tmp")
            tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
            tmp.replace(self.file)
        except OSError as exc:  # the answers are safe; losing the record must not hide why the run ended
            self.report(f"could not write the run's record to {self.file} ({exc.strerror})")


class GracefulStop:
    """SIGINT and SIGTERM end the run after the answer being written, so the answers file and
    the run's record agree; a second signal ends it at once. Only the main thread gets signals."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal asked the run to stop."""
        if self.requested:
            raise KeyboardInterrupt

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _engine(loaded: LoadedModel, store: Store, cfg: AnswerConfig, cache_bytes: float, cuda_graphs: bool) -> Engine:
    return Engine(loaded, store, cfg.mode, cache_bytes, cfg.batch_size,
                  Sampling(cfg.temperature, cfg.top_p, cfg.seed), cfg.host_cache_gb * 2**30,
                  cuda_graphs=cuda_graphs,
                  recompute=Recompute(cfg.recompute, cfg.recompute_policy, cfg.recompute_layer),
                  ape=(cfg.ape_temperature, cfg.ape_scale))


def _check_fits(engine: Engine, request: Request, capacity: int, cfg: AnswerConfig) -> None:
    """ResourceError when the request could not run even alone in the page pool, with the
    --cache-gb it needs."""
    page_size = engine.pool.page_size
    resident = sum(pages_for(c.padded_length, page_size) for c in engine.mode.cached_chunks(request)
                   if engine.cache.is_resident(c.chunk_id))
    need = engine.mode.pages_needed(Sequence(request), engine.cache) + resident  # as if nothing were cached
    if need > capacity:
        kept = engine.pool.num_pages - capacity
        page = engine.pool.bytes_per_page
        gb = math.ceil((need + kept) * page / 2**30 * 1e4) / 1e4
        raise ResourceError(f"--cache-gb {cfg.cache_gb:g} is too small for query {request.id}: it needs {need} pages "
                            f"of KV cache besides the {kept} the preamble keeps ({page / 2**20:.3g} MiB each); "
                            f"raise --cache-gb to at least {gb:g}")


def run_record(cfg: AnswerConfig, model: str, engine: Engine, rows: list[dict], seconds: float, bad: int,
               failed: int) -> dict:
    """One run's line in the store's run log (what `lazyrag stats` shows)."""
    scored = [r["score"] for r in rows if "score" in r]
    new_tokens = sum(r["new_tokens"] for r in rows)
    record = {
        "time": timestamp(), "mode": cfg.mode.value, "model": model,
        "device": str(engine.device), "queries": len(rows), "bad_lines": bad,
        "failed": failed,
        "queries_file": str(cfg.queries), "out": str(cfg.out), "seconds": round(seconds, 3),
        "settings": {"batch_size": cfg.batch_size, "cache_gb": cfg.cache_gb, "host_cache_gb": cfg.host_cache_gb,
                     "max_new_tokens": cfg.max_new_tokens, "top_k": cfg.top_k, "temperature": cfg.temperature,
                     "recompute": cfg.recompute, "recompute_policy": cfg.recompute_policy,
                     "recompute_layer": cfg.recompute_layer, "ape_temperature": cfg.ape_temperature,
                     "ape_scale": cfg.ape_scale},
        "cache": engine.cache.counters.to_json(),
        "ttft_ms": scoring.summarize([r["ttft_ms"] for r in rows]),
        "latency_ms": scoring.summarize([r["latency_ms"] for r in rows]),
        "new_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else None,
        "queries_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
    }
    if scored:
        record["quality"] = {k: round(sum(s[k] for s in scored) / len(scored), 4) for k in ("accuracy", "em", "f1")}
        record["quality"]["scored"] = len(scored)
    return record
