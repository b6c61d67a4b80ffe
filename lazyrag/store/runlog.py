"""The run log: one JSON record per ``answer`` run, kept in the store's catalog, read by ``stats``."""

from __future__ import annotations

import json

from .catalog import Catalog
from .format import timestamp


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
            return [json.loads(r[0]) for r in db.execute("SELECT record FROM runs ORDER BY id")]

    def count(self) -> int:
        with self._catalog.reading() as db:
            return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
