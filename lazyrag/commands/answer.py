"""`lazyrag answer`: queries file -> requests -> engine -> answers file + run log.

Answers are appended and flushed one line per finished query, so an interrupted run
loses nothing: re-running with the same --out skips the ids already answered. A bad
query line is reported with its line number and the others are still answered; a query
that fails goes to the errors file (lazyrag.commands.answers_file) and is retried next run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from lazyrag.commands import answer_checks as checks
from lazyrag.commands.answer_engine import QueryEngine, RequestTooLarge
from lazyrag.commands.answer_run import AnswerRun, RunSummary
from lazyrag.commands.answers_file import AnswersFile
from lazyrag.commands.audit import audit_run
from lazyrag.commands.queries import ChunkResolver, Query, read_queries
from lazyrag.config import AnswerConfig
from lazyrag.serve import Request, Sequence
from lazyrag.serve import faults
from lazyrag.store import Store, StoreError


def answer_file(cfg: AnswerConfig, report: Callable[[str], None] = print, progress: bool = True) -> RunSummary:
    """Answer cfg.queries into cfg.out. The store, the answers file and every query line are
    checked before the model loads; a file with nothing left to answer never loads it. With
    cfg.data_parallel > 1 or cfg.ray_address, engine actors on Ray answer (lazyrag/parallel/)."""
    parallel = cfg.data_parallel > 1 or cfg.ray_address is not None
    checks.check_options(cfg)
    checks.check_out(cfg)
    checks.check_pool_memory(cfg)
    if parallel:
        from lazyrag.parallel.cluster import check_options

        check_options(cfg)
    checks.check_queries(cfg)  # before --out is created
    # the answers file is locked before the slow model load, so a clash fails fast; held until
    # the run is recorded
    with Store.open(cfg.store) as store, checked(cfg, store), AnswersFile(cfg.out, report) as answers:
        bad: list[str] = []

        def note_bad(msg: str) -> None:
            bad.append(msg)
            report(msg)

        queries = list(read_queries(cfg.queries, note_bad))
        todo = [q for q in queries if q.id not in answers.done]
        summary = RunSummary(None, skipped=len(queries) - len(todo), bad=bad, errors=answers.errors,
                             queries_in_file=len(queries))
        if todo:
            run = AnswerRun(answers, store, cfg, summary, report, progress, len(todo))
            if parallel:
                from lazyrag.parallel.driver import answer_parallel

                answer_parallel(run, todo)
            else:
                _answer_with_one_engine(run, todo)
        summary.failed = answers.failed
        return summary


@contextmanager
def checked(cfg: AnswerConfig, store: Store) -> Iterator[None]:
    """The options checked against the store's model, before --out is opened."""
    checks.check_against_store(cfg, store)
    yield


def _answer_with_one_engine(run: AnswerRun, todo: list[Query]) -> None:
    cfg, store = run.cfg, run.store
    qe = QueryEngine(store, cfg)
    resolver = ChunkResolver(store, cfg.top_k)
    answered: dict[str, Request] = {}  # kept only for the audit, which re-submits some of them

    def resolved() -> Iterator[tuple[Query, list]]:
        for q in todo:
            try:
                yield q, resolver.chunks(q)
            except StoreError as exc:
                run.fail(q, str(exc))

    def reject(q: Query, exc: Exception) -> None:
        run.fail(q, str(exc))
        if isinstance(exc, RequestTooLarge) and run.summary.too_large is None:
            run.summary.too_large = str(exc)

    def finish(seq: Sequence) -> None:
        if cfg.audit:
            answered[seq.id] = seq.request
        run.write(qe.row(seq))

    run.engine_stats = lambda: {"model": qe.loaded.name, "device": str(qe.engine.device),
                                "cache": qe.engine.cache.counters.to_json()}
    run.start()
    completed = False
    try:
        with run.stop:
            qe.run(qe.requests(resolved(), reject), finish,
                   on_error=lambda seq, exc: run.fail(seq.meta["query"], faults.reason(exc)))
        completed = True
    finally:
        qe.close()  # before the audit builds its engines: one pool at a time
        extra = {}
        if completed and run.rows and cfg.audit > 0:
            extra["audit"] = audit_run(cfg, qe.loaded, store, run.rows, answered)
        run.end(completed, **extra)
