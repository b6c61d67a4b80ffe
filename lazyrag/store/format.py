"""The store's format: its settings and compat key, chunk ids, KV dtypes, root attributes, errors.

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
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

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

    def compat_fields(self) -> dict:
        """Everything that must match for stored KV to be reused, by name."""
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
        return hashlib.sha256(_canonical_json(self.compat_fields()).encode()).hexdigest()

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

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV on disk."""
        return int(np.prod(self.row_shape)) * storage_dtype(self.kv_dtype).itemsize

    def padded(self, length: int) -> int:
        """``length`` tokens rounded up to whole pages."""
        return math.ceil(length / self.page_size) * self.page_size


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def token_ids_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as stored (int32, little-endian): the catalog's blob and the chunk id's input."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def token_ids_from_bytes(blob: bytes) -> tuple[int, ...]:
    """The inverse of :func:`token_ids_bytes`."""
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
    h.update(token_ids_bytes(token_ids))
    return h.hexdigest()[:24]


def timestamp() -> str:
    """Now, as the store records times (UTC, ISO 8601, whole seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _lazyrag_version() -> str:
    try:
        from importlib.metadata import version

        return version("lazyrag")
    except Exception:
        return "unknown"


def root_attributes(settings: StoreSettings) -> dict:
    """The root group's ``attributes["lazyrag"]`` of a store created now."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "settings": settings.to_json(),
        "compat_key": settings.compat_key(),
        "created": timestamp(),
        "lazyrag_version": _lazyrag_version(),
        "kv_layout": ["token", "layer", "kv", "kv_head", "head_dim"],
        "kv_storage_dtype": str(storage_dtype(settings.kv_dtype)),
    }


def read_root_attributes(path: Path) -> dict:
    """The root attributes of the store at ``path``; StoreError unless it is a store this version reads."""
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


def mismatch_message(path: Path, stored: StoreSettings, wanted: StoreSettings) -> str:
    """Why a store built with ``stored`` cannot be reused with ``wanted``, naming both fingerprints."""
    lines = [f"store {path} was built with other settings and cannot be reused:"]
    if stored.fingerprint != wanted.fingerprint:
        lines.append(
            f"  model fingerprint: store has {stored.fingerprint} ({stored.model}), "
            f"this run has {wanted.fingerprint} ({wanted.model})"
        )
    a, b = stored.compat_fields(), wanted.compat_fields()
    for key in a:
        if key != "fingerprint" and a[key] != b[key]:
            lines.append(f"  {key}: store has {_canonical_json(a[key])}, this run has {_canonical_json(b[key])}")
    lines.append("choose a new --store path (or delete the old store) to index with these settings")
    return "\n".join(lines)
