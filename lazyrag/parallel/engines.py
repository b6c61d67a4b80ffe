"""The engine actor: one QueryEngine (lazyrag/commands/answer_engine.py) in a Ray worker, on
the GPU Ray gave it or on the CPU (lazyrag/parallel/cluster.py).

It opens the store itself, so the store must be readable at the same path on every node (a
shared file system, or object storage); `start` reports the store's id and model fingerprint,
which the driver checks against its own. The driver resolves each query's chunks and sends
their ids; the actor answers a batch at a time and returns the rows, the queries that failed,
and its cache counters. Ray needs only to be imported by whoever turns the class into an
actor (`ray.remote(EngineActor)`).
"""

from __future__ import annotations

import socket

from lazyrag.commands.answer_engine import QueryEngine, RequestRejected
from lazyrag.commands.queries import Query
from lazyrag.config import AnswerConfig
from lazyrag.store import Store, StoreError


class EngineActor:
    def __init__(self, cfg: AnswerConfig):
        """cfg as the run has it, with `device` this engine's ("cuda" or "cpu") and `store` a
        path every node can open; nothing loads until `start`."""
        self.cfg = cfg
        self.store: Store | None = None
        self.query_engine: QueryEngine | None = None

    def start(self) -> dict:
        """Open the store, load the model and build the engine; returns what the driver checks
        and records: the store's id and model fingerprint, the model, device and node."""
        import ray

        self.store = Store.open(self.cfg.store)
        qe = self.query_engine = QueryEngine(self.store, self.cfg)
        gpus = ray.get_gpu_ids()  # the GPU's number on its node, where the engine sees it as cuda:0
        device = f"cuda:{gpus[0]}" if gpus and self.cfg.device == "cuda" else str(qe.engine.device)
        return {"store_id": self.store.store_id, "fingerprint": self.store.settings.fingerprint,
                "model": qe.loaded.name, "device": device, "node": socket.gethostname()}

    def answer(self, batch: list[tuple[Query, list[str]]]) -> dict:
        """Answer (query, chunk ids) pairs: {"rows": answer rows in finishing order, "errors":
        [query id, reason] of those that failed, "cache": this engine's counters so far}."""
        qe = self.query_engine
        rows: list[dict] = []
        errors: list[tuple[str, str]] = []
        requests = []
        for q, chunk_ids in batch:
            try:
                requests.append(qe.request(q, [self.store.chunk(c) for c in chunk_ids]))
            except (StoreError, RequestRejected) as exc:
                errors.append((q.id, str(exc)))
        qe.run(requests, lambda seq: rows.append(qe.row(seq)),
               on_error=lambda seq, exc: errors.append((seq.id, str(exc))))
        return {"rows": rows, "errors": errors, "cache": qe.engine.cache.counters.to_json()}
