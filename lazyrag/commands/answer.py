"""`lazyrag answer`: queries file -> requests -> engine -> answers file + run log.

Answers are appended and flushed one line per finished query, so an interrupted run
loses nothing: re-running with the same --out skips the ids already answered. A bad
query line is reported with its line number and the others are still answered; a query
that fails goes to the errors file (lazyrag.commands.answers_file) and is retried next run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from lazyrag.commands.answers_file import AnswersFile
from lazyrag.commands.audit import answer_text, audit_run
from lazyrag.commands.queries import read_queries, resolve_chunks
from lazyrag.config import AnswerConfig
from lazyrag.eval import scoring
from lazyrag.models import LoadedModel, load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, Request, Sampling, Sequence
from lazyrag.store import Store, StoreError, StoreMismatch


@dataclass
class RunSummary:
    record: dict
    skipped: int
    bad: list[str] = field(default_factory=list)
    failed: int = 0  # queries listed in `errors`
    errors: Path | None = None


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
    store = Store.open(cfg.store)
    # locked before the slow model load, so a clash fails fast; held until the run is recorded
    with AnswersFile(cfg.out, report) as answers:
        return _answer_into(answers, store, cfg, report, progress)


def _answer_into(answers: AnswersFile, store: Store, cfg: AnswerConfig, report: Callable[[str], None],
                 progress: bool) -> RunSummary:
    loaded = load_model_for(store, cfg)
    fmt = PromptFormat(loaded.tokenizer)
    bad: list[str] = []

    def note_bad(msg: str) -> None:
        bad.append(msg)
        report(msg)

    retriever = None

    def requests() -> Iterator[Request]:
        nonlocal retriever
        for q in read_queries(cfg.queries, note_bad):
            if q.id in answers.done:
                continue
            try:
                if not q.chunks and not q.docs and retriever is None:
                    from lazyrag.retrieve import Retriever  # bm25s loads only when a query needs it

                    retriever = Retriever(store)
                chunks = resolve_chunks(store, q, retriever, cfg.top_k)
            except StoreError as exc:
                note_bad(f"{cfg.queries}:{q.line}: query {q.id}: {exc}")
                answers.write_error(q.id, str(exc), q.line)
                continue
            yield Request(q.id, chunks, fmt.question_ids(q.question), cfg.max_new_tokens,
                          arrival=time.perf_counter(), meta={"answers": q.answers})

    results: list[dict] = []
    answered: dict[str, Request] = {}  # kept only for the audit, which re-submits some of them

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

    from tqdm import tqdm

    bar = tqdm(desc=f"answer ({cfg.mode.value})", unit="q", disable=not progress, dynamic_ncols=True)
    engine = Engine(loaded, store, cfg.mode, cfg.cache_gb * 2**30, cfg.batch_size,
                    Sampling(cfg.temperature, cfg.top_p, cfg.seed), cfg.host_cache_gb * 2**30,
                    cuda_graphs=cfg.cuda_graphs,
                    recompute=Recompute(cfg.recompute, cfg.recompute_policy, cfg.recompute_layer),
                    ape=(cfg.ape_temperature, cfg.ape_scale))
    t0 = time.perf_counter()
    completed = False
    try:
        engine.run(requests(), finish, lookahead=cfg.prefetch)
        completed = True
    finally:
        seconds = time.perf_counter() - t0
        bar.close()
        engine.close()  # before the audit builds its engines: one pool at a time
        record = run_record(cfg, loaded.name, engine, results, seconds, len(bad), answers.failed)
        if results:
            if completed and cfg.audit > 0:
                record["audit"] = audit_run(cfg, loaded, store, results, answered)
            store.add_run(record)
    return RunSummary(record, skipped=len(answers.done), bad=bad, failed=answers.failed, errors=answers.errors)


def run_record(cfg: AnswerConfig, model: str, engine: Engine, rows: list[dict], seconds: float, bad: int,
               failed: int) -> dict:
    """One run's line in the store's run log (what `lazyrag stats` shows)."""
    scored = [r["score"] for r in rows if "score" in r]
    new_tokens = sum(r["new_tokens"] for r in rows)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": cfg.mode.value, "model": model,
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
