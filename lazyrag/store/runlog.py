"""The run log: one JSON record per ``answer`` or ``bench`` run (``"kind": "bench"``), kept in the
store's catalog (a local store) or as one object per run (a store on object storage), read by ``stats``."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from .catalog import Catalog
from .format import StoreError, timestamp
from .objects import Objects

RUNS = "runs"


class RunLog:
    """The ``runs`` table of a catalog. Appending needs no write lock: readers may log their runs."""

    def __init__(self, catalog: Catalog):
        self._catalog = catalog

    def save(self, run_id: str, record: dict) -> None:
        """Record run ``run_id``: its first save adds it, later ones replace its record in place (atomic)."""
        text = json.dumps(record, sort_keys=True)
        with self._catalog.transaction() as db:
            # one row per run: the table stays small, so finding the run without an index costs nothing
            if db.execute("UPDATE runs SET record = ? WHERE run_id = ?", (text, run_id)).rowcount == 0:
                db.execute("INSERT INTO runs (created, record, run_id) VALUES (?, ?, ?)", (timestamp(), text, run_id))

    def records(self) -> list[dict]:
        """The records, oldest first."""
        with self._catalog.reading() as db:
            return [_record(raw, run_id) for raw, run_id in db.execute("SELECT record, run_id FROM runs ORDER BY id")]

    def count(self) -> int:
        with self._catalog.reading() as db:
            return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


def _record(raw: str, run_id: str) -> dict:
    """A run's record as saved; StoreError naming the run when it is damaged (not a JSON object
    with the keys every run saves)."""
    try:
        record = json.loads(raw)
    except (ValueError, TypeError) as e:
        raise StoreError(f"the run log's record of run {run_id} is damaged ({e}); delete it with "
                         f"sqlite3 catalog.sqlite \"DELETE FROM runs WHERE run_id = '{run_id}'\"") from None
    if not isinstance(record, dict) or not all(k in record for k in RECORD_KEYS):
        raise StoreError(f"the run log's record of run {run_id} is damaged (not a run record); delete it with "
                         f"sqlite3 catalog.sqlite \"DELETE FROM runs WHERE run_id = '{run_id}'\"")
    return record


RECORD_KEYS = ("queries",)  # what `stats` needs of every run (older records may lack the rest)


class ObjectRunLog:
    """The run log of a store on object storage: ``runs/<run_id>.json`` per run, replaced by each save
    (a whole object, so a reader sees one save or the next), ordered by the time of the run's first save."""

    def __init__(self, objects: Objects):
        self._objects = objects
        self._started: dict[str, str] = {}  # run id -> its first save, for the runs this process saves

    def save(self, run_id: str, record: dict) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
            raise StoreError(f"run id {run_id!r} cannot name an object: use letters, digits, '_', '.' and '-'")
        started = self._started.setdefault(run_id, datetime.now(timezone.utc).isoformat())
        entry = {"run_id": run_id, "created": started, "record": record}
        self._objects.put(f"{RUNS}/{run_id}.json", json.dumps(entry, sort_keys=True).encode())

    def records(self) -> list[dict]:
        """The records, oldest first."""
        keys = [key for key, _ in self._objects.keys(f"{RUNS}/") if key.endswith(".json")]
        entries = []
        for key, raw in zip(keys, self._objects.get_many(keys)):
            if raw is None:
                continue  # deleted since the listing
            try:
                entry = json.loads(raw)
                entries.append((entry["created"], entry["run_id"], entry["record"]))
            except (ValueError, KeyError, TypeError) as e:
                raise StoreError(f"{self._objects.where(key)} is not a run record ({e}); delete it") from None
        return [record for *_, record in sorted(entries, key=lambda e: e[:2])]

    def count(self) -> int:
        return sum(1 for key, _ in self._objects.keys(f"{RUNS}/") if key.endswith(".json"))
