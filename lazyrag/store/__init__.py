"""The chunk store: zarr segments of position-free KV, a SQLite catalog, the run log.

format.py holds the settings, chunk ids, checksums, on-disk layout and errors; catalog.py
the SQLite catalog; segments.py the segment files; locks.py the writer and reader locks;
integrity.py the check and the orphan clean-up; compaction.py compaction; migration.py the
upgrade of older stores; runlog.py the run log; access.py whether a store can be written;
store.py the ``Store`` that composes them. location.py parses ``--store`` (a directory or a URL);
storage.py holds where a store lives (a directory, or object storage through objects.py, with the
catalog's manifest log in manifests.py).
"""

from .catalog import ChunkInfo, NewChunk
from .compaction import CompactResult
from .format import (
    FP8_KV,
    FORMAT_NAME,
    FORMAT_VERSION,
    KV_DTYPES,
    ChunkReadError,
    DocumentIncomplete,
    StoreBusy,
    StoreError,
    StoreMismatch,
    StoreSettings,
    chunk_id_for,
    kv_row_bytes,
    kv_to_storage,
    pack_fp8_rows,
    rows_dtype,
    storage_dtype,
    torch_dtype,
    unpack_fp8_rows,
)
from .integrity import CheckReport
from .segments import SegmentReader
from .store import Store

__all__ = [
    "FP8_KV",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KV_DTYPES",
    "CheckReport",
    "ChunkInfo",
    "ChunkReadError",
    "CompactResult",
    "DocumentIncomplete",
    "NewChunk",
    "SegmentReader",
    "Store",
    "StoreBusy",
    "StoreError",
    "StoreMismatch",
    "StoreSettings",
    "chunk_id_for",
    "kv_row_bytes",
    "kv_to_storage",
    "pack_fp8_rows",
    "rows_dtype",
    "storage_dtype",
    "torch_dtype",
    "unpack_fp8_rows",
]
