"""The chunk store: zarr segments of position-free KV, a SQLite catalog, the run log.

format.py holds the settings, chunk ids and on-disk layout; catalog.py the SQLite
catalog; segments.py the segment files; runlog.py the run log; store.py the ``Store``
that composes them.
"""

from .catalog import ChunkInfo, NewChunk
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    KV_DTYPES,
    StoreError,
    StoreMismatch,
    StoreSettings,
    chunk_id_for,
    kv_to_storage,
    storage_dtype,
    torch_dtype,
)
from .segments import SegmentReader
from .store import Store

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KV_DTYPES",
    "ChunkInfo",
    "NewChunk",
    "SegmentReader",
    "Store",
    "StoreError",
    "StoreMismatch",
    "StoreSettings",
    "chunk_id_for",
    "kv_to_storage",
    "storage_dtype",
    "torch_dtype",
]
