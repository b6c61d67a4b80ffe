"""The catalog of a store on object storage: an append-only log of manifests, replayed into a local catalog.

Each manifest is one catalog commit, as JSON: a segment with its chunk rows (ids, offsets, padded
lengths, token ids, text, checksums), or the chunk lists of documents. A writer writes a segment's
objects first and then commits its manifest at ``manifests/<seq>.json``, the next free number, with a
create-if-absent put: when another writer took that number, the writer replays it and tries the next.
Until its manifest is committed a segment is named by nothing, so a writer stopped half way leaves
objects no reader sees. Readers replay the log in order into a local SQLite catalog, remembering the
last number applied, through the same catalog writes a local store makes, so everything above the
catalog reads a store on object storage as it reads a local one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence

from .catalog import Catalog, NewChunk, record_documents, record_segment
from .format import StoreError, timestamp
from .objects import Objects

MANIFESTS = "manifests"
_APPLIED = "manifest_seq"  # the catalog's meta key for the last manifest applied


def manifest_key(seq: int) -> str:
    return f"{MANIFESTS}/{seq:012d}.json"


def segment_manifest(segment: str, placed: Sequence[tuple[NewChunk, int, int, int]], rows: int,
                     nbytes: int) -> dict:
    """The manifest of :meth:`Catalog.commit_append`'s arguments."""
    return {"kind": "segment", "time": timestamp(), "segment": {"name": segment, "rows": rows, "nbytes": nbytes},
            "chunks": [{"id": c.chunk_id, "offset": off, "padded_length": padded, "token_ids": list(c.token_ids),
                        "text": c.text, "checksum": crc} for c, off, padded, crc in placed]}


def documents_manifest(docs: Mapping[str, Sequence[str]]) -> dict:
    """The manifest of :meth:`Catalog.put_documents`'s argument."""
    return {"kind": "documents", "time": timestamp(), "documents": {d: list(ids) for d, ids in docs.items()}}


class ManifestLog:
    """The manifests of the store whose objects are ``objects``, and ``catalog``, the local catalog they
    are replayed into. Safe to use from several threads; several processes may share the catalog."""

    def __init__(self, objects: Objects, catalog: Catalog):
        self._objects, self._catalog = objects, catalog
        self._lock = threading.Lock()  # one commit at a time from this process: its threads never race

    def sync(self) -> None:
        """Apply, in order, every manifest committed after the last one the catalog holds."""
        with self._lock:
            self._sync()

    def commit(self, manifest: dict) -> int:
        """Commit ``manifest`` at the next free number and apply it; return its number."""
        body = json.dumps(manifest, sort_keys=True).encode()
        with self._lock:
            while True:
                self._sync()
                seq = self._applied() + 1
                if self._objects.create(manifest_key(seq), body):
                    self._apply(seq, manifest)
                    return seq
                # another writer committed this number first: replay it, then try the next one

    def _applied(self) -> int:
        return int(self._catalog.meta(_APPLIED) or 0)

    def _sync(self) -> None:
        applied = self._applied()
        # the listing finds the new manifests at once; fetching the next number until there is none
        # also catches one a listing has not shown yet
        listed = sorted(int(key[len(MANIFESTS) + 1:-len(".json")]) for key, _ in
                        self._objects.keys(f"{MANIFESTS}/", after=manifest_key(applied)) if key.endswith(".json"))
        run = [seq for i, seq in enumerate(listed) if seq == applied + 1 + i]  # stop at a gap
        for seq, raw in zip(run, self._objects.get_many(manifest_key(seq) for seq in run)):
            self._apply(seq, self._parse(seq, raw))
        seq = (run[-1] if run else applied) + 1
        while (raw := self._objects.get(manifest_key(seq))) is not None:
            self._apply(seq, self._parse(seq, raw))
            seq += 1

    def _parse(self, seq: int, raw: bytes | None) -> dict:
        try:
            manifest = json.loads(raw)
            if manifest["kind"] not in ("segment", "documents"):
                raise ValueError(f"unknown kind {manifest['kind']!r}")
            return manifest
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{self._objects.where(manifest_key(seq))} is damaged ({e}); the store cannot be "
                             "read past it: restore the object, or re-index into a new --store") from None

    def _apply(self, seq: int, manifest: dict) -> None:
        """Apply manifest ``seq`` and record it as applied, in one transaction; nothing when another
        process sharing the catalog has applied it already."""
        with self._catalog.transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (_APPLIED,)).fetchone()
            if int(row[0] if row else 0) >= seq:
                return
            try:
                _replay(db, manifest)
            except (KeyError, TypeError, ValueError) as e:
                raise StoreError(f"{self._objects.where(manifest_key(seq))} is damaged ({type(e).__name__}: {e}); "
                                 "restore the object, or re-index into a new --store") from None
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (_APPLIED, str(seq)))


def _replay(db, manifest: dict) -> None:
    if manifest["kind"] == "documents":
        record_documents(db, manifest["documents"], manifest["time"])
        return
    segment = manifest["segment"]
    if db.execute("SELECT 1 FROM segments WHERE name = ?", (segment["name"],)).fetchone():
        return  # committed twice (a retried put whose first try had landed): once is enough
    placed = [(NewChunk(c["id"], "", 0, tuple(c["token_ids"]), c["text"]), c["offset"], c["padded_length"],
               c["checksum"]) for c in manifest["chunks"]]
    record_segment(db, segment["name"], placed, segment["rows"], segment["nbytes"], manifest["time"])
