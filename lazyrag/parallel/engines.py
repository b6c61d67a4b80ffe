"""The engine actor: one QueryEngine (lazyrag/commands/answer_engine.py) in a Ray worker, on
the GPU Ray gave it or on the CPU (lazyrag/parallel/cluster.py), answering an open stream of
queries.

One engine thread owns the store, the model and the engine, so that the store's SQLite catalog
and the CUDA state stay in one thread: it builds each request from the inbox and runs them all
in one continuous-batching loop (Engine.run over an open stream), which never drains while
queries keep coming. The driver's calls run on the actor's other threads (it is created with
max_concurrency of at least 3): `submit` only enqueues, `collect` returns what finished since
the last collect, `close` ends the stream. Whoever turns the class into an actor
(`ray.remote(EngineActor)`) imports Ray; this module needs it only for a GPU engine's number.

It opens the store itself, so the store must be readable at the same path on every node (a
shared file system, or object storage); `start` reports the store's id and model fingerprint,
which the driver checks against its own.
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Iterator

from lazyrag.commands.answer_engine import QueryEngine, RequestRejected
from lazyrag.commands.queries import Query
from lazyrag.config import AnswerConfig
from lazyrag.serve import Request
from lazyrag.store import Store, StoreError

CLOSE = object()  # in the inbox: the stream ends once what was submitted before it is answered


class EngineActor:
    def __init__(self, cfg: AnswerConfig):
        """cfg as the run has it, with `device` this engine's ("cuda" or "cpu") and `store` a
        path every node can open; nothing loads until `start`."""
        self.cfg = cfg
        self._inbox: queue.Queue = queue.Queue()  # (Query, chunk ids), then CLOSE
        self._outbox = threading.Condition()      # guards what follows, and wakes a waiting collect
        self._rows: list[dict] = []
        self._errors: list[tuple[str, str]] = []
        self._counters: dict | None = None  # the cache counters as of the last row or error
        self._failure: BaseException | None = None
        self._info: dict = {}
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lazyrag-engine", daemon=True)

    def start(self) -> dict:
        """Start the engine thread and wait until it has opened the store, loaded the model and
        built the engine; returns what the driver checks and records: the store's id and model
        fingerprint, the model, device and node. Raises the error that stopped it, if one did."""
        self._thread.start()
        self._built.wait()
        if not self._info:
            raise self._failure
        info = dict(self._info)
        if self.cfg.device == "cuda":
            import ray

            gpus = ray.get_gpu_ids()  # the GPU's number on its node, where the engine sees it as cuda:0
            if gpus:
                info["device"] = f"cuda:{gpus[0]}"
        return info

    def submit(self, batch: list[tuple[Query, list[str]]]) -> None:
        """Queue (query, chunk ids) pairs for the engine; returns at once."""
        for item in batch:
            self._inbox.put(item)

    def collect(self, wait_s: float) -> dict:
        """Everything finished since the last collect, waiting up to `wait_s` seconds for at least
        one: {"rows": answer rows in finishing order, "errors": [query id, reason] of those that
        failed, "cache": this engine's counters (None before the first)}. Once the engine thread
        has failed and its last results are collected, raises its error."""
        with self._outbox:
            self._outbox.wait_for(lambda: self._rows or self._errors or self._failure is not None, wait_s)
            if not (self._rows or self._errors) and self._failure is not None:
                raise self._failure
            out = {"rows": self._rows, "errors": self._errors, "cache": self._counters}
            self._rows, self._errors = [], []
            return out

    def close(self) -> None:
        """End the stream after what was submitted, and wait for the engine thread to give back
        the model's memory and the store."""
        self._inbox.put(CLOSE)
        if self._thread.is_alive():
            self._thread.join()

    def _serve(self) -> None:
        try:
            with Store.open(self.cfg.store) as store:
                qe = QueryEngine(store, self.cfg)
                try:
                    self._info = {"store_id": store.store_id, "fingerprint": store.settings.fingerprint,
                                  "model": qe.loaded.name, "device": str(qe.engine.device),
                                  "node": socket.gethostname()}
                    self._built.set()
                    qe.run(self._requests(qe, store), lambda seq: self._post(qe, row=qe.row(seq)),
                           on_error=lambda seq, exc: self._post(qe, error=(seq.id, str(exc))))
                finally:
                    qe.close()
        except BaseException as exc:  # handed to the driver by start or the next collect
            with self._outbox:
                self._failure = exc
                self._outbox.notify_all()
        finally:
            self._built.set()

    def _requests(self, qe: QueryEngine, store: Store) -> Iterator[Request | None]:
        """The inbox as an open stream of requests: None while it is empty, until CLOSE. A query
        whose request cannot be built goes to the outbox as an error."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                yield None
                continue
            if item is CLOSE:
                return
            q, chunk_ids = item
            try:
                request = qe.request(q, [store.chunk(c) for c in chunk_ids])
            except (StoreError, RequestRejected) as exc:
                self._post(qe, error=(q.id, str(exc)))
                continue
            yield request

    def _post(self, qe: QueryEngine, row: dict | None = None, error: tuple[str, str] | None = None) -> None:
        counters = qe.engine.cache.counters.to_json()  # read here: the engine thread alone changes them
        with self._outbox:
            if row is not None:
                self._rows.append(row)
            if error is not None:
                self._errors.append(error)
            self._counters = counters
            self._outbox.notify_all()
