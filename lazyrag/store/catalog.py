"""The SQLite catalog: segments, stored chunks, documents and their chunk references, the run log's table.

Every write is one transaction (:meth:`Catalog.transaction`): a chunk becomes visible
only in the commit that also names its segment.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .format import timestamp, token_ids_bytes, token_ids_from_bytes

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
    text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS documents (doc_id TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS doc_chunks (
    doc_id TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    chunk_id TEXT NOT NULL REFERENCES chunks(chunk_id),
    PRIMARY KEY (doc_id, ordinal)
);
CREATE INDEX IF NOT EXISTS doc_chunks_by_chunk ON doc_chunks(chunk_id);
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, created TEXT NOT NULL, record TEXT NOT NULL);
"""

# A chunk's columns; doc_id/ordinal come from its first reference (rowid order).
_CHUNK_COLS = (
    "c.chunk_id, COALESCE(r.doc_id, ''), COALESCE(r.ordinal, 0), c.token_ids, c.text, "
    "c.segment, c.offset, c.length, c.padded_length"
)
_FIRST_REF = "LEFT JOIN doc_chunks r ON r.rowid = (SELECT MIN(rowid) FROM doc_chunks WHERE chunk_id = c.chunk_id)"


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
    """A stored chunk. ``offset`` and ``padded_length`` are rows of ``segment``."""

    chunk_id: str
    doc_id: str
    ordinal: int
    token_ids: tuple[int, ...]
    text: str
    segment: str
    offset: int
    length: int
    padded_length: int


def _info(row: tuple) -> ChunkInfo:
    cid, doc, ordinal, blob, text, seg, off, length, padded = row
    return ChunkInfo(cid, doc, ordinal, token_ids_from_bytes(blob), text, seg, off, length, padded)


def _insert_docs(db: sqlite3.Connection, doc_ids: Iterable[str]) -> None:
    (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM documents").fetchone()
    new = []
    for d in dict.fromkeys(doc_ids):
        if db.execute("SELECT 1 FROM documents WHERE doc_id = ?", (d,)).fetchone() is None:
            seq += 1
            new.append((d, seq))
    db.executemany("INSERT INTO documents VALUES (?, ?)", new)


def _insert_refs(db: sqlite3.Connection, chunks: Sequence[NewChunk]) -> None:
    refs = [(c.doc_id, c.ordinal, c.chunk_id) for c in chunks]
    _insert_docs(db, [r[0] for r in refs])
    db.executemany("INSERT OR REPLACE INTO doc_chunks VALUES (?, ?, ?)", refs)


class Catalog:
    """One store's catalog file, shared by the threads of one process (one connection, one lock)."""

    def __init__(self, file: Path):
        self._lock = threading.RLock()
        self._db = sqlite3.connect(file, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    @staticmethod
    def create(file: Path, created: str) -> None:
        """Write a new, empty catalog at ``file``, last updated at ``created``."""
        db = sqlite3.connect(file)
        db.executescript(_SCHEMA)
        db.execute("INSERT INTO meta VALUES ('updated', ?)", (created,))
        db.commit()
        db.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The connection, held by this thread for a few reads."""
        with self._lock:
            yield self._db

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

    # -- writes ----------------------------------------------------------------

    def commit_append(
        self,
        chunks: Sequence[NewChunk],
        segment: str | None,
        placed: Sequence[tuple[NewChunk, int, int]],
        rows: int,
        nbytes: int,
    ) -> None:
        """Make an appended segment visible (the crash-safety point): the segment of
        ``rows`` rows and ``nbytes`` bytes, its chunks ``placed`` as (chunk, offset,
        padded length), and the references of all ``chunks``, in one transaction."""
        now = timestamp()
        with self.transaction() as db:
            if segment is not None:
                db.execute(
                    "INSERT INTO segments (name, rows, nbytes, created) VALUES (?, ?, ?, ?)",
                    (segment, rows, nbytes, now),
                )
                db.executemany(
                    "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (c.chunk_id, segment, off, len(c.token_ids), p, token_ids_bytes(c.token_ids), c.text)
                        for c, off, p in placed
                    ],
                )
            _insert_refs(db, chunks)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (now,))

    def link(self, chunks: Sequence[NewChunk]) -> None:
        """Record the (doc_id, ordinal) -> chunk references of ``chunks`` and their documents."""
        with self.transaction() as db:
            _insert_refs(db, chunks)

    def note_documents(self, doc_ids: Iterable[str]) -> None:
        """Record document ids not seen before, in order."""
        with self.transaction() as db:
            _insert_docs(db, doc_ids)

    # -- lookups ---------------------------------------------------------------

    def has_chunk(self, chunk_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM chunks WHERE chunk_id = ?", (chunk_id,)).fetchone() is not None

    def stored(self, chunk_ids: Iterable[str]) -> set[str]:
        """Those of ``chunk_ids`` that are stored."""
        with self._lock:
            present: set[str] = set()
            for cid in chunk_ids:
                if cid not in present and self.has_chunk(cid):
                    present.add(cid)
            return present

    def chunk(self, chunk_id: str) -> ChunkInfo | None:
        """A stored chunk (None if unknown); ``doc_id``/``ordinal`` name its first document."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_CHUNK_COLS} FROM chunks c {_FIRST_REF} WHERE c.chunk_id = ?", (chunk_id,)
            ).fetchone()
        return None if row is None else _info(row)

    def doc_chunks(self, doc_id: str) -> list[ChunkInfo]:
        """A document's stored chunks, ordered by ordinal."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_CHUNK_COLS} FROM doc_chunks r JOIN chunks c ON c.chunk_id = r.chunk_id "
                "WHERE r.doc_id = ? ORDER BY r.ordinal",
                (doc_id,),
            ).fetchall()
        return [_info(r) for r in rows]

    def documents(self) -> list[str]:
        """Document ids, in the order they were first recorded."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT doc_id FROM documents ORDER BY seq")]

    def iter_chunks(self) -> Iterator[ChunkInfo]:
        """Every stored chunk, in storage order (segment, then offset)."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_CHUNK_COLS} FROM chunks c JOIN segments s ON s.name = c.segment {_FIRST_REF} "
                "ORDER BY s.seq, c.offset"
            ).fetchall()
        for r in rows:
            yield _info(r)

    def num_chunks(self) -> int:
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
        """documents, chunks, tokens, padded_tokens, segments, and ``updated`` (None if never set)."""
        with self._lock:
            db = self._db
            documents = db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            chunks, tokens, padded = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0), COALESCE(SUM(padded_length), 0) FROM chunks"
            ).fetchone()
            segments = db.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
            updated = db.execute("SELECT value FROM meta WHERE key = 'updated'").fetchone()
        return {
            "documents": documents,
            "chunks": chunks,
            "tokens": tokens,
            "padded_tokens": padded,
            "segments": segments,
            "updated": updated[0] if updated else None,
        }
