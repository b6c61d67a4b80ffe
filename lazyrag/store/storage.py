"""Where a store's bytes live, behind the ``Store`` facade: its segments, its catalog and how a catalog
change becomes durable, its run log. ``LocalStorage``: a directory (segment files, a SQLite catalog,
flock locks). ``ObjectStorage``: a prefix on object storage (segment objects, a log of manifests replayed
into a local SQLite catalog, one object per run); no locks, several writers may append at once."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import zarr
from zarr.storage import MemoryStore

from .catalog import Catalog, NewChunk
from .compaction import CompactResult, compact_segments, disk_usage
from .format import (
    ATTRS_KEY,
    CATALOG_FILE,
    FORMAT_VERSION,
    SEGMENT_NAME,
    SEGMENTS,
    StoreError,
    StoreMismatch,
    StoreSettings,
    mismatch_message,
    parse_root_attributes,
    root_attributes,
)
from .integrity import SegmentsScan, scan_segments
from .location import StoreURL, catalog_cache
from .locks import take_exclusive_read_lock
from .manifests import ManifestLog, documents_manifest, segment_manifest
from .objects import Objects, put_segment
from .runlog import ObjectRunLog, RunLog
from .segments import SegmentReader, write_segment

ROOT_METADATA = "zarr.json"


class Storage(Protocol):
    """What the ``Store`` facade needs from where the store lives."""

    location: Path | StoreURL
    local_dir: Path  # a local directory for what is derived from the store (its BM25 index)
    catalog: Catalog
    segments: SegmentReader
    run_log: RunLog | ObjectRunLog

    def commit_append(self, segment: str, placed: Sequence[tuple[NewChunk, int, int, int]], rows: int,
                      nbytes: int) -> None:
        """Make a written segment's chunks visible, durably (:meth:`Catalog.commit_append`)."""

    def put_documents(self, docs: Mapping[str, Sequence[str]]) -> None:
        """Record documents' chunk lists, durably (:meth:`Catalog.put_documents`)."""

    def remove_documents(self, doc_ids: Sequence[str]) -> None:
        """Take documents out of readers' view (:meth:`Catalog.remove_documents`)."""

    def scan_segments(self, store_id: str | None, known: set[str]) -> SegmentsScan:
        """The segments there that the catalog does not name, and those it names that are not there."""

    def bytes_used(self) -> int: ...

    def compact(self, settings: StoreSettings, store_id: str, wait: bool) -> CompactResult: ...

    def close(self) -> None: ...


def write_segment_at(location: Path | StoreURL, settings: StoreSettings, data: np.ndarray, seq: int,
                     store_id: str | None) -> str:
    """Write ``data`` as segment number ``seq`` of the store at ``location``, durable, named by nothing
    yet (:meth:`Storage.commit_append` makes it visible); return its name."""
    if isinstance(location, StoreURL):
        return put_segment(Objects(location), settings, data, seq)
    return write_segment(location, settings, data, seq, store_id)


class LocalStorage:
    """A store directory. Holds the lock descriptors it is given and closes them in :meth:`close`."""

    def __init__(self, path: Path, settings: StoreSettings, *, writable: bool, frozen: bool, lock_fd: int | None,
                 read_lock_fd: int | None):
        self.location = self.local_dir = path
        self._lock_fd, self._read_lock_fd = lock_fd, read_lock_fd  # closed by close(), even if this fails
        self.catalog = Catalog(path / CATALOG_FILE, writable=writable, frozen=frozen)
        self.run_log = RunLog(self.catalog)
        self.segments = SegmentReader(path, settings)

    def commit_append(self, segment: str, placed: Sequence[tuple[NewChunk, int, int, int]], rows: int,
                      nbytes: int) -> None:
        self.catalog.commit_append(segment, placed, rows, nbytes)

    def put_documents(self, docs: Mapping[str, Sequence[str]]) -> None:
        self.catalog.put_documents(docs)

    def remove_documents(self, doc_ids: Sequence[str]) -> None:
        self.catalog.remove_documents(doc_ids)

    def scan_segments(self, store_id: str | None, known: set[str]) -> SegmentsScan:
        return scan_segments(self.location, store_id, known)

    def bytes_used(self) -> int:
        return disk_usage(self.location)

    def compact(self, settings: StoreSettings, store_id: str, wait: bool) -> CompactResult:
        fd = take_exclusive_read_lock(self.location, wait)
        try:
            return compact_segments(self.location, settings, self.catalog, self.segments, store_id)
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            self.segments.close()
            self.catalog.close()
        finally:
            for name in ("_lock_fd", "_read_lock_fd"):
                fd = getattr(self, name, None)
                if fd is not None:
                    os.close(fd)
                    setattr(self, name, None)


class ObjectStorage:
    """A store on object storage: ``zarr.json`` and ``segments/`` as in a store directory, ``manifests/``
    (the catalog's log, lazyrag/store/manifests.py) and ``runs/``. Its catalog is replayed into a local
    cache (lazyrag/store/location.py) when it is opened."""

    def __init__(self, url: StoreURL, objects: Objects, catalog: Catalog, settings: StoreSettings, cache: Path):
        self.location, self.local_dir = url, cache
        self.catalog = catalog
        self.segments = SegmentReader(url, settings, files=objects)
        self.run_log = ObjectRunLog(objects)
        self._objects = objects
        self._log = ManifestLog(objects, catalog)

    @classmethod
    def open(cls, url: StoreURL, expect: StoreSettings | None, create: bool) -> tuple[ObjectStorage, dict,
                                                                                           StoreSettings]:
        """The store at ``url`` (created with the settings ``expect`` when ``create`` and there is none),
        its root attributes and settings, its catalog brought up to date. StoreMismatch when it was built
        with settings other than ``expect``."""
        objects = Objects(url)
        raw = objects.get(ROOT_METADATA)
        if raw is None:
            if not create:
                raise StoreError(f"no store at {url}: build one with `lazyrag index CORPUS --store {url}`")
            if next(objects.keys(""), None) is not None:
                raise StoreError(f"{url} exists and is not a lazyrag store; choose another --store path")
            objects.create(ROOT_METADATA, root_metadata(expect))  # another writer may make it first: checked below
            raw = objects.read(ROOT_METADATA)
        attrs, stored = parse_root_attributes(raw, url, objects.where(ROOT_METADATA))
        if attrs["format_version"] < FORMAT_VERSION:
            raise StoreError(f"{url} has store format {attrs['format_version']}, which lazyrag upgrades only in a "
                             "local directory; re-index into a new --store")
        if expect is not None and stored.compat_key() != expect.compat_key():
            raise StoreMismatch(mismatch_message(url, stored, expect))
        cache = catalog_cache(url, raw)
        storage = cls(url, objects, _cache_catalog(cache, attrs["created"]), stored, cache)
        try:
            storage._log.sync()
        except BaseException:
            storage.close()
            raise
        return storage, attrs, stored

    def commit_append(self, segment: str, placed: Sequence[tuple[NewChunk, int, int, int]], rows: int,
                      nbytes: int) -> None:
        self._log.commit(segment_manifest(segment, placed, rows, nbytes))

    def put_documents(self, docs: Mapping[str, Sequence[str]]) -> None:
        if changed := self.catalog.changed_documents(docs):  # a run that changes nothing adds no manifest
            self._log.commit(documents_manifest(changed))

    def remove_documents(self, doc_ids: Sequence[str]) -> None:
        # the manifest log has no removal record that every reader replays yet
        raise StoreError(f"{self.location}: index --sync is not supported on object storage; index into a local "
                         "store, or leave --sync out")

    def scan_segments(self, store_id: str | None, known: set[str]) -> SegmentsScan:
        present = self._objects.folders(f"{SEGMENTS}/")
        # a segment no manifest names is invisible and harmless; nothing deletes it on object storage
        return SegmentsScan(missing=sorted(known - present), unrecognised=[
            f"{self._objects.where(f'{SEGMENTS}/{name}')} is named by no manifest (left by an interrupted write, "
            "or being written now); it is never read" for name in sorted(present - known)
            if SEGMENT_NAME.fullmatch(name)])

    def bytes_used(self) -> int:
        return sum(size for _, size in self._objects.keys(""))

    def compact(self, settings: StoreSettings, store_id: str, wait: bool) -> CompactResult:
        raise StoreError(f"compact works on local stores only for now; {self.location} is on object storage, "
                         "where chunks no document uses stay in their segments")

    def close(self) -> None:
        self.segments.close()
        self.catalog.close()


def root_metadata(settings: StoreSettings) -> bytes:
    """The zarr.json of a store created now with ``settings``: the same as a store directory's."""
    files: dict = {}
    zarr.open_group(store=MemoryStore(files), mode="w", attributes={ATTRS_KEY: root_attributes(settings)})
    return files[ROOT_METADATA].to_bytes()


def _cache_catalog(cache: Path, created: str) -> Catalog:
    """The local catalog in ``cache``, made empty (no manifest applied) if there is none."""
    file = cache / CATALOG_FILE
    if not file.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{CATALOG_FILE}.{secrets.token_hex(4)}"
        Catalog.create(tmp, created, cache.name)
        try:
            os.link(tmp, file)  # unlike a rename, never replaces one another process made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return Catalog(file, writable=True)
