"""Object I/O for a store on object storage (obstore): whole and ranged reads, writes, create-if-absent
writes and listings of the objects under the store's URL, and the writing of one segment.

Credentials and endpoints come from the environment, as each service's own tools read them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``; ``GOOGLE_*``;
``AZURE_*``). The keys are the local store's paths: ``zarr.json``, ``segments/<name>/...``."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import zarr
from zarr.storage import MemoryStore

from .format import SEGMENTS, StoreError, StoreSettings
from .location import StoreURL
from .segments import segment_array, segment_name, shard_index

T = TypeVar("T")
# objects fetched at once by get_many: manifests and run records are small, so latency dominates
PARALLEL_GETS = 16


class ObjectStoreError(StoreError, OSError):
    """An object cannot be read or written. An OSError too, so segment reads report it as they report a
    file's failure (``strerror``, ``filename``); ``errno`` ENOENT for a missing object."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _first_line(exc: BaseException) -> str:
    # obstore's messages run on with the response body (XML) and a debug dump; the first line, up to
    # the body, says what failed
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.split(": <?xml", 1)[0]


class Objects:
    """The objects under one store's URL. Safe to use from several threads."""

    def __init__(self, url: StoreURL):
        try:
            from obstore.store import from_url
        except ImportError:
            raise StoreError(f"{url} is on object storage, which needs obstore: pip install 'lazyrag[s3]'") from None
        self.url = url
        try:
            self._store = from_url(url.url)
        except Exception as e:  # a malformed URL or configuration
            raise StoreError(f"{url} cannot be opened: {_first_line(e)}") from None

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _call(self, key: str, fn: Callable[[], T]) -> T:
        import obstore.exceptions

        try:
            return fn()
        except (FileNotFoundError, obstore.exceptions.NotFoundError):
            raise ObjectStoreError(errno.ENOENT, "no such object", self.where(key)) from None
        except (obstore.exceptions.BaseError, OSError) as e:
            raise ObjectStoreError(errno.EIO, _first_line(e), self.where(key)) from None

    # -- reads ---------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        import obstore

        return self._call(key, lambda: obstore.get(self._store, key).bytes().to_bytes())

    def get(self, key: str) -> bytes | None:
        """The object ``key``, or None when there is none."""
        try:
            return self.read(key)
        except ObjectStoreError as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """:meth:`get` of each key, fetched in parallel, in order."""
        keys = list(keys)
        if len(keys) < 2:
            return [self.get(k) for k in keys]
        with ThreadPoolExecutor(min(PARALLEL_GETS, len(keys))) as pool:
            return list(pool.map(self.get, keys))

    def size(self, key: str) -> int:
        import obstore

        return self._call(key, lambda: obstore.head(self._store, key)["size"])

    def read_range(self, key: str, start: int, nbytes: int) -> bytes:
        import obstore

        return self._call(key, lambda: obstore.get_range(self._store, key, start=start, length=nbytes).to_bytes())

    def open(self, key: str) -> str:
        return key  # nothing to keep open: each read is its own request

    def read_into(self, handle: str, view: memoryview, offset: int) -> None:
        """One ranged GET of ``len(view)`` bytes from ``offset``."""
        import obstore

        got = self._call(handle, lambda: obstore.get_range(self._store, handle, start=offset, length=len(view)))
        data = memoryview(got)
        if len(data) < len(view):
            raise StoreError(f"the segment object ends at byte {offset + len(data)}, inside the chunk")
        view[:] = data

    def close(self, handle: str) -> None:
        pass

    def zarr_store(self) -> zarr.storage.ObjectStore:
        return zarr.storage.ObjectStore(self._store, read_only=True)

    def keys(self, prefix: str, after: str | None = None) -> Iterator[tuple[str, int]]:
        """(key, size) of the objects under ``prefix`` (after the key ``after``, when given), in key order."""
        import obstore

        batches = self._call(prefix, lambda: list(obstore.list(self._store, prefix, offset=after, chunk_size=1000)))
        for batch in batches:
            for meta in batch:
                yield meta["path"], meta["size"]

    def folders(self, prefix: str) -> set[str]:
        """The names of the folders directly under ``prefix`` (which ends with a slash)."""
        import obstore

        found = self._call(prefix, lambda: obstore.list_with_delimiter(self._store, prefix))
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]}

    # -- writes --------------------------------------------------------------------

    def put(self, key: str, data: bytes | Iterable[memoryview]) -> None:
        """Write (or replace) ``key``: bytes, or buffers uploaded in parts without joining them first."""
        import obstore

        self._call(key, lambda: obstore.put(self._store, key, data))

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` unless it exists (If-None-Match: *): True when this call wrote it."""
        import obstore
        import obstore.exceptions

        def put() -> bool:
            try:
                obstore.put(self._store, key, data, mode="create")
            except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
                return False
            return True

        return self._call(key, put)


def put_segment(objects: Objects, settings: StoreSettings, data: np.ndarray, seq: int) -> str:
    """Write ``data`` as segment number ``seq``, in the layout of a local segment (the zarr array's
    metadata, then its one shard: the pages, then the index); return its name. Nothing names it until a
    manifest does, so a writer stopped half way leaves objects no reader ever sees."""
    name = segment_name(seq)
    meta: dict = {}
    arr = zarr.create_array(store=MemoryStore(meta), name=f"{SEGMENTS}/{name}", **segment_array(settings, data))
    index = shard_index(settings, data.shape[0])
    shard = f"{SEGMENTS}/{name}/{arr.metadata.encode_chunk_key((0,) * data.ndim)}"
    objects.put(shard, iter([memoryview(data).cast("B"), memoryview(index).cast("B")]))
    objects.put(f"{SEGMENTS}/{name}/zarr.json", meta[f"{SEGMENTS}/{name}/zarr.json"].to_bytes())
    return name
