"""The SQLite catalog: segments, stored chunks, documents and their chunk lists, the run log's table.

Every write is one transaction (:meth:`Catalog.transaction`): a chunk becomes visible
only in the commit that also names its segment. A document's chunk list is a version:
a new one waits in ``pending_chunks`` and replaces the published list (``doc_chunks``) in
the transaction that stores its last missing chunk, so readers see a document whole or
not at all. A chunk is referenced by every list naming it; one that no list names is
dead and compaction reclaims it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .format import DocumentIncomplete, StoreError, timestamp, token_ids_bytes, token_ids_from_bytes

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    seq INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    rows INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    created TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    chunk_id TEXT PRIMARY KEY,
    segment TEXT NOT NULL REFERENCES segments(name),
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    padded_length INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    text TEXT NOT NULL,
    checksum INTEGER
);
CREATE TABLE IF NOT EXISTS documents (doc_id TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS doc_chunks (
    doc_id TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    chunk_id TEXT NOT NULL REFERENCES chunks(chunk_id),
    PRIMARY KEY (doc_id, ordinal)
);
CREATE INDEX IF NOT EXISTS doc_chunks_by_chunk ON doc_chunks(chunk_id);
CREATE TABLE IF NOT EXISTS pending_chunks (
    doc_id TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    chunk_id TEXT NOT NULL,
    PRIMARY KEY (doc_id, ordinal)
);
CREATE INDEX IF NOT EXISTS pending_chunks_by_chunk ON pending_chunks(chunk_id);
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, created TEXT NOT NULL, record TEXT NOT NULL, run_id TEXT);
"""

# A chunk's columns; doc_id/ordinal come from its first reference (rowid order).
_CHUNK_COLS = (
    "c.chunk_id, COALESCE(r.doc_id, ''), COALESCE(r.ordinal, 0), c.token_ids, c.text, "
    "c.segment, c.offset, c.length, c.padded_length, c.checksum"
)
_FIRST_REF = "LEFT JOIN doc_chunks r ON r.rowid = (SELECT MIN(rowid) FROM doc_chunks WHERE chunk_id = c.chunk_id)"
_REFERENCED = (
    "(EXISTS (SELECT 1 FROM doc_chunks WHERE chunk_id = c.chunk_id) "
    "OR EXISTS (SELECT 1 FROM pending_chunks WHERE chunk_id = c.chunk_id))"
)


@dataclass(frozen=True)
class NewChunk:
    """A chunk to append: its id (``chunk_id_for``), where it comes from, its tokens."""

    chunk_id: str
    doc_id: str
    ordinal: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class ChunkInfo:
    """A stored chunk. ``offset`` and ``padded_length`` are rows of ``segment``; ``checksum``
    is the crc32c of those rows as written (None: not recorded, nothing to verify)."""

    chunk_id: str
    doc_id: str
    ordinal: int
    token_ids: tuple[int, ...]
    text: str
    segment: str
    offset: int
    length: int
    padded_length: int
    checksum: int | None = None


@dataclass(frozen=True)
class SegmentRow:
    """A segment as the catalog records it."""

    name: str
    rows: int
    nbytes: int


def _info(row: tuple) -> ChunkInfo:
    cid, doc, ordinal, blob, text, seg, off, length, padded, crc = row
    return ChunkInfo(cid, doc, ordinal, token_ids_from_bytes(blob), text, seg, off, length, padded, crc)


def _first_of_each(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: set[str] = set()
    first = []
    for chunk_id, text in rows:
        if chunk_id not in seen:
            seen.add(chunk_id)
            first.append((chunk_id, text))
    return first


def _publish(db: sqlite3.Connection, doc_ids: Iterable[str]) -> None:
    """Make the pending version of each of ``doc_ids`` its published chunk list, where all its
    chunks are stored."""
    for doc in dict.fromkeys(doc_ids):
        listed, stored = db.execute(
            "SELECT COUNT(*), COUNT(c.chunk_id) FROM pending_chunks p "
            "LEFT JOIN chunks c ON c.chunk_id = p.chunk_id WHERE p.doc_id = ?", (doc,)).fetchone()
        if not listed or stored < listed:
            continue
        db.execute("DELETE FROM doc_chunks WHERE doc_id = ?", (doc,))
        db.execute("INSERT INTO doc_chunks SELECT doc_id, ordinal, chunk_id FROM pending_chunks WHERE doc_id = ?", (doc,))
        db.execute("DELETE FROM pending_chunks WHERE doc_id = ?", (doc,))
        if db.execute("SELECT 1 FROM documents WHERE doc_id = ?", (doc,)).fetchone() is None:
            db.execute("INSERT INTO documents SELECT ?, COALESCE(MAX(seq), 0) + 1 FROM documents", (doc,))


def record_segment(db: sqlite3.Connection, segment: str, placed: Sequence[tuple[NewChunk, int, int, int]],
                   rows: int, nbytes: int, now: str) -> None:
    """:meth:`Catalog.commit_append` inside the transaction ``db``, at time ``now``."""
    db.execute("INSERT INTO segments (name, rows, nbytes, created) VALUES (?, ?, ?, ?)",
               (segment, rows, nbytes, now))
    db.executemany(
        "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(c.chunk_id, segment, off, len(c.token_ids), p, token_ids_bytes(c.token_ids), c.text, crc)
         for c, off, p, crc in placed],
    )
    docs = [r[0] for c, *_ in placed
            for r in db.execute("SELECT DISTINCT doc_id FROM pending_chunks WHERE chunk_id = ?", (c.chunk_id,))]
    _publish(db, docs)
    db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (now,))


def record_documents(db: sqlite3.Connection, docs: Mapping[str, Sequence[str]], now: str) -> None:
    """:meth:`Catalog.put_documents` inside the transaction ``db``, at time ``now``."""
    for doc, chunk_ids in docs.items():
        db.execute("DELETE FROM pending_chunks WHERE doc_id = ?", (doc,))
        current = [r[0] for r in db.execute(
            "SELECT chunk_id FROM doc_chunks WHERE doc_id = ? ORDER BY ordinal", (doc,))]
        if current != list(chunk_ids):
            db.executemany("INSERT INTO pending_chunks VALUES (?, ?, ?)",
                           [(doc, i, cid) for i, cid in enumerate(chunk_ids)])
    _publish(db, docs)
    db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (now,))


def _connect_frozen(file: Path) -> sqlite3.Connection:
    """A read-only connection to the catalog of a store that cannot be written."""
    wal = file.with_name(file.name + "-wal")
    pending = wal.exists() and wal.stat().st_size > 0
    # immutable: no locks and no WAL index (-shm), which a read-only filesystem cannot hold; safe
    # only because no process can write the catalog there. It ignores the WAL, so a WAL left holding
    # commits (by a writer that crashed) is read through the WAL index it left instead.
    uri = file.absolute().as_uri() + ("?mode=ro" if pending else "?mode=ro&immutable=1")
    db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
    try:
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as e:
        db.close()
        if pending:
            raise StoreError(f"{file}: changes in {wal.name} cannot be read here ({e}); open the store once "
                             "where it can be written (`lazyrag stats`) to merge them into the catalog") from None
        raise
    return db


# Tables every format's catalog has; the schema script adds only what a newer format added.
_CORE_TABLES = {"meta", "segments", "chunks"}


def _require_tables(db: sqlite3.Connection, file: Path) -> None:
    """Refuse a catalog without the core tables (an emptied or foreign file) before anything writes
    to it: bringing the schema up to date would turn it into an empty catalog and orphan the data."""
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    missing = _CORE_TABLES - names
    if missing:
        raise StoreError(f"{file} is not a lazyrag catalog (no {', '.join(sorted(missing))} table"
                         f"{'s' if len(missing) > 1 else ''}: emptied or replaced); the store cannot be used as "
                         "it is: rebuild it with `lazyrag index CORPUS` into a new --store")


class Catalog:
    """One store's catalog file, shared by the threads of one process (one connection, one lock)."""

    def __init__(self, file: Path, writable: bool = True, frozen: bool = False):
        """``writable``: this process stores chunks and documents (the schema is brought up to
        date); a reader only reads them and saves run records. ``frozen``: the store cannot be
        written at all (a read-only filesystem): read-only, without locks."""
        self._lock = threading.RLock()
        if frozen:
            self._db = _connect_frozen(file)
            _require_tables(self._db, file)
            return
        self._db = sqlite3.connect(file, check_same_thread=False, isolation_level=None, timeout=30)
        try:
            _require_tables(self._db, file)
        except BaseException:
            self._db.close()
            raise
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        if writable:
            self._db.executescript(_SCHEMA)

    @staticmethod
    def create(file: Path, created: str, store_id: str) -> None:
        """Write a new, empty catalog at ``file``, last updated at ``created``."""
        db = sqlite3.connect(file)
        db.executescript(_SCHEMA)
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("updated", created), ("store_id", store_id)])
        db.commit()
        db.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one read transaction: a consistent snapshot for a few reads."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction: committed at the end, rolled back on any exception."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def meta(self, key: str) -> str | None:
        with self.reading() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    # -- writes ----------------------------------------------------------------

    def commit_append(self, segment: str, placed: Sequence[tuple[NewChunk, int, int, int]], rows: int,
                      nbytes: int) -> None:
        """Make an appended segment visible (the crash-safety point): the segment of ``rows``
        rows and ``nbytes`` bytes and its chunks ``placed`` as (chunk, offset, padded length,
        checksum), in one transaction that also publishes the documents they complete. A chunk
        stored before is pointed at its new copy."""
        with self.transaction() as db:
            record_segment(db, segment, placed, rows, nbytes, timestamp())

    def put_documents(self, docs: Mapping[str, Sequence[str]]) -> None:
        """Record each document's chunk list (doc id -> chunk ids in order). A changed list
        becomes a pending version, published now if its chunks are all stored."""
        with self.transaction() as db:
            record_documents(db, docs, timestamp())

    def document_ids(self) -> set[str]:
        """Every document the catalog lists: published, or with a version still pending."""
        with self.reading() as db:
            return {r[0] for r in db.execute("SELECT doc_id FROM documents UNION SELECT doc_id FROM pending_chunks")}

    def remove_documents(self, doc_ids: Iterable[str]) -> None:
        """Take documents out of readers' view, with any pending version, in one transaction; the
        chunks only they listed become unreferenced, for compaction to reclaim."""
        with self.transaction() as db:
            for table in ("documents", "doc_chunks", "pending_chunks"):
                db.executemany(f"DELETE FROM {table} WHERE doc_id = ?", [(d,) for d in doc_ids])
            db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (timestamp(),))

    def changed_documents(self, docs: Mapping[str, Sequence[str]]) -> dict[str, Sequence[str]]:
        """Those of ``docs`` that :meth:`put_documents` would change: a list other than the published one,
        or a document with a pending version."""
        def published(db: sqlite3.Connection, doc: str) -> list[str]:
            return [r[0] for r in db.execute("SELECT chunk_id FROM doc_chunks WHERE doc_id = ? ORDER BY ordinal",
                                             (doc,))]

        with self.reading() as db:
            return {doc: ids for doc, ids in docs.items() if published(db, doc) != list(ids)
                    or db.execute("SELECT 1 FROM pending_chunks WHERE doc_id = ?", (doc,)).fetchone()}

    def replace_segment(self, old: str, new: str | None, placed: Sequence[tuple[str, int]], rows: int,
                        nbytes: int) -> None:
        """Compaction's commit: drop the dead chunks of segment ``old`` and the segment itself;
        its live chunks move to segment ``new`` at the offsets ``placed`` (chunk id, offset)."""
        with self.transaction() as db:
            if new is not None:
                db.execute("INSERT INTO segments (name, rows, nbytes, created) VALUES (?, ?, ?, ?)",
                           (new, rows, nbytes, timestamp()))
                db.executemany("UPDATE chunks SET segment = ?, offset = ? WHERE chunk_id = ?",
                               [(new, off, cid) for cid, off in placed])
            db.execute(f"DELETE FROM chunks AS c WHERE c.segment = ? AND NOT {_REFERENCED}", (old,))
            db.execute("DELETE FROM segments WHERE name = ?", (old,))

    # -- lookups ---------------------------------------------------------------

    def has_chunk(self, chunk_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM chunks WHERE chunk_id = ?", (chunk_id,)).fetchone() is not None

    def stored(self, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` that are stored."""
        with self._lock:
            return {cid for cid in set(chunk_ids) if self.has_chunk(cid)}

    def chunk(self, chunk_id: str) -> ChunkInfo | None:
        """A stored chunk (None if unknown); ``doc_id``/``ordinal`` name its first document."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_CHUNK_COLS} FROM chunks c {_FIRST_REF} WHERE c.chunk_id = ?", (chunk_id,)
            ).fetchone()
        return None if row is None else _info(row)

    def doc_chunks(self, doc_id: str) -> list[ChunkInfo]:
        """A published document's chunks, ordered by ordinal; [] for an unknown document;
        DocumentIncomplete for one whose first version is still being stored."""
        with self.reading() as db:
            rows = db.execute(
                f"SELECT {_CHUNK_COLS} FROM doc_chunks r JOIN chunks c ON c.chunk_id = r.chunk_id "
                "WHERE r.doc_id = ? ORDER BY r.ordinal",
                (doc_id,),
            ).fetchall()
            pending = None if rows else db.execute(
                "SELECT COUNT(*), COUNT(c.chunk_id) FROM pending_chunks p "
                "LEFT JOIN chunks c ON c.chunk_id = p.chunk_id WHERE p.doc_id = ?", (doc_id,)).fetchone()
        if pending and pending[0]:
            raise DocumentIncomplete(
                f"document {doc_id!r} is not indexed yet: {pending[1]} of its {pending[0]} chunks are stored; "
                "run `lazyrag index` on its corpus again to finish it")
        return [_info(r) for r in rows]

    def documents(self) -> list[str]:
        """Published document ids, in the order they were first published."""
        with self.reading() as db:
            return [r[0] for r in db.execute("SELECT doc_id FROM documents ORDER BY seq")]

    def iter_chunks(self, everything: bool = False) -> Iterator[ChunkInfo]:
        """The chunks of published documents (``everything``: every stored chunk), in storage
        order (segment, then offset)."""
        where = "" if everything else "WHERE EXISTS (SELECT 1 FROM doc_chunks d WHERE d.chunk_id = c.chunk_id)"
        with self.reading() as db:
            rows = db.execute(
                f"SELECT {_CHUNK_COLS} FROM chunks c JOIN segments s ON s.name = c.segment {_FIRST_REF} "
                f"{where} ORDER BY s.seq, c.offset"
            ).fetchall()
        for r in rows:
            yield _info(r)

    def retrieval_chunks(self) -> list[tuple[str, str]]:
        """(chunk id, text) of each chunk of published documents, once, ordered by the first
        (document id, ordinal) that lists it: an order that depends only on the documents, not
        on when or in which segments their chunks were stored."""
        with self.reading() as db:
            rows = db.execute("SELECT d.chunk_id, c.text FROM doc_chunks d JOIN chunks c ON c.chunk_id = d.chunk_id "
                              "ORDER BY d.doc_id, d.ordinal").fetchall()
        return _first_of_each(rows)

    def live_chunks(self, segment: str) -> list[ChunkInfo]:
        """The chunks of ``segment`` some document version references, by offset."""
        with self.reading() as db:
            rows = db.execute(
                f"SELECT {_CHUNK_COLS} FROM chunks c {_FIRST_REF} WHERE c.segment = ? AND {_REFERENCED} "
                "ORDER BY c.offset", (segment,)).fetchall()
        return [_info(r) for r in rows]

    def dangling_references(self) -> list[tuple[str, str]]:
        """(doc id, chunk id) of published references to chunks the catalog does not hold."""
        with self.reading() as db:
            return db.execute("SELECT doc_id, chunk_id FROM doc_chunks r WHERE NOT EXISTS "
                              "(SELECT 1 FROM chunks c WHERE c.chunk_id = r.chunk_id)").fetchall()

    def segments(self) -> list[SegmentRow]:
        """Every segment, oldest first."""
        with self.reading() as db:
            return [SegmentRow(*r) for r in db.execute("SELECT name, rows, nbytes FROM segments ORDER BY seq")]

    def num_chunks(self) -> int:
        """Stored chunks, referenced or not."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def max_padded_length(self) -> int:
        """Rows of the longest stored chunk (0 when there is none)."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(MAX(padded_length), 0) FROM chunks").fetchone()[0]

    def segment_names(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT name FROM segments")}

    def next_segment_seq(self) -> int:
        """The sequence number the next segment will get (numbers its name)."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM segments").fetchone()[0]

    def counts(self) -> dict:
        """Published documents, and the chunks they reference (chunks, tokens, padded_tokens);
        pending documents, unreferenced chunks, segments, and ``updated`` (None if never set)."""
        with self.reading() as db:
            documents = db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            chunks, tokens, padded = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0), COALESCE(SUM(padded_length), 0) FROM chunks c "
                "WHERE EXISTS (SELECT 1 FROM doc_chunks d WHERE d.chunk_id = c.chunk_id)"
            ).fetchone()
            pending = db.execute("SELECT COUNT(DISTINCT doc_id) FROM pending_chunks").fetchone()[0]
            unreferenced = db.execute(f"SELECT COUNT(*) FROM chunks c WHERE NOT {_REFERENCED}").fetchone()[0]
            segments = db.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
            updated = db.execute("SELECT value FROM meta WHERE key = 'updated'").fetchone()
        return {
            "documents": documents,
            "chunks": chunks,
            "tokens": tokens,
            "padded_tokens": padded,
            "pending_documents": pending,
            "unreferenced_chunks": unreferenced,
            "segments": segments,
            "updated": updated[0] if updated else None,
        }
