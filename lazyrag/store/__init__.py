"""The chunk store: zarr segments of position-free KV, a SQLite catalog, the run log."""

from .store import *  # noqa: F401,F403
from .store import ChunkInfo, NewChunk, Store, StoreError, StoreMismatch, StoreSettings, chunk_id_for, kv_to_storage, storage_dtype, torch_dtype  # noqa: F401
