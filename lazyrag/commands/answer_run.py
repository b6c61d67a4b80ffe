"""One `answer` run's output: answer rows appended to --out as they come, failed queries to the
errors file, the run's record in the store's run log (saved every FLUSH_EVERY answers and at the
end), the progress bar, and SIGINT or SIGTERM ending the run after the row being written.
`answer` (lazyrag/commands/answer.py) and its engine actors' driver (lazyrag/parallel/driver.py)
both write through an AnswerRun; `bench` saves its record through a RecordSink.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lazyrag.commands.answers_file import AnswersFile, run_record_path
from lazyrag.commands.queries import Query
from lazyrag.config import AnswerConfig
from lazyrag.eval import scoring
from lazyrag.store import Store, StoreError
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
    too_large: str | None = None  # why the first query refused for resources was (RequestTooLarge)

    @property
    def answered(self) -> int:
        return self.record["queries"] if self.record else 0

    @property
    def nothing_answered(self) -> bool:
        """No query was answered, and some failed or were bad, or the file held none: bad input."""
        return self.answered == 0 and bool(self.failed or self.bad or not self.queries_in_file)


class AnswerRun:
    """What one run writes: answer rows appended to --out as they come (each synced), failed
    queries to the errors file, the run's record saved every FLUSH_EVERY answers and at the end;
    with the progress bar, and SIGINT or SIGTERM ending the run after the row being written.
    Whoever runs the engines sets `engine_stats`: the record's model, device and cache counters."""

    def __init__(self, answers: AnswersFile, store: Store, cfg: AnswerConfig, summary: RunSummary,
                 report: Callable[[str], None], progress: bool, total: int):
        self.answers, self.store, self.cfg, self.summary, self.report = answers, store, cfg, summary, report
        self.progress, self.total = progress, total
        self.rows: list[dict] = []
        self.run_id = uuid.uuid4().hex
        self.sink = RecordSink(store, self.run_id, cfg.out, report)
        self.stop = GracefulStop()
        self.engine_stats: Callable[[], dict] = dict
        self.t0 = time.perf_counter()
        self._bar = None

    def start(self) -> None:
        """The engines are ready: the clock and the progress bar start."""
        from tqdm import tqdm

        self.t0 = time.perf_counter()
        # the total is what is left to answer, so the bar shows an ETA
        self._bar = tqdm(total=self.total, desc=f"answer ({self.cfg.mode.value})", unit="q",
                         disable=not self.progress, dynamic_ncols=True)

    def write(self, row: dict) -> None:
        """Append an answer; raises KeyboardInterrupt once it is written if a signal asked to stop."""
        self.answers.write(row)
        self.rows.append(row)
        if self._bar is not None:
            self._bar.update(1)
        if len(self.rows) % FLUSH_EVERY == 0:
            self.sink.save(self.record(interrupted=True))  # replaced by the next save
        self.stop.check()

    def fail(self, q: Query, reason: str) -> None:
        self.report(f"{self.cfg.queries}:{q.line}: query {q.id}: {reason}")
        self.answers.write_error(q.id, reason, q.line)

    def record(self, **extra) -> dict:
        rec = run_record(self.cfg, self.rows, time.perf_counter() - self.t0, len(self.summary.bad),
                         self.answers.failed, self.engine_stats())
        return {"run_id": self.run_id, **rec, **extra}

    def end(self, completed: bool, **extra) -> None:
        """Save the run's final record (`interrupted` unless it completed) with `extra` added."""
        if self._bar is not None:
            self._bar.close()
        final = self.record(**extra) if completed else self.record(interrupted=True, **extra)
        self.sink.save(final)
        self.summary.record, self.summary.record_file = final, self.sink.file


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
        tmp = self.file.with_name(self.file.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
            tmp.replace(self.file)
        except OSError as exc:  # the answers are safe; losing the record must not hide why the run ended
            self.report(f"could not write the run's record to {self.file} ({exc.strerror})")
            try:
                tmp.unlink(missing_ok=True)  # a torn or empty record (a full disk) is litter, not a record
            except OSError:
                pass


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


def run_record(cfg: AnswerConfig, rows: list[dict], seconds: float, bad: int, failed: int, engine_stats: dict) -> dict:
    """One run's line in the store's run log (what `lazyrag stats` shows); `engine_stats` gives its
    model, device and cache counters (and, with several engines, `engines`: each one's)."""
    scored = [r["score"] for r in rows if "score" in r]
    new_tokens = sum(r["new_tokens"] for r in rows)
    record = {
        "time": timestamp(), "mode": cfg.mode.value, "queries": len(rows), "bad_lines": bad,
        "failed": failed,
        "queries_file": str(cfg.queries), "out": str(cfg.out), "seconds": round(seconds, 3),
        "settings": {"batch_size": cfg.batch_size, "cache_gb": cfg.cache_gb, "host_cache_gb": cfg.host_cache_gb,
                     "max_new_tokens": cfg.max_new_tokens, "top_k": cfg.top_k, "temperature": cfg.temperature,
                     "recompute": cfg.recompute, "recompute_policy": cfg.recompute_policy,
                     "recompute_layer": cfg.recompute_layer, "recompute_reuse": cfg.recompute_reuse,
                     "chunk_order": cfg.prompt_order.value, "ape_temperature": cfg.ape_temperature,
                     "ape_scale": cfg.ape_scale, "shared_attention": cfg.shared_attention},
        "ttft_ms": scoring.summarize([r["ttft_ms"] for r in rows]),
        "latency_ms": scoring.summarize([r["latency_ms"] for r in rows]),
        "new_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else None,
        "queries_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
        **engine_stats,
    }
    if "engines" in engine_stats:
        record["settings"].update(data_parallel=cfg.data_parallel, ray_address=cfg.ray_address, routing=cfg.routing)
    if scored:
        record["quality"] = {k: round(sum(s[k] for s in scored) / len(scored), 4) for k in ("accuracy", "em", "f1")}
        record["quality"]["scored"] = len(scored)
    return record
