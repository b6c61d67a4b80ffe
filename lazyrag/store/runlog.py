"""The run log: one JSON record per ``answer`` run, appended to the store's catalog, read by ``stats``."""

from __future__ import annotations

import json

from .catalog import Catalog
from .format import timestamp


class RunLog:
    """The ``runs`` table of a catalog. Appending needs no write lock: readers may log their runs."""

    def __init__(self, catalog: Catalog):
        self._catalog = catalog

    def add(self, record: dict) -> None:
        """Append one JSON record (atomic)."""
        text = json.dumps(record, sort_keys=True)
        with self._catalog.transaction() as db:
            db.execute("INSERT INTO runs (created, record) VALUES (?, ?)", (timestamp(), text))

    def records(self) -> list[dict]:
        """The records, oldest first."""
        with self._catalog.reading() as db:
            return [json.loads(r[0]) for r in db.execute("SELECT record FROM runs ORDER BY id")]

    def count(self) -> int:
        with self._catalog.reading() as db:
            return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
