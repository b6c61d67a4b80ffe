"""`lazyrag answer`: queries file -> requests -> engine -> answers file + run log.

Answers are appended and flushed one line per finished query, so an interrupted run
loses nothing: re-running with the same --out skips the ids already answered. A bad
query line is reported with its line number and the others are still answered.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from lazyrag.eval import scoring as metrics
from lazyrag.config import AnswerConfig
from lazyrag.serve.engine import Engine, Request, Sampling
from lazyrag.models import load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.store import ChunkInfo, Store, StoreError, StoreMismatch


@dataclass
class Query:
    id: str
    question: str
    line: int
    docs: list[str] | None = None
    chunks: list[str] | None = None
    answers: list[str] | None = None


class QueryError(ValueError):
    pass


def read_queries(path: Path, report: Callable[[str], None]) -> Iterator[Query]:
    """Parse the queries file; a bad line is reported as `file:line: reason` and skipped."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise QueryError(f"{path}: cannot read the queries file ({exc.strerror})") from None
    seen: set[str] = set()
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                q = _parse_query(line, n)
            except (ValueError, UnicodeDecodeError) as exc:
                report(f"{path}:{n}: {exc}")
                continue
            if q.id in seen:
                report(f"{path}:{n}: duplicate query id {q.id!r}")
                continue
            seen.add(q.id)
            yield q


def _parse_query(line: str, n: int) -> Query:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    qid, question = obj.get("id"), obj.get("question")
    if qid is None or not isinstance(question, str) or not question.strip():
        raise ValueError('needs "id" and a non-empty "question"')
    lists = {}
    for key in ("docs", "chunks", "answers"):
        value = obj.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, (str, int)) for v in value)):
            raise ValueError(f'"{key}" must be a list of strings')
        lists[key] = [str(v) for v in value] if value is not None else None
    return Query(str(qid), question, n, **lists)


def answered_ids(out: Path) -> set[str]:
    """Ids already in the answers file (a torn last line from a crash is ignored)."""
    done = set()
    if out.exists():
        with open(out, encoding="utf-8") as fh:
            for line in fh:
                try:
                    done.add(str(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue
    return done


@dataclass
class RunSummary:
    record: dict
    skipped: int
    bad: list[str] = field(default_factory=list)


def answer_file(cfg: AnswerConfig, report: Callable[[str], None] = print, progress: bool = True,
                model_name: str | None = None) -> RunSummary:
    store = Store.open(cfg.store)
    s = store.settings
    loaded = load_model(model_name or s.model, cfg.device, s.kv_dtype, cfg.trust_remote_code)
    if loaded.fingerprint != s.fingerprint:
        raise StoreMismatch(f"{cfg.store} was built with model fingerprint {s.fingerprint[:16]}, but "
                            f"{loaded.name} now has {loaded.fingerprint[:16]}; re-index into a new --store")
    fmt = PromptFormat(loaded.tokenizer)
    if tuple(fmt.preamble_ids()) != tuple(s.preamble_ids):
        raise StoreMismatch(f"{cfg.store}: the stored preamble differs from this lazyrag's prompt; re-index")

    done = answered_ids(cfg.out)
    bad: list[str] = []

    def note_bad(msg: str) -> None:
        bad.append(msg)
        report(msg)

    retriever = None

    def requests() -> Iterator[Request]:
        nonlocal retriever
        for q in read_queries(cfg.queries, note_bad):
            if q.id in done:
                continue
            try:
                if not q.chunks and not q.docs and retriever is None:
                    from lazyrag.retrieve import Retriever

                    retriever = Retriever(store)
                chunks = resolve_chunks(store, q, retriever, cfg.top_k)
            except StoreError as exc:
                note_bad(f"{cfg.queries}:{q.line}: query {q.id}: {exc}")
                write({"id": q.id, "error": str(exc)})
                continue
            yield Request(q.id, chunks, fmt.question_ids(q.question), cfg.max_new_tokens,
                          arrival=time.perf_counter(), meta={"answers": q.answers})

    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    out = open(cfg.out, "a", encoding="utf-8")
    results: list[dict] = []

    def write(row: dict) -> None:
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())

    def finish(r: Request) -> None:
        row = {
            "id": r.id, "answer": loaded.tokenizer.decode(r.generated, skip_special_tokens=True).strip(),
            "mode": cfg.mode, "chunks": [c.chunk_id for c in r.chunks],
            "ttft_ms": round(r.ttft_ms, 2), "latency_ms": round(r.latency_ms, 2), "new_tokens": len(r.generated),
            "cache": {"hits": r.hits, "misses": r.misses},
        }
        if r.meta.get("answers"):
            row["score"] = metrics.score(row["answer"], r.meta["answers"])
        write(row)
        results.append(row)
        bar.update(1)

    from tqdm import tqdm

    bar = tqdm(desc=f"answer ({cfg.mode})", unit="q", disable=not progress, dynamic_ncols=True)
    engine = Engine(loaded, store, cfg.mode, cfg.cache_gb * 2**30, cfg.batch_size,
                    Sampling(cfg.temperature, cfg.top_p, cfg.seed), cfg.host_cache_gb * 2**30,
                    cuda_graphs=cfg.cuda_graphs)
    t0 = time.perf_counter()
    try:
        engine.run(requests(), finish, lookahead=cfg.prefetch)
    finally:
        seconds = time.perf_counter() - t0
        out.close()
        bar.close()
        engine.close()
        record = run_record(cfg, loaded.name, engine, results, seconds, len(bad))
        if results:
            store.add_run(record)
    return RunSummary(record, skipped=len(done), bad=bad)


def resolve_chunks(store: Store, q: Query, retriever, top_k: int) -> list[ChunkInfo]:
    """A query's chunks, else all chunks of its docs in order, else the top-k retrieved."""
    if q.chunks:
        return [store.chunk(cid) for cid in q.chunks]
    if q.docs:
        missing = [d for d in q.docs if not store.doc_chunks(d)]
        if missing:
            raise StoreError(f"unknown doc ids: {', '.join(missing)}")
        return [c for d in q.docs for c in store.doc_chunks(d)]
    return [store.chunk(cid) for cid in retriever.top_k(q.question, top_k)]


def run_record(cfg: AnswerConfig, model: str, engine: Engine, rows: list[dict], seconds: float, bad: int) -> dict:
    scored = [r["score"] for r in rows if "score" in r]
    new_tokens = sum(r["new_tokens"] for r in rows)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": cfg.mode, "model": model,
        "device": str(engine.device), "queries": len(rows), "bad_lines": bad,
        "queries_file": str(cfg.queries), "out": str(cfg.out), "seconds": round(seconds, 3),
        "settings": {"batch_size": cfg.batch_size, "cache_gb": cfg.cache_gb, "host_cache_gb": cfg.host_cache_gb,
                     "max_new_tokens": cfg.max_new_tokens, "top_k": cfg.top_k, "temperature": cfg.temperature},
        "cache": engine.cache.counters.to_json(),
        "ttft_ms": metrics.summarize([r["ttft_ms"] for r in rows]),
        "latency_ms": metrics.summarize([r["latency_ms"] for r in rows]),
        "new_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else None,
        "queries_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
    }
    if scored:
        record["quality"] = {k: round(sum(s[k] for s in scored) / len(scored), 4) for k in ("accuracy", "em", "f1")}
        record["quality"]["scored"] = len(scored)
    return record
