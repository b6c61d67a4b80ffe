"""The ``Store``: one directory of reusable chunk KV, its layout in format.py (docs/architecture.md,
"The store on disk").

Crash safety: a segment's data is written and fsynced first, then its catalog rows
are committed in one transaction. A segment directory the catalog does not name is
an orphan (a crash between the two steps): readers never see it, and opening the
store for writing deletes it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import zarr

from .catalog import Catalog, ChunkInfo, NewChunk
from .format import (
    ATTRS_KEY,
    CATALOG_FILE,
    LOCK_FILE,
    SEGMENTS,
    StoreError,
    StoreMismatch,
    StoreSettings,
    mismatch_message,
    read_root_attributes,
    root_attributes,
    storage_dtype,
)
from .runlog import RunLog
from .segments import SegmentReader, fsync_path, fsync_tree, write_segment


class Store:
    """A lazyrag KV store. Use :meth:`create_or_open` to index, :meth:`open` to read."""

    def __init__(self, path: Path, settings: StoreSettings, attrs: dict, *, writable: bool, lock_fd: int | None):
        self.path = path
        self.settings = settings
        self._attrs = attrs
        self._writable = writable
        self._storage = storage_dtype(settings.kv_dtype)
        self._catalog = Catalog(path / CATALOG_FILE)
        self._run_log = RunLog(self._catalog)
        self._segments = SegmentReader(path, settings)
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
            _create(path, settings)
        lock_fd = _take_write_lock(path)
        try:
            attrs = read_root_attributes(path)
            stored = StoreSettings.from_json(attrs["settings"])
            if stored.compat_key() != settings.compat_key():
                raise StoreMismatch(mismatch_message(path, stored, settings))
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
        attrs = read_root_attributes(path)
        return cls(path, StoreSettings.from_json(attrs["settings"]), attrs, writable=False, lock_fd=None)

    def close(self) -> None:
        """Close files and the catalog and release the write lock (idempotent)."""
        try:
            self._segments.close()
            self._catalog.close()
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
        known = self._catalog.segment_names()
        for child in seg_dir.iterdir():
            if child.is_dir() and child.name not in known:
                shutil.rmtree(child)

    # -- writing -------------------------------------------------------------

    def has_chunk(self, chunk_id: str) -> bool:
        return self._catalog.has_chunk(chunk_id)

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
            raise StoreError(
                f"kv dtype {kv.dtype} does not match the store's storage dtype {self._storage} ({s.kv_dtype})"
            )
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

        taken = self._catalog.stored(c.chunk_id for c in chunks)
        new_rows = []  # (chunk, source row, padded, segment offset)
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
            segment = write_segment(self.path, s, data, self._catalog.next_segment_seq())
        placed = [(c, off, p) for c, _src, p, off in new_rows]
        self._catalog.commit_append(chunks, segment, placed, offset, offset * s.row_bytes)

    def link(self, chunks: Sequence[NewChunk]) -> None:
        """Record (doc_id, ordinal) -> chunk references without writing KV: for a
        document whose chunks are stored already (shared with another document), or
        are still on their way to the store. A reference shows in ``doc_chunks`` once
        its chunk is stored. Its document counts in ``documents()`` at once."""
        self._check_writable()
        self._catalog.link(chunks)

    def note_documents(self, doc_ids: Iterable[str]) -> None:
        """Record document ids as seen (documents whose chunks all existed already)."""
        self._check_writable()
        self._catalog.note_documents(doc_ids)

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
        """A document's chunks, ordered by ordinal ([] for an unknown document)."""
        return self._catalog.doc_chunks(doc_id)

    def documents(self) -> list[str]:
        """Document ids, in the order they were first recorded."""
        return self._catalog.documents()

    def iter_chunks(self) -> Iterator[ChunkInfo]:
        """Every stored chunk, in storage order (segment, then offset)."""
        return self._catalog.iter_chunks()

    @property
    def num_chunks(self) -> int:
        return self._catalog.num_chunks()

    def max_padded_length(self) -> int:
        """Rows of the longest stored chunk (0 for an empty store)."""
        return self._catalog.max_padded_length()

    def read_kv(self, chunk: ChunkInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        """A chunk's KV: ``[padded_length, num_layers, 2, num_kv_heads, head_dim]`` in
        the logical dtype; see :meth:`SegmentReader.read_kv`. Safe to call from several threads."""
        return self._segments.read_kv(chunk, out)

    # -- run log and summary -----------------------------------------------------

    def add_run(self, record: dict) -> None:
        """Append one JSON record to the run log (atomic)."""
        self._run_log.add(record)

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
            "kv_bytes": counts["padded_tokens"] * s.row_bytes,
            "bytes": _disk_usage(self.path),
            "model": s.model,
            "fingerprint": s.fingerprint,
            "kv_dtype": s.kv_dtype,
            "page_size": s.page_size,
            "segments": counts["segments"],
            "runs": self._run_log.count(),
            "created": self._attrs.get("created"),
            "updated": counts["updated"] if counts["updated"] is not None else self._attrs.get("created"),
        }


def _create(path: Path, settings: StoreSettings) -> None:
    # Build the skeleton in a sibling temp directory and rename it into place, so
    # a crash never leaves a half-made store at `path`.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.creating-", dir=path.parent))
    try:
        attrs = root_attributes(settings)
        zarr.open_group(str(tmp), mode="w", attributes={ATTRS_KEY: attrs})
        Catalog.create(tmp / CATALOG_FILE, attrs["created"])
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


def _take_write_lock(path: Path) -> int:
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(f"{path} is being written by another process (lazyrag index); wait for it to finish") from None
    return fd


def _disk_usage(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total
