"""Segment files: each append's KV as one zarr v3 array, written whole and made durable, and
read back one chunk at a time, as one byte range (preads, or ranged GETs on object storage, split
into pieces read in parallel: parallel_reads.py) when the segment has the layout written here, each
read checked against the chunk's checksum.

A segment's directory gets its marker file (the store's id) before any data, so a segment
left behind by a crash is recognisably this store's and nothing else is ever taken for one."""

from __future__ import annotations

import json
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, ShardingCodec

from .catalog import ChunkInfo
from .file_writes import write_new_file
from .format import SEGMENT_MARKER, SEGMENTS, ChunkReadError, StoreError, StoreSettings, checksum, rows_dtype
from .location import StoreURL
from .parallel_reads import ParallelReads, shared_reads


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path, durable: Path | None = None) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself), but the file ``durable``,
    fsynced already: each fsync may flush the disk's cache, under every other write in flight."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            if Path(dirpath) / name != durable:
                fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def write_marker(segment_dir: Path, store_id: str) -> None:
    """Mark ``segment_dir`` as a segment of the store whose id is ``store_id``."""
    marker = {"store_id": store_id, "segment": segment_dir.name}
    (segment_dir / SEGMENT_MARKER).write_text(json.dumps(marker) + "\n")


def marked_by(segment_dir: Path) -> str | None:
    """The store id in a segment directory's marker (None: no readable marker)."""
    try:
        marker = json.loads((segment_dir / SEGMENT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("segment") != segment_dir.name:
        return None
    return marker.get("store_id") if isinstance(marker.get("store_id"), str) else None


def segment_name(seq: int) -> str:
    """A new segment's name: its sequence number and a random part, so two writers never pick the same one."""
    return f"seg-{seq:06d}-{secrets.token_hex(4)}"


def segment_array(settings: StoreSettings, data: np.ndarray) -> dict:
    """The zarr array a segment of ``data`` is: one shard (the whole segment) of uncompressed page-sized
    inner chunks, so each stored chunk is one contiguous byte range of the shard."""
    s = settings
    return dict(
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


def shard_index(settings: StoreSettings, rows: int) -> np.ndarray:
    """The shard index of a segment of ``rows`` rows in the sharding codec's layout: (offset, nbytes) of
    each page, the pages back to back in row order."""
    n_pages = rows // settings.page_size
    page_bytes = settings.page_size * settings.row_bytes
    index = np.empty((n_pages, 2), dtype="<u8")
    index[:, 0] = np.arange(n_pages, dtype=np.uint64) * np.uint64(page_bytes)
    index[:, 1] = page_bytes
    return index


def write_segment(root: Path, settings: StoreSettings, data: np.ndarray, seq: int, store_id: str) -> str:
    """Write ``data`` as segment number ``seq`` of the store at ``root``, durable; return its name.

    zarr writes the array's metadata; the shard file is written here in the sharding codec's own
    layout (the pages, then the index), straight from ``data`` to the disk (file_writes.py): zarr's
    own encoder copies every page twice.
    """
    name = segment_name(seq)
    arr_dir = root / SEGMENTS / name
    arr_dir.mkdir(parents=True)
    write_marker(arr_dir, store_id)
    arr = zarr.create_array(store=str(root), name=f"{SEGMENTS}/{name}", **segment_array(settings, data))
    shard = arr_dir / arr.metadata.encode_chunk_key((0,) * data.ndim)
    shard.parent.mkdir(parents=True, exist_ok=True)
    write_new_file(shard, [np.ascontiguousarray(data), shard_index(settings, data.shape[0])])
    fsync_tree(arr_dir, durable=shard)  # the directories hold its name: they are fsynced after it
    fsync_path(root / SEGMENTS)
    return name


class SegmentFiles(Protocol):
    """Where a reader finds segment files, by key relative to the store (``segments/<name>/zarr.json``).
    Failures are OSError, as the local filesystem raises them."""

    def read(self, key: str) -> bytes: ...

    def size(self, key: str) -> int: ...

    def read_range(self, key: str, start: int, nbytes: int) -> bytes: ...

    def open(self, key: str) -> Any:
        """A handle for :meth:`read_into` (closed by :meth:`close`)."""

    def read_into(self, handle: Any, view: memoryview, offset: int) -> None:
        """Fill ``view`` from byte ``offset``; StoreError when the file ends first."""

    def close(self, handle: Any) -> None: ...

    def where(self, key: str) -> Path | str:
        """The file, for messages."""

    def zarr_store(self) -> Any:
        """The store as zarr opens it."""


class LocalFiles:
    """Segment files in a store directory: preads on a descriptor kept open."""

    def __init__(self, root: Path):
        self.root = root

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def size(self, key: str) -> int:
        return (self.root / key).stat().st_size

    def read_range(self, key: str, start: int, nbytes: int) -> bytes:
        with open(self.root / key, "rb") as f:
            f.seek(start)
            return f.read(nbytes)

    def open(self, key: str) -> int:
        return os.open(self.root / key, os.O_RDONLY)

    def read_into(self, handle: int, view: memoryview, offset: int) -> None:
        _pread_into(handle, view, offset)

    def close(self, handle: int) -> None:
        os.close(handle)

    def where(self, key: str) -> Path:
        return self.root / key

    def zarr_store(self) -> str:
        return str(self.root)


@dataclass
class _Segment:
    name: str
    file: Path | str  # the shard file holding the whole segment
    data_start: int  # byte offset of row 0 in that file, when rows are contiguous
    contiguous: bool
    handle: Any = None  # open while the segment's chunks are read as byte ranges


_IN_CALLER = ParallelReads(1)
RangeRead = Callable[[Path, int, int], int]  # (file, first byte, bytes) read into a known buffer -> their crc32c


class SegmentReader:
    """Reads chunks' KV from the segments of the store at ``root``; keeps each segment's file open.
    ``files``: where the segment files are (default: the store directory ``root``); ``reads``: the
    threads a chunk's pieces are read on (default: the process's, ``shared_reads()``)."""

    def __init__(self, root: Path | StoreURL, settings: StoreSettings, files: SegmentFiles | None = None,
                 reads: ParallelReads | None = None):
        self.root = root
        self.settings = settings
        self._files = files if files is not None else LocalFiles(root)
        self._reads = reads
        self._row_bytes = settings.row_bytes
        self._segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the open segment files (idempotent)."""
        with self._lock:
            for seg in self._segments.values():
                if seg.handle is not None:
                    self._files.close(seg.handle)
                    seg.handle = None
            self._segments.clear()

    def forget(self, name: str) -> None:
        """Close a segment that is being deleted."""
        with self._lock:
            seg = self._segments.pop(name, None)
            if seg is not None and seg.handle is not None:
                self._files.close(seg.handle)

    def byte_range(self, chunk: ChunkInfo) -> tuple[Path | str, int, int] | None:
        """(file, first byte, bytes) of ``chunk``'s rows when one read of that file gets
        them all; None when its segment is read through zarr instead."""
        seg = self._segment(chunk.segment)
        if not seg.contiguous:
            return None
        return seg.file, seg.data_start + chunk.offset * self._row_bytes, chunk.padded_length * self._row_bytes

    def read_kv(self, chunk: ChunkInfo, out: torch.Tensor | None = None, whole: bool = False,
                into_out: RangeRead | None = None, verify: bool = True) -> torch.Tensor:
        """A chunk's KV: ``[padded_length, num_layers, 2, num_kv_heads, head_dim]`` in
        the logical dtype, or packed fp8 rows (``rows_dtype``, ``row_shape``) (K rotated at
        chunk-local positions, then V). Rows past
        ``length`` are padding, as the writer gave them. With ``out`` (a contiguous CPU tensor of that
        shape and dtype, e.g. pinned memory) the data is read into it and it is returned.
        Safe to call from several threads. ``whole``: read in one piece on the calling thread, for
        a caller that reads many chunks at once on threads of its own (pieces on more threads than
        that only contend with it for the cores and the GIL). ``into_out(file, offset, nbytes)``:
        reads a local segment's byte range into ``out`` elsewhere (the reader process) and returns
        its crc32c. ``verify=False``: the bytes are not checked against the chunk's crc32c here;
        the caller checks them (``check_crc``) where they land (the loader, on the GPU).
        """
        s = self.settings
        shape = (chunk.padded_length, *s.row_shape)
        dtype = rows_dtype(s.kv_dtype)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise StoreError(
                f"out must be a contiguous CPU tensor of shape {shape} and dtype {dtype}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        buf = out.view(-1).view(torch.uint8).numpy()
        try:
            seg = self._segment(chunk.segment)
            if seg.contiguous and seg.handle is not None and into_out is not None and isinstance(seg.file, Path):
                got = into_out(seg.file, seg.data_start + chunk.offset * self._row_bytes, len(buf))
            elif seg.contiguous and seg.handle is not None:
                reads = _IN_CALLER if whole else self._reads or shared_reads()
                got = reads.read(lambda view, offset: self._files.read_into(seg.handle, view, offset),
                                 memoryview(buf), seg.data_start + chunk.offset * self._row_bytes)
            else:
                buf[:] = self._read_through_zarr(chunk)
                got = checksum(buf) if chunk.checksum is not None and verify else None
        except StoreError as e:
            raise self._read_error(chunk, str(e)) from None
        if verify:
            self.check_crc(chunk, got)
        return out

    def check_crc(self, chunk: ChunkInfo, got: int | None) -> None:
        """Raise ChunkReadError (corrupt) when ``got``, the crc32c of the bytes read for ``chunk``,
        is not the one its catalog entry records (a chunk without one passes)."""
        if chunk.checksum is not None and got != chunk.checksum:
            shown = "none" if got is None else f"{got:#010x}"
            raise self._read_error(chunk, f"its checksum does not match (stored {chunk.checksum:#010x}, "
                                          f"read {shown}): the data on disk changed", corrupt=True)

    def check_structure(self, chunk: ChunkInfo) -> None:
        """Raise ChunkReadError, as :meth:`read_kv` would, when ``chunk``'s segment is missing or
        does not have the size its layout implies; reads no chunk data (cheap: one stat per segment)."""
        try:
            self._segment(chunk.segment)
        except StoreError as e:
            raise self._read_error(chunk, str(e)) from None

    def _read_error(self, chunk: ChunkInfo, reason: str, corrupt: bool = False) -> ChunkReadError:
        # only `index --verify` reads every chunk back, so only it finds a corrupt one
        fix = f"lazyrag index CORPUS --store {self.root}" + (" --verify" if corrupt else "")
        return ChunkReadError(
            f"chunk {chunk.chunk_id} (segment {chunk.segment} of store {self.root}) cannot be read: {reason}; "
            f"run `{fix}` to re-encode it", chunk.chunk_id, chunk.segment, corrupt)

    def _read_through_zarr(self, chunk: ChunkInfo) -> np.ndarray:
        try:
            arr = zarr.open_array(store=self._files.zarr_store(), path=f"{SEGMENTS}/{chunk.segment}", mode="r")
            data = arr[chunk.offset : chunk.offset + chunk.padded_length]
        except Exception as e:  # zarr reports damaged data in many ways; each is this segment's fault
            raise StoreError(f"zarr cannot decode it ({type(e).__name__}: {e})") from None
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)

    def _segment(self, name: str) -> _Segment:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                seg = self._segments[name] = self._load(name)
            return seg

    def _load(self, name: str) -> _Segment:
        """A segment's shard file, and whether its rows can be read with one read (checked
        against the shard index); StoreError when the segment is missing or truncated."""
        try:
            meta = json.loads(self._files.read(f"{SEGMENTS}/{name}/zarr.json"))
            rows = int(meta["shape"][0])
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise StoreError(f"segment {name} is missing or damaged ({getattr(e, 'strerror', None) or e})") from None
        key = f"{SEGMENTS}/{name}/{shard_key(meta)}"
        file = self._files.where(key)
        seg = _Segment(name=name, file=file, data_start=0, contiguous=False)
        index_bytes = self._own_layout_index_bytes(meta, rows)
        if index_bytes is None:
            return seg  # another layout: read through zarr
        n_pages = rows // self.settings.page_size
        page_bytes = self.settings.page_size * self._row_bytes
        expected_size = n_pages * page_bytes + index_bytes
        try:
            size = self._files.size(key)
            if size != expected_size:
                raise StoreError(f"segment {name} is truncated: its shard holds {size:,} of {expected_size:,} "
                                 "bytes" if size < expected_size else
                                 f"segment {name} is damaged: its shard holds {size:,} bytes, not {expected_size:,}")
            at_end = meta["codecs"][0]["configuration"].get("index_location", "end") == "end"
            raw = self._files.read_range(key, size - index_bytes if at_end else 0, index_bytes)
        except OSError as e:
            raise StoreError(f"segment {name} cannot be read ({e.strerror}: {file})") from None
        index = np.frombuffer(raw[: n_pages * 16], dtype="<u8").reshape(n_pages, 2)
        expected = index[0, 0] + np.arange(n_pages, dtype=np.uint64) * np.uint64(page_bytes)
        if np.all(index[:, 1] == page_bytes) and np.array_equal(index[:, 0], expected):
            seg.data_start = int(index[0, 0])
            seg.contiguous = True
            try:
                seg.handle = self._files.open(key)
            except OSError as e:
                raise StoreError(f"segment {name} cannot be read ({e.strerror}: {file})") from None
        return seg

    def _own_layout_index_bytes(self, meta: dict, rows: int) -> int | None:
        """The shard index's size when the segment has the layout write_segment writes (one
        shard of uncompressed page-sized inner chunks, so its size is known); None otherwise."""
        codecs = meta.get("codecs", [])
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return None
        conf = codecs[0]["configuration"]
        inner = conf["codecs"]
        endian = inner[0].get("configuration", {}).get("endian", "little") if inner else None
        if [c["name"] for c in inner] != ["bytes"] or endian != "little":
            return None
        page_size = self.settings.page_size
        if conf["chunk_shape"][0] != page_size or meta["chunk_grid"]["configuration"]["chunk_shape"][0] != rows:
            return None
        index_codecs = [c["name"] for c in conf.get("index_codecs", [])]
        if index_codecs not in (["bytes"], ["bytes", "crc32c"]):
            return None
        return rows // page_size * 16 + (4 if "crc32c" in index_codecs else 0)


def shard_key(meta: dict) -> str:
    """The key of a one-shard array's shard, relative to the array, under its chunk key encoding."""
    encoding = meta.get("chunk_key_encoding", {})
    zeros = ["0"] * len(meta["shape"])
    if encoding.get("name", "default") == "v2":
        return encoding.get("configuration", {}).get("separator", ".").join(zeros)
    return encoding.get("configuration", {}).get("separator", "/").join(["c", *zeros])


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise StoreError(f"the segment file ends at byte {offset + done}, inside the chunk")
        done += n
