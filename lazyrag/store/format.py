"""The store's format: its settings and compat key, chunk ids, KV dtypes, root attributes, errors.

Layout of a store directory::

    zarr.json            zarr v3 root group; attributes["lazyrag"] holds the format
                         name and version, the settings, created time, lazyrag version
    segments/<name>/     one zarr array per append call, written whole, never changed:
                         shape [rows, num_layers, 2 (K, V), num_kv_heads, head_dim],
                         one shard holding the whole segment, inner chunks of one page,
                         uncompressed, so every stored chunk is one contiguous byte range;
                         named seg-<seq>-<random>, with a marker file naming the store
    catalog.sqlite       chunks (with a crc32c each), documents and their chunk lists,
                         document versions being stored, segments, run log (SQLite, WAL)
    write.lock           held (flock) by the one process that may append or compact
    read.lock            held shared by readers; compaction takes it exclusively

Keys are stored after RoPE at chunk-local positions; values as they are. bf16 has no
zarr dtype: its bits are stored as uint16 and ``kv_dtype`` names the logical dtype. An fp8
store (``float8_e4m3fn``) keeps bytes (uint8): each (token, layer, K/V, kv_head) row is its
head_dim e4m3 values, then its fp32 scale (4 bytes, little-endian), so the last axis is
head_dim + 4 and a chunk is still one contiguous byte range (``pack_fp8_rows``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch

FORMAT_NAME = "lazyrag-kv"
# 2: per-chunk checksums, versioned documents, segment markers. Version 1 stores are
# upgraded in place when opened for writing (lazyrag/store/migration.py).
FORMAT_VERSION = 2
# The version of the KV layout inside chunk ids and compat keys: unchanged since version 1,
# so an upgraded store keeps its chunk ids.
KV_LAYOUT_VERSION = 1

CATALOG_FILE = "catalog.sqlite"
LOCK_FILE = "write.lock"
READ_LOCK_FILE = "read.lock"
SEGMENTS = "segments"
SEGMENT_MARKER = "lazyrag-segment.json"
SEGMENT_NAME = re.compile(r"seg-[0-9]{6,}-[0-9a-f]{8}")
ATTRS_KEY = "lazyrag"

KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
FP8_KV = "float8_e4m3fn"
SCALE_BYTES = 4  # an fp8 row's fp32 scale, after its values
_STORAGE_NP = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4"),
               FP8_KV: np.dtype("u1")}
_LOGICAL_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                  FP8_KV: torch.float8_e4m3fn}


class StoreError(Exception):
    """A store cannot be opened, read or written as asked."""


class StoreMismatch(StoreError):
    """The store was built with other settings (model, dtype, chunking, ...)."""


class ChunkReadError(StoreError):
    """A chunk's KV cannot be read back as stored: its checksum does not match (``corrupt``), or
    its segment is missing or truncated. ``chunk_id`` and ``segment`` name it."""

    def __init__(self, message: str, chunk_id: str, segment: str, corrupt: bool = False):
        super().__init__(message)
        self.chunk_id, self.segment, self.corrupt = chunk_id, segment, corrupt


class StoreBusy(StoreError):
    """Another process holds the lock this operation needs (a writer, or readers during compaction)."""


class DocumentIncomplete(StoreError):
    """A document is known to the store but not all of its chunks are stored yet."""


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


def rows_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype of a chunk's rows as read back: the logical dtype, or uint8 for fp8 rows
    (values and scale packed)."""
    return torch.uint8 if kv_dtype == FP8_KV else torch_dtype(kv_dtype)


def kv_row_bytes(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's KV in kv_dtype, on disk or in a page pool (fp8: scales included)."""
    if kv_dtype == FP8_KV:
        return num_layers * 2 * num_kv_heads * (head_dim + SCALE_BYTES)
    return num_layers * 2 * num_kv_heads * head_dim * storage_dtype(kv_dtype).itemsize


def kv_to_storage(kv: torch.Tensor) -> np.ndarray:
    """A CPU tensor of rows (a logical KV dtype, or packed fp8 rows) -> the numpy array ``Store.append`` takes."""
    kv = kv.detach().cpu().contiguous()
    if kv.dtype == torch.bfloat16:
        return kv.view(torch.int16).numpy().view(np.uint16)
    if kv.dtype in (torch.float16, torch.float32, torch.uint8):
        return kv.numpy()
    raise StoreError(f"unsupported KV tensor dtype {kv.dtype}")


def pack_fp8_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 values [..., head_dim] and their fp32 scales [...] -> the rows an fp8 store keeps:
    uint8 [..., head_dim + 4], each row's values then its scale's bytes (on any device)."""
    scale_bytes = scales.to(torch.float32).contiguous().view(torch.uint8).view(*scales.shape, SCALE_BYTES)
    return torch.cat([values.view(torch.uint8), scale_bytes], dim=-1)


def unpack_fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_fp8_rows`: (e4m3 values [..., head_dim], fp32 scales [...])."""
    values = rows[..., :-SCALE_BYTES].view(torch.float8_e4m3fn)
    scales = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)
    return values, scales


@dataclass(frozen=True)
class StoreSettings:
    """Everything a store is built with; written into the root attributes at creation."""

    model: str  # display name, e.g. "smollm2-135m"
    fingerprint: str  # model fingerprint (hex)
    kv_dtype: str  # logical dtype: "bfloat16" | "float16" | "float32" | "float8_e4m3fn"
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
            "format_version": KV_LAYOUT_VERSION,
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
    def from_json(cls, d: Any) -> StoreSettings:
        """Settings as :meth:`to_json` wrote them (unknown keys ignored); StoreError naming the first
        setting that is missing or of the wrong type."""
        if d is None:
            raise StoreError("it holds no settings")
        if not isinstance(d, dict):
            raise StoreError(f"its settings are {_json_type(d)}, not an object")
        for name, f in cls.__dataclass_fields__.items():
            if name not in d:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise StoreError(f"setting {name!r} is missing")
                continue
            value, want = d[name], _SETTING_TYPES[name]
            ok = isinstance(value, want) and not isinstance(value, bool)
            if ok and name == "preamble_ids":
                ok = all(isinstance(t, int) and not isinstance(t, bool) for t in value)
            if not ok:
                expected = "a list of integers" if name == "preamble_ids" else _json_type(want())
                raise StoreError(f"setting {name!r} is {_json_type(value)}, expected {expected}")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def row_shape(self) -> tuple[int, int, int, int]:
        """The shape of one token's KV as stored: [num_layers, 2, num_kv_heads, head_dim], with
        head_dim + 4 on the last axis for fp8 (the row's scale after its values)."""
        last = self.head_dim + (SCALE_BYTES if self.kv_dtype == FP8_KV else 0)
        return (self.num_layers, 2, self.num_kv_heads, last)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV on disk."""
        return kv_row_bytes(self.kv_dtype, self.num_layers, self.num_kv_heads, self.head_dim)

    def padded(self, length: int) -> int:
        """``length`` tokens rounded up to whole pages."""
        return math.ceil(length / self.page_size) * self.page_size


# The JSON type of each setting in zarr.json (int: an integer, never a bool).
_SETTING_TYPES = {"model": str, "fingerprint": str, "kv_dtype": str, "num_layers": int, "num_kv_heads": int,
                  "head_dim": int, "page_size": int, "preamble_ids": list, "rope": dict, "chunking": dict,
                  "encoding": dict}


def _json_type(value: Any) -> str:
    """What a JSON value is, in words ("a string", "an integer", ...)."""
    for kind, words in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return words
    return "null" if value is None else type(value).__name__


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def checksum(data: np.ndarray) -> int:
    """crc32c of an array's bytes as stored (a contiguous array: a chunk's rows)."""
    return crc32c.crc32c(memoryview(np.ascontiguousarray(data)).cast("B"))


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
        "kv_layout": ["token", "layer", "kv", "kv_head",
                      "head_dim e4m3 values + fp32 scale" if settings.kv_dtype == FP8_KV else "head_dim"],
        "kv_storage_dtype": str(storage_dtype(settings.kv_dtype)),
    }


def read_root_attributes(path: Path) -> tuple[dict, StoreSettings]:
    """The root attributes of the store at ``path`` and the settings they hold; StoreError, naming
    zarr.json and what is wrong in it, unless it is a store this version reads."""
    meta_file = path / "zarr.json"
    try:
        text = meta_file.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{path} is not a lazyrag store (no zarr.json)") from None
    except OSError as e:
        raise StoreError(f"{path} is not a lazyrag store ({meta_file}: {e})") from None
    attrs, settings = parse_root_attributes(text, path, meta_file)
    if not (path / CATALOG_FILE).exists():
        raise StoreError(f"{path} is damaged: {CATALOG_FILE} is missing")
    return attrs, settings


def parse_root_attributes(text: bytes, path: Any, meta_file: Any) -> tuple[dict, StoreSettings]:
    """The root attributes in the zarr.json ``text`` of the store at ``path`` (a directory or a URL) and
    the settings they hold; StoreError, naming ``meta_file`` and what is wrong, unless this version reads it."""
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise StoreError(f"{path} is not a lazyrag store ({meta_file}: {e})") from None
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    attrs = attrs.get(ATTRS_KEY) if isinstance(attrs, dict) else None
    if not isinstance(attrs, dict) or attrs.get("format") != FORMAT_NAME:
        raise StoreError(f"{path} is a zarr group but not a lazyrag store")
    version = attrs.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StoreError(f"{meta_file} is damaged: its format_version is {_json_type(version)}, not a positive "
                         "integer; restore the file or re-index into a new --store")
    if version > FORMAT_VERSION:
        raise StoreError(
            f"{path} has store format version {version}, newer than this lazyrag "
            f"supports ({FORMAT_VERSION}); upgrade lazyrag"
        )
    try:
        settings = StoreSettings.from_json(attrs.get("settings"))
    except StoreError as e:
        raise StoreError(f"{meta_file} is damaged: {e}; restore the file or re-index into a new --store") from None
    return attrs, settings


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
