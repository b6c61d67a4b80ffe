"""The ``Store``: one directory of reusable chunk KV, its layout in format.py (docs/architecture.md,
"The store on disk"), or the same on object storage (lazyrag/store/storage.py, ``ObjectStorage``).

Crash safety: a segment's data is written and fsynced first, then its catalog rows
are committed in one transaction. A segment directory the catalog does not name is
an orphan (a crash between the two steps): readers never see it, and opening the
store for writing deletes it (lazyrag/store/integrity.py says which directories qualify).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr

from . import access
from .catalog import Catalog, ChunkInfo, NewChunk
from .compaction import CompactResult
from .format import (
    ATTRS_KEY,
    CATALOG_FILE,
    FORMAT_VERSION,
    LOCK_FILE,
    StoreError,
    StoreMismatch,
    StoreSettings,
    checksum,
    mismatch_message,
    read_root_attributes,
    root_attributes,
    storage_dtype,
)
from .integrity import CheckReport, Warn, check_store, delete_orphans, warn_stderr
from .location import StoreURL, store_location
from .locks import take_read_lock, take_write_lock
from .migration import upgrade
from .segments import RangeRead, fsync_path, fsync_tree
from .storage import LocalStorage, ObjectStorage, Storage, write_segment_at


class Store:
    """A lazyrag KV store. Use :meth:`create_or_open` to index, :meth:`open` to read (or, with
    ``write=True``, to maintain it)."""

    def __init__(self, storage: Storage, settings: StoreSettings, attrs: dict, *, writable: bool,
                 frozen: bool = False):
        self.path = storage.location
        self.settings = settings
        self._attrs = attrs
        self._writable, self._frozen = writable, frozen
        self._storage = storage  # closed by close(), even if this fails
        self._catalog = storage.catalog
        self._run_log = storage.run_log
        self._segments = storage.segments
        self._store_id = self._catalog.meta("store_id")

    # -- opening -------------------------------------------------------------

    @classmethod
    def create_or_open(cls, path: str | Path | StoreURL, settings: StoreSettings, warn: Warn = warn_stderr) -> Store:
        """Open a store for appending, creating it if ``path`` does not exist.

        An existing store must have been built with the same settings (compat key);
        otherwise :class:`StoreMismatch`. Only one process may hold a store directory open for
        writing at a time (on object storage several may); see :meth:`open` for what opening
        for writing does.
        """
        path = store_location(path)
        if isinstance(path, StoreURL):
            return cls._open_objects(path, write=True, expect=settings, create=True)
        if not (path / "zarr.json").exists():
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                raise StoreError(f"{path} exists and is not a lazyrag store; choose another --store path")
            _create(path, settings)
        return cls.open(path, write=True, expect=settings, warn=warn)

    @classmethod
    def open(cls, path: str | Path | StoreURL, write: bool = False, expect: StoreSettings | None = None,
             warn: Warn = warn_stderr) -> Store:
        """Open an existing store to read it (and to save run records), holding the shared
        read lock; or, with ``write``, holding the writer lock: a store of an older format is
        upgraded in place and segments left by a crash are deleted (anything else unknown in
        ``segments/`` is left alone and ``warn`` is told). ``expect``: settings the store must
        have been built with. A store this process cannot write (``access.writable``) is read
        as it is, and cannot be opened with ``write``. A store on object storage takes no locks."""
        path = store_location(path)
        if isinstance(path, StoreURL):
            return cls._open_objects(path, write, expect, create=False)
        if not path.exists():
            raise StoreError(f"no store at {path}: build one with `lazyrag index CORPUS --store {path}`")
        attrs, _ = read_root_attributes(path)
        if not write and attrs["format_version"] < FORMAT_VERSION:
            raise StoreError(f"{path} has store format {attrs['format_version']}; upgrade it in place with "
                             f"`lazyrag compact --store {path}` (or re-index into a new --store)")
        can_write = access.writable(path)
        if write and not can_write:
            raise StoreError(f"{access.cannot_write(path)}; index and compact need a store they can change")
        lock = take_write_lock(path) if write else take_read_lock(path, create=can_write)
        store = None
        try:
            attrs, stored = read_root_attributes(path)  # as it is now that the lock is held
            if expect is not None and stored.compat_key() != expect.compat_key():
                raise StoreMismatch(mismatch_message(path, stored, expect))
            storage = LocalStorage(path, stored, writable=write, frozen=not can_write,
                                   lock_fd=lock if write else None, read_lock_fd=None if write else lock)
            store = cls(storage, stored, attrs, writable=write, frozen=not can_write)
            if write:
                if attrs["format_version"] < FORMAT_VERSION:
                    store._store_id = upgrade(path, store._catalog, store._segments)
                delete_orphans(path, store._store_id, store._catalog.segment_names(), warn)
        except BaseException:
            if store is not None:
                store.close()
            elif lock is not None:
                os.close(lock)
            raise
        return store

    @classmethod
    def _open_objects(cls, url: StoreURL, write: bool, expect: StoreSettings | None, create: bool) -> Store:
        storage, attrs, stored = ObjectStorage.open(url, expect, create)
        try:
            return cls(storage, stored, attrs, writable=write)
        except BaseException:
            storage.close()
            raise

    def close(self) -> None:
        """Close files and the catalog and release the locks (idempotent)."""
        storage = getattr(self, "_storage", None)
        if storage is not None:
            storage.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -------------------------------------------------------------

    def has_chunk(self, chunk_id: str) -> bool:
        return self._catalog.has_chunk(chunk_id)

    def put_documents(self, chunks: Sequence[NewChunk]) -> None:
        """Record documents' chunk lists: ``chunks`` holds every chunk of each document it
        names (doc_id, ordinal). A document whose list changed gets a new version that
        replaces the old one in one transaction, as soon as all its chunks are stored (now,
        or in the :meth:`append` that stores its last one); until then readers see the old
        version, or for a new document nothing. Chunks the old version alone used stay on
        disk until :meth:`compact`."""
        self._check_writable()
        docs: dict[str, list[NewChunk]] = {}
        for c in chunks:
            docs.setdefault(c.doc_id, []).append(c)
        self._storage.put_documents(
            {d: [c.chunk_id for c in sorted(cs, key=lambda c: c.ordinal)] for d, cs in docs.items()})

    def remove_missing_documents(self, keep: Collection[str]) -> list[str]:
        """Take every document not in ``keep`` out of readers' view (``index --sync``); their chunks
        stay on disk, unreferenced, until :meth:`compact`. Returns the removed ids, sorted."""
        self._check_writable()
        gone = sorted(self._catalog.document_ids() - set(keep))
        if gone:
            self._storage.remove_documents(gone)
        return gone

    def append(self, chunks: Sequence[NewChunk], kv: np.ndarray, replace: Collection[str] = ()) -> None:
        """Store the KV of ``chunks`` (laid out as :func:`write_chunks` takes it): one new segment,
        durable, then one catalog commit (:meth:`commit`). Chunks already in the store (or
        repeated in ``chunks``) are not written again, except those in ``replace`` (damaged
        copies, see :meth:`check`), whose new copy takes the old one's place."""
        self._check_writable()
        taken = self._catalog.stored(c.chunk_id for c in chunks) - set(replace)
        written = write_chunks(self.path, self.settings, self._store_id, self.next_segment_seq(), chunks, kv, taken)
        if written is not None:
            self.commit(written)

    def commit(self, written: WrittenSegment) -> None:
        """Make a segment :func:`write_chunks` wrote visible: one catalog transaction adds its chunks
        (a chunk stored before is pointed at its new copy) and publishes the documents
        (:meth:`put_documents`) whose last chunk it stores."""
        self._check_writable()
        self._storage.commit_append(written.name, written.placed, written.rows, written.nbytes)

    @property
    def store_id(self) -> str | None:
        """The id segment markers carry (:func:`write_chunks`)."""
        return self._store_id

    def next_segment_seq(self) -> int:
        """The number the next segment's name carries (names sort in the order segments were written)."""
        return self._catalog.next_segment_seq()

    def check(self, verify: bool = True) -> CheckReport:
        """Compare the catalog with the disk: missing and orphan chunks and segments, and with
        ``verify`` (``lazyrag check``, ``index --verify``) corrupt chunks too, by reading every
        chunk back against its checksum. Without it (``index``) only each segment's presence
        and size are checked, so it costs nothing like a read of the store."""
        return check_store(self._catalog, self._segments,
                           lambda known: self._storage.scan_segments(self._store_id, known), verify)

    def compact(self, wait: bool = False) -> CompactResult:
        """Reclaim the space of chunks no document references (``lazyrag compact``). Needs
        the store opened with ``write=True`` and no reader: StoreBusy while one has it open,
        unless ``wait``, which waits for them. A store on object storage is refused (StoreError)."""
        self._check_writable()
        return self._storage.compact(self.settings, self._store_id, wait)

    def _check_writable(self) -> None:
        if not self._writable:
            raise StoreError(f"{self.path} was opened read-only; use Store.create_or_open to append")

    # -- reading -----------------------------------------------------------------

    def chunk(self, chunk_id: str) -> ChunkInfo:
        """A stored chunk. ``doc_id``/``ordinal`` name the first document that has it."""
        info = self._catalog.chunk(chunk_id)
        if info is None:
            raise StoreError(f"unknown chunk id {chunk_id!r} in store {self.path}")
        return info

    def doc_chunks(self, doc_id: str) -> list[ChunkInfo]:
        """A document's chunks as its published version lists them, ordered by ordinal, read in
        one transaction ([] for an unknown document; DocumentIncomplete for a document whose
        first version is not stored whole yet)."""
        return self._catalog.doc_chunks(doc_id)

    def documents(self) -> list[str]:
        """Ids of the documents readers can see, in the order they were first published."""
        return self._catalog.documents()

    def iter_chunks(self) -> Iterator[ChunkInfo]:
        """The chunks of the documents readers can see, in storage order (segment, then offset)."""
        return self._catalog.iter_chunks()

    def retrieval_chunks(self) -> list[tuple[str, str]]:
        """(chunk id, text) of the chunks readers can see, each once, by document id then chunk
        index (Catalog.retrieval_chunks): BM25's corpus, in an order the build does not change."""
        return self._catalog.retrieval_chunks()

    @property
    def num_chunks(self) -> int:
        """Chunks stored, whether or not a document references them."""
        return self._catalog.num_chunks()

    def max_padded_length(self) -> int:
        """Rows of the longest stored chunk (0 for an empty store)."""
        return self._catalog.max_padded_length()

    @property
    def local_dir(self) -> Path:
        """A local directory for what is derived from the store (its BM25 index): the store directory, or
        for a store on object storage the local cache that holds its catalog."""
        return self._storage.local_dir

    def read_kv(self, chunk: ChunkInfo, out: torch.Tensor | None = None, whole: bool = False,
                into_out: RangeRead | None = None, verify: bool = True) -> torch.Tensor:
        """A chunk's KV: ``[padded_length, num_layers, 2, num_kv_heads, head_dim]`` in
        the logical dtype; see :meth:`SegmentReader.read_kv`. Safe to call from several threads."""
        return self._segments.read_kv(chunk, out, whole, into_out, verify)

    def check_crc(self, chunk: ChunkInfo, got: int | None) -> None:
        """ChunkReadError (corrupt) unless ``got`` is ``chunk``'s recorded crc32c; see
        :meth:`SegmentReader.check_crc` (for reads made with ``verify=False``)."""
        self._segments.check_crc(chunk, got)

    # -- run log and summary -----------------------------------------------------

    def save_run(self, run_id: str, record: dict) -> None:
        """Save run ``run_id``'s JSON record in the run log: the first save adds the run, later
        ones replace its record (atomic). StoreError when the store cannot be written."""
        if self._frozen:
            raise StoreError(access.cannot_write(self.path))
        self._run_log.save(run_id, record)

    def runs(self) -> list[dict]:
        """The run log, oldest first."""
        return self._run_log.records()

    def summary(self) -> dict:
        """Store numbers for ``lazyrag stats``."""
        s = self.settings
        counts = self._catalog.counts()
        return {
            "documents": counts["documents"],
            "chunks": counts["chunks"],
            "tokens": counts["tokens"],
            "padded_tokens": counts["padded_tokens"],
            "pending_documents": counts["pending_documents"],
            "unreferenced_chunks": counts["unreferenced_chunks"],
            "kv_bytes": counts["padded_tokens"] * s.row_bytes,
            "bytes": self._storage.bytes_used(),
            "model": s.model,
            "fingerprint": s.fingerprint,
            "kv_dtype": s.kv_dtype,
            "page_size": s.page_size,
            "segments": counts["segments"],
            "runs": self._run_log.count(),
            "created": self._attrs.get("created"),
            "updated": counts["updated"] if counts["updated"] is not None else self._attrs.get("created"),
        }


@dataclass(frozen=True)
class WrittenSegment:
    """A segment made durable and not in the catalog yet: an orphan until :meth:`Store.commit`."""

    name: str
    placed: list[tuple[NewChunk, int, int, int]]  # (chunk, offset, padded length, checksum)
    rows: int
    nbytes: int


def write_chunks(root: Path | StoreURL, settings: StoreSettings, store_id: str | None, seq: int,
                 chunks: Sequence[NewChunk], kv: np.ndarray, skip: Collection[str] = ()) -> WrittenSegment | None:
    """Write the KV of ``chunks`` as segment number ``seq`` of the store at ``root``, durable,
    without touching its catalog, so a process other than the store's writer may write it; None
    when there is nothing to write. Chunks in ``skip``, and repeats in ``chunks``, are left out.

    ``kv`` has shape ``[sum of padded lengths, num_layers, 2, num_kv_heads, head_dim]`` in the
    storage dtype (``storage_dtype(kv_dtype)``; see ``kv_to_storage``); chunk i occupies its
    padded length of rows, in order. Each chunk's checksum is recorded with it.
    """
    s = settings
    storage = storage_dtype(s.kv_dtype)
    if not isinstance(kv, np.ndarray):
        raise StoreError(f"kv must be a numpy array, got {type(kv).__name__}")
    if kv.dtype.newbyteorder("<") != storage or kv.dtype.itemsize != storage.itemsize:
        raise StoreError(f"kv dtype {kv.dtype} does not match the store's storage dtype {storage} ({s.kv_dtype})")
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

    taken = set(skip)
    new_rows = []  # (chunk, source row, padded, segment offset)
    offset = 0
    for c, (src, padded) in zip(chunks, spans):
        if c.chunk_id in taken:
            continue
        taken.add(c.chunk_id)
        new_rows.append((c, src, padded, offset))
        offset += padded
    if not new_rows:
        return None
    if offset == kv.shape[0]:
        data = np.ascontiguousarray(kv)
    else:
        data = np.concatenate([kv[src : src + p] for _, src, p, _ in new_rows])
    if data.dtype != storage:
        data = data.astype(storage)
    name = write_segment_at(root, s, data, seq, store_id)
    placed = [(c, off, p, checksum(data[off : off + p])) for c, _src, p, off in new_rows]
    return WrittenSegment(name, placed, offset, offset * s.row_bytes)


def _create(path: Path, settings: StoreSettings) -> None:
    # Build the skeleton in a sibling temp directory and rename it into place, so
    # a crash never leaves a half-made store at `path`.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.creating-", dir=path.parent))
    try:
        attrs = root_attributes(settings)
        zarr.open_group(str(tmp), mode="w", attributes={ATTRS_KEY: attrs})
        Catalog.create(tmp / CATALOG_FILE, attrs["created"], secrets.token_hex(16))
        (tmp / LOCK_FILE).touch()
        fsync_tree(tmp)
        try:
            os.rename(tmp, path)  # replaces an empty directory; fails on a non-empty one
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (path / "zarr.json").exists():
                return  # another process created it first
            raise
        fsync_path(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
