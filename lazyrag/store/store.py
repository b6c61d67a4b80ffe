"""The on-disk store of reusable chunk KV (DESIGN section 4).

Layout of a store directory::

    zarr.json            zarr v3 root group; attributes["lazyrag"] holds the format
                         name and version, the settings, created time, lazyrag version
    segments/<name>/     one zarr array per append call, written whole, never changed:
                         shape [rows, num_layers, 2 (K, V), num_kv_heads, head_dim],
                         one shard holding the whole segment, inner chunks of one page,
                         uncompressed, so every stored chunk is one contiguous byte range
    catalog.sqlite       chunks, documents, segments, run log (SQLite, WAL)
    write.lock           held (flock) by the one process that may append

Keys are stored after RoPE at chunk-local positions; values as they are. bf16 has no
zarr dtype: its bits are stored as uint16 and ``kv_dtype`` names the logical dtype.

Crash safety: a segment's data is written and fsynced first, then its catalog rows
are committed in one transaction. A segment directory the catalog does not name is
an orphan (a crash between the two steps): readers never see it, and opening the
store for writing deletes it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, ShardingCodec

FORMAT_NAME = "lazyrag-kv"
FORMAT_VERSION = 1

CATALOG_FILE = "catalog.sqlite"
LOCK_FILE = "write.lock"
SEGMENTS = "segments"
ATTRS_KEY = "lazyrag"

KV_DTYPES = ("bfloat16", "float16", "float32")
_STORAGE_NP = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
_LOGICAL_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StoreError(Exception):
    """A store cannot be opened, read or written as asked."""


class StoreMismatch(StoreError):
    """The store was built with other settings (model, dtype, chunking, ...)."""


def storage_dtype(kv_dtype: str) -> np.dtype:
    """The numpy dtype kept on disk for a logical KV dtype (bf16 -> uint16 bits)."""
    try:
        return _STORAGE_NP[kv_dtype]
    except KeyError:
        raise StoreError(f"unsupported kv_dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}") from None


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a logical KV dtype."""
    storage_dtype(kv_dtype)
    return _LOGICAL_TORCH[kv_dtype]


def kv_to_storage(kv: torch.Tensor) -> np.ndarray:
    """A CPU tensor in a logical KV dtype -> the numpy array ``Store.append`` takes."""
    kv = kv.detach().cpu().contiguous()
    if kv.dtype == torch.bfloat16:
        return kv.view(torch.int16).numpy().view(np.uint16)
    if kv.dtype in (torch.float16, torch.float32):
        return kv.numpy()
    raise StoreError(f"unsupported KV tensor dtype {kv.dtype}")


@dataclass(frozen=True)
class StoreSettings:
    """Everything a store is built with; written into the root attributes at creation."""

    model: str  # display name, e.g. "smollm2-135m"
    fingerprint: str  # model fingerprint (hex)
    kv_dtype: str  # logical dtype: "bfloat16" | "float16" | "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # chunks are padded to whole pages
    preamble_ids: tuple[int, ...] = ()
    rope: dict = field(default_factory=dict)  # informational; the fingerprint covers it
    chunking: dict = field(default_factory=dict)  # e.g. {"chunk_tokens": 256, "splitter": ...}
    encoding: dict = field(default_factory=dict)  # e.g. {"attend": "preamble+self"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "preamble_ids", tuple(int(t) for t in self.preamble_ids))
        storage_dtype(self.kv_dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if int(getattr(self, name)) < 1:
                raise StoreError(f"{name} must be positive, got {getattr(self, name)}")

    def _compat_fields(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "kv_dtype": self.kv_dtype,
            "page_size": self.page_size,
            "preamble_ids": list(self.preamble_ids),
            "chunking": self.chunking,
            "encoding": self.encoding,
        }

    def compat_key(self) -> str:
        """sha256 (hex) over everything that must match for stored KV to be reused."""
        return hashlib.sha256(_canonical_json(self._compat_fields()).encode()).hexdigest()

    def to_json(self) -> dict:
        d = asdict(self)
        d["preamble_ids"] = list(self.preamble_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> StoreSettings:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def row_shape(self) -> tuple[int, int, int, int]:
        """The shape of one token's KV: [num_layers, 2, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.head_dim)

    def padded(self, length: int) -> int:
        """``length`` tokens rounded up to whole pages."""
        return math.ceil(length / self.page_size) * self.page_size


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _ids_blob(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _ids_from_blob(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype="<i4").tolist())


def chunk_id_for(settings: StoreSettings, token_ids: Sequence[int]) -> str:
    """The stable, content-addressed id of a chunk: 24 hex characters.

    It depends on the token ids and the store's compat key only (model fingerprint,
    KV dtype, page size, preamble, chunking and encoding settings), not on the
    document or on what precedes the chunk.
    """
    h = hashlib.sha256()
    h.update(settings.compat_key().encode())
    h.update(b"\0")
    h.update(_ids_blob(token_ids))
    return h.hexdigest()[:24]


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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _lazyrag_version() -> str:
    try:
        from importlib.metadata import version

        return version("lazyrag")
    except Exception:
        return "unknown"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


@dataclass
class _Segment:
    name: str
    file: Path  # the shard file holding the whole segment
    data_start: int  # byte offset of row 0 in that file, when rows are contiguous
    contiguous: bool
    fd: int | None = None


class Store:
    """A lazyrag KV store. Use :meth:`create_or_open` to index, :meth:`open` to read."""

    def __init__(self, path: Path, settings: StoreSettings, attrs: dict, *, writable: bool, lock_fd: int | None):
        self.path = path
        self.settings = settings
        self._attrs = attrs
        self._writable = writable
        self._storage = storage_dtype(settings.kv_dtype)
        self._row_bytes = int(np.prod(settings.row_shape)) * self._storage.itemsize
        self._db_lock = threading.RLock()
        self._db = sqlite3.connect(path / CATALOG_FILE, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._segments: dict[str, _Segment] = {}
        self._seg_lock = threading.Lock()
        self._lock_fd = lock_fd  # last: a Store that failed to construct never closes it

    # -- opening -------------------------------------------------------------

    @classmethod
    def create_or_open(cls, path: str | Path, settings: StoreSettings) -> Store:
        """Open a store for appending, creating it if ``path`` does not exist.

        An existing store must have been built with the same settings (compat key);
        otherwise :class:`StoreMismatch`. Orphan segments left by a crash are deleted.
        Only one process may hold a store open for writing at a time.
        """
        path = Path(path)
        if not (path / "zarr.json").exists():
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                raise StoreError(f"{path} exists and is not a lazyrag store; choose another --store path")
            cls._create(path, settings)
        lock_fd = cls._take_write_lock(path)
        try:
            attrs = cls._read_attrs(path)
            stored = StoreSettings.from_json(attrs["settings"])
            if stored.compat_key() != settings.compat_key():
                raise StoreMismatch(_mismatch_message(path, stored, settings))
            store = cls(path, stored, attrs, writable=True, lock_fd=lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise
        try:
            store._delete_orphans()
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def open(cls, path: str | Path) -> Store:
        """Open an existing store to read it (and to append run records)."""
        path = Path(path)
        if not path.exists():
            raise StoreError(f"no store at {path}: build one with `lazyrag index CORPUS --store {path}`")
        attrs = cls._read_attrs(path)
        return cls(path, StoreSettings.from_json(attrs["settings"]), attrs, writable=False, lock_fd=None)

    @classmethod
    def _create(cls, path: Path, settings: StoreSettings) -> None:
        # Build the skeleton in a sibling temp directory and rename it into place, so
        # a crash never leaves a half-made store at `path`.
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.creating-", dir=path.parent))
        try:
            attrs = {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "settings": settings.to_json(),
                "compat_key": settings.compat_key(),
                "created": _now(),
                "lazyrag_version": _lazyrag_version(),
                "kv_layout": ["token", "layer", "kv", "kv_head", "head_dim"],
                "kv_storage_dtype": str(storage_dtype(settings.kv_dtype)),
            }
            zarr.open_group(str(tmp), mode="w", attributes={ATTRS_KEY: attrs})
            db = sqlite3.connect(tmp / CATALOG_FILE)
            db.executescript(_SCHEMA)
            db.execute("INSERT INTO meta VALUES ('updated', ?)", (attrs["created"],))
            db.commit()
            db.close()
            (tmp / LOCK_FILE).touch()
            _fsync_tree(tmp)
            try:
                os.rename(tmp, path)  # replaces an empty directory; fails on a non-empty one
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (path / "zarr.json").exists():
                    return  # another process created it first
                raise
            _fsync_path(path.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _read_attrs(path: Path) -> dict:
        meta_file = path / "zarr.json"
        try:
            meta = json.loads(meta_file.read_text())
        except FileNotFoundError:
            raise StoreError(f"{path} is not a lazyrag store (no zarr.json)") from None
        except (OSError, ValueError) as e:
            raise StoreError(f"{path} is not a lazyrag store ({meta_file}: {e})") from None
        attrs = (meta.get("attributes") or {}).get(ATTRS_KEY)
        if not isinstance(attrs, dict) or attrs.get("format") != FORMAT_NAME:
            raise StoreError(f"{path} is a zarr group but not a lazyrag store")
        version = attrs.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise StoreError(
                f"{path} has store format version {version}, newer than this lazyrag "
                f"supports ({FORMAT_VERSION}); upgrade lazyrag"
            )
        if not (path / CATALOG_FILE).exists():
            raise StoreError(f"{path} is damaged: {CATALOG_FILE} is missing")
        return attrs

    @staticmethod
    def _take_write_lock(path: Path) -> int:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"{path} is being written by another process (lazyrag index); wait for it to finish") from None
        return fd

    def close(self) -> None:
        """Close files and the catalog and release the write lock (idempotent)."""
        try:
            with self._seg_lock:
                for seg in self._segments.values():
                    if seg.fd is not None:
                        os.close(seg.fd)
                        seg.fd = None
                self._segments.clear()
            with self._db_lock:
                self._db.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _delete_orphans(self) -> None:
        seg_dir = self.path / SEGMENTS
        if not seg_dir.is_dir():
            return
        with self._db_lock:
            known = {r[0] for r in self._db.execute("SELECT name FROM segments")}
        for child in seg_dir.iterdir():
            if child.is_dir() and child.name not in known:
                shutil.rmtree(child)

    # -- writing -------------------------------------------------------------

    def has_chunk(self, chunk_id: str) -> bool:
        with self._db_lock:
            return self._db.execute("SELECT 1 FROM chunks WHERE chunk_id = ?", (chunk_id,)).fetchone() is not None

    def append(self, chunks: Sequence[NewChunk], kv: np.ndarray) -> None:
        """Store the KV of ``chunks``: one new segment, durable, then one catalog commit.

        ``kv`` has shape ``[sum of padded lengths, num_layers, 2, num_kv_heads,
        head_dim]`` in the storage dtype (``storage_dtype(kv_dtype)``; see
        ``kv_to_storage``); chunk i occupies its padded length of rows, in order.
        Chunks already in the store (or repeated in ``chunks``) are not written
        again, but their (doc_id, ordinal) references are recorded.
        """
        self._check_writable()
        s = self.settings
        if not isinstance(kv, np.ndarray):
            raise StoreError(f"kv must be a numpy array, got {type(kv).__name__}")
        if kv.dtype.newbyteorder("<") != self._storage or kv.dtype.itemsize != self._storage.itemsize:
            raise StoreError(f"kv dtype {kv.dtype} does not match the store's storage dtype {self._storage} ({s.kv_dtype})")
        spans = []
        row = 0
        for c in chunks:
            if not c.token_ids:
                raise StoreError(f"chunk {c.chunk_id} of {c.doc_id!r} has no tokens")
            padded = s.padded(len(c.token_ids))
            spans.append((row, padded))
            row += padded
        if kv.shape != (row, *s.row_shape):
            raise StoreError(f"kv has shape {kv.shape}, expected {(row, *s.row_shape)} for these chunks")

        with self._db_lock:
            present = set()
            for c in chunks:
                if c.chunk_id not in present and self.has_chunk(c.chunk_id):
                    present.add(c.chunk_id)
        new_rows = []  # (chunk, source row, padded, segment offset)
        taken = set(present)
        offset = 0
        for c, (src, padded) in zip(chunks, spans):
            if c.chunk_id in taken:
                continue
            taken.add(c.chunk_id)
            new_rows.append((c, src, padded, offset))
            offset += padded

        segment = None
        if new_rows:
            if offset == kv.shape[0]:
                data = np.ascontiguousarray(kv)
            else:
                data = np.concatenate([kv[src : src + p] for _, src, p, _ in new_rows])
            if data.dtype != self._storage:
                data = data.astype(self._storage)
            segment = self._write_segment(data)
        self._commit(chunks, new_rows, segment, offset)

    def _write_segment(self, data: np.ndarray) -> str:
        """Write ``data`` as a new segment array and make it durable; return its name.

        The segment is a zarr v3 array with one shard (the whole segment) of
        uncompressed page-sized inner chunks. zarr writes the metadata; the shard file
        is written here in the sharding codec's own layout (the pages back to back in
        row order, then the index of (offset, nbytes) pairs), straight from ``data``
        with no intermediate copies: zarr's own encoder copies every page twice.
        """
        with self._db_lock:
            (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM segments").fetchone()
        name = f"seg-{seq:06d}-{secrets.token_hex(4)}"
        s = self.settings
        rows = data.shape[0]
        n_pages = rows // s.page_size
        arr = zarr.create_array(
            store=str(self.path),
            name=f"{SEGMENTS}/{name}",
            shape=data.shape,
            dtype=data.dtype,
            chunks=data.shape,
            serializer=ShardingCodec(
                chunk_shape=(s.page_size, *s.row_shape),
                codecs=[BytesCodec(endian="little")],
                index_codecs=[BytesCodec(endian="little")],
                index_location="end",
            ),
            filters=None,
            compressors=None,
            fill_value=0,
            attributes={"kv_dtype": s.kv_dtype},
            write_data=False,
        )
        arr_dir = self.path / SEGMENTS / name
        shard = arr_dir / arr.metadata.encode_chunk_key((0,) * data.ndim)
        shard.parent.mkdir(parents=True, exist_ok=True)
        page_bytes = s.page_size * self._row_bytes
        index = np.empty((n_pages, 2), dtype="<u8")
        index[:, 0] = np.arange(n_pages, dtype=np.uint64) * np.uint64(page_bytes)
        index[:, 1] = page_bytes
        fd = os.open(shard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in (memoryview(data).cast("B"), memoryview(index).cast("B")):
                done = 0
                while done < len(part):
                    done += os.write(fd, part[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_tree(arr_dir)
        _fsync_path(self.path / SEGMENTS)
        return name

    def _commit(self, chunks: Sequence[NewChunk], new_rows: list, segment: str | None, rows: int) -> None:
        """Make an appended segment visible: one transaction (the crash-safety point)."""
        now = _now()
        with self._db_lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if segment is not None:
                    db.execute(
                        "INSERT INTO segments (name, rows, nbytes, created) VALUES (?, ?, ?, ?)",
                        (segment, rows, rows * self._row_bytes, now),
                    )
                    db.executemany(
                        "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)",
                        [
                            (c.chunk_id, segment, off, len(c.token_ids), p, _ids_blob(c.token_ids), c.text)
                            for c, _src, p, off in new_rows
                        ],
                    )
                self._insert_refs(db, [(c.doc_id, c.ordinal, c.chunk_id) for c in chunks])
                db.execute("INSERT OR REPLACE INTO meta VALUES ('updated', ?)", (now,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    @staticmethod
    def _insert_refs(db: sqlite3.Connection, refs: list[tuple[str, int, str]]) -> None:
        Store._insert_docs(db, [r[0] for r in refs])
        db.executemany("INSERT OR REPLACE INTO doc_chunks VALUES (?, ?, ?)", refs)

    @staticmethod
    def _insert_docs(db: sqlite3.Connection, doc_ids: Iterable[str]) -> None:
        (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM documents").fetchone()
        new = []
        for d in dict.fromkeys(doc_ids):
            if db.execute("SELECT 1 FROM documents WHERE doc_id = ?", (d,)).fetchone() is None:
                seq += 1
                new.append((d, seq))
        db.executemany("INSERT INTO documents VALUES (?, ?)", new)

    def link(self, chunks: Sequence[NewChunk]) -> None:
        """Record (doc_id, ordinal) -> chunk references without writing KV: for a
        document whose chunks are stored already (shared with another document), or
        are still on their way to the store. A reference shows in ``doc_chunks`` once
        its chunk is stored. Its document counts in ``documents()`` at once."""
        self._check_writable()
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._insert_refs(self._db, [(c.doc_id, c.ordinal, c.chunk_id) for c in chunks])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def note_documents(self, doc_ids: Iterable[str]) -> None:
        """Record document ids as seen (documents whose chunks all existed already)."""
        self._check_writable()
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._insert_docs(self._db, doc_ids)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _check_writable(self) -> None:
        if not self._writable:
            raise StoreError(f"{self.path} was opened read-only; use Store.create_or_open to append")

    # -- reading the catalog ---------------------------------------------------

    _CHUNK_COLS = (
        "c.chunk_id, COALESCE(r.doc_id, ''), COALESCE(r.ordinal, 0), c.token_ids, c.text, "
        "c.segment, c.offset, c.length, c.padded_length"
    )

    @staticmethod
    def _info(row: tuple) -> ChunkInfo:
        cid, doc, ordinal, blob, text, seg, off, length, padded = row
        return ChunkInfo(cid, doc, ordinal, _ids_from_blob(blob), text, seg, off, length, padded)

    def chunk(self, chunk_id: str) -> ChunkInfo:
        """A stored chunk. ``doc_id``/``ordinal`` name the first document that has it."""
        with self._db_lock:
            row = self._db.execute(
                f"SELECT {self._CHUNK_COLS} FROM chunks c LEFT JOIN doc_chunks r ON r.rowid = "
                "(SELECT MIN(rowid) FROM doc_chunks WHERE chunk_id = c.chunk_id) WHERE c.chunk_id = ?",
                (chunk_id,),
            ).fetchone()
        if row is None:
            raise StoreError(f"unknown chunk id {chunk_id!r} in store {self.path}")
        return self._info(row)

    def doc_chunks(self, doc_id: str) -> list[ChunkInfo]:
        """A document's chunks, ordered by ordinal ([] for an unknown document)."""
        with self._db_lock:
            rows = self._db.execute(
                f"SELECT {self._CHUNK_COLS} FROM doc_chunks r JOIN chunks c ON c.chunk_id = r.chunk_id "
                "WHERE r.doc_id = ? ORDER BY r.ordinal",
                (doc_id,),
            ).fetchall()
        return [self._info(r) for r in rows]

    def documents(self) -> list[str]:
        """Document ids, in the order they were first recorded."""
        with self._db_lock:
            return [r[0] for r in self._db.execute("SELECT doc_id FROM documents ORDER BY seq")]

    def iter_chunks(self) -> Iterator[ChunkInfo]:
        """Every stored chunk, in storage order (segment, then offset)."""
        with self._db_lock:
            rows = self._db.execute(
                f"SELECT {self._CHUNK_COLS} FROM chunks c JOIN segments s ON s.name = c.segment "
                "LEFT JOIN doc_chunks r ON r.rowid = (SELECT MIN(rowid) FROM doc_chunks WHERE chunk_id = c.chunk_id) "
                "ORDER BY s.seq, c.offset"
            ).fetchall()
        for r in rows:
            yield self._info(r)

    @property
    def num_chunks(self) -> int:
        with self._db_lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    # -- reading KV --------------------------------------------------------------

    def _segment(self, name: str) -> _Segment:
        with self._seg_lock:
            seg = self._segments.get(name)
            if seg is not None:
                return seg
            seg = self._load_segment(name)
            self._segments[name] = seg
            return seg

    def _load_segment(self, name: str) -> _Segment:
        arr_dir = self.path / SEGMENTS / name
        try:
            meta = json.loads((arr_dir / "zarr.json").read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"store {self.path}: segment {name} is missing or damaged ({e})") from None
        rows = meta["shape"][0]
        file = arr_dir.joinpath("c", *(["0"] * len(meta["shape"])))
        seg = _Segment(name=name, file=file, data_start=0, contiguous=False)
        # The fast path reads rows straight from the shard file. It needs the layout
        # this module writes: one shard, uncompressed page-sized inner chunks stored
        # back to back in row order. Check that against the shard index; otherwise
        # fall back to reading through zarr.
        codecs = meta.get("codecs", [])
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return seg
        conf = codecs[0]["configuration"]
        inner = conf["codecs"]
        if [c["name"] for c in inner] != ["bytes"] or inner[0].get("configuration", {}).get("endian", "little") != "little":
            return seg
        if conf["chunk_shape"][0] != self.settings.page_size or meta["chunk_grid"]["configuration"]["chunk_shape"][0] != rows:
            return seg
        n_pages = rows // self.settings.page_size
        index_codecs = [c["name"] for c in conf.get("index_codecs", [])]
        if index_codecs not in (["bytes"], ["bytes", "crc32c"]):
            return seg
        index_bytes = n_pages * 16 + (4 if "crc32c" in index_codecs else 0)
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                if conf.get("index_location", "end") == "end":
                    f.seek(size - index_bytes)
                raw = f.read(index_bytes)
        except OSError as e:
            raise StoreError(f"store {self.path}: cannot read segment {name} ({e})") from None
        index = np.frombuffer(raw[: n_pages * 16], dtype="<u8").reshape(n_pages, 2)
        page_bytes = self.settings.page_size * self._row_bytes
        expected = index[0, 0] + np.arange(n_pages, dtype=np.uint64) * np.uint64(page_bytes)
        if np.all(index[:, 1] == page_bytes) and np.array_equal(index[:, 0], expected):
            seg.data_start = int(index[0, 0])
            seg.contiguous = True
            seg.fd = os.open(file, os.O_RDONLY)
        return seg

    def read_kv(self, chunk: ChunkInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        """A chunk's KV: ``[padded_length, num_layers, 2, num_kv_heads, head_dim]`` in
        the logical dtype (K rotated at chunk-local positions, then V). Rows past
        ``length`` are padding, as the writer gave them. With ``out`` (a contiguous CPU tensor of that
        shape and dtype, e.g. pinned memory) the data is read into it and it is returned.
        Safe to call from several threads.
        """
        s = self.settings
        shape = (chunk.padded_length, *s.row_shape)
        dtype = _LOGICAL_TORCH[s.kv_dtype]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise StoreError(
                f"out must be a contiguous CPU tensor of shape {shape} and dtype {dtype}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        seg = self._segment(chunk.segment)
        buf = out.view(-1).view(torch.uint8).numpy()
        if seg.contiguous and seg.fd is not None:
            _pread_into(seg.fd, memoryview(buf), seg.data_start + chunk.offset * self._row_bytes, seg.file)
        else:
            arr = zarr.open_array(str(self.path / SEGMENTS / chunk.segment), mode="r")
            data = arr[chunk.offset : chunk.offset + chunk.padded_length]
            buf[:] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        return out

    # -- run log and summary -----------------------------------------------------

    def add_run(self, record: dict) -> None:
        """Append one JSON record to the run log (atomic)."""
        text = json.dumps(record, sort_keys=True)
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO runs (created, record) VALUES (?, ?)", (_now(), text))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def runs(self) -> list[dict]:
        """The run log, oldest first."""
        with self._db_lock:
            return [json.loads(r[0]) for r in self._db.execute("SELECT record FROM runs ORDER BY id")]

    def max_padded_length(self) -> int:
        """Rows of the longest stored chunk (0 for an empty store)."""
        with self._db_lock:
            return self._db.execute("SELECT COALESCE(MAX(padded_length), 0) FROM chunks").fetchone()[0]

    def summary(self) -> dict:
        """Store numbers for ``lazyrag stats``."""
        s = self.settings
        with self._db_lock:
            db = self._db
            documents = db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
            chunks, tokens, padded = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0), COALESCE(SUM(padded_length), 0) FROM chunks"
            ).fetchone()
            segments = db.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
            updated = db.execute("SELECT value FROM meta WHERE key = 'updated'").fetchone()
            runs = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        return {
            "documents": documents,
            "chunks": chunks,
            "tokens": tokens,
            "padded_tokens": padded,
            "kv_bytes": padded * self._row_bytes,
            "bytes": _disk_usage(self.path),
            "model": s.model,
            "fingerprint": s.fingerprint,
            "kv_dtype": s.kv_dtype,
            "page_size": s.page_size,
            "segments": segments,
            "runs": runs,
            "created": self._attrs.get("created"),
            "updated": updated[0] if updated else self._attrs.get("created"),
        }


def _pread_into(fd: int, view: memoryview, offset: int, file: Path) -> None:
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise StoreError(f"{file}: unexpected end of file at byte {offset + done}")
        done += n


def _disk_usage(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _mismatch_message(path: Path, stored: StoreSettings, wanted: StoreSettings) -> str:
    lines = [f"store {path} was built with other settings and cannot be reused:"]
    if stored.fingerprint != wanted.fingerprint:
        lines.append(
            f"  model fingerprint: store has {stored.fingerprint} ({stored.model}), "
            f"this run has {wanted.fingerprint} ({wanted.model})"
        )
    a, b = stored._compat_fields(), wanted._compat_fields()
    for key in a:
        if key != "fingerprint" and a[key] != b[key]:
            lines.append(f"  {key}: store has {_canonical_json(a[key])}, this run has {_canonical_json(b[key])}")
    lines.append("choose a new --store path (or delete the old store) to index with these settings")
    return "\n".join(lines)
