"""Compaction: reclaiming the disk space of chunks no document references any more.

Runs under the writer lock and the exclusive read lock (no reader has the store open). A
segment holding only dead rows is dropped; one holding some is rewritten with its live
chunks (read back against their checksums) into a new segment. Each segment is one step:
the new segment is made durable, one catalog transaction moves its chunks and forgets the old
segment, then the old directory is deleted; a crash in between leaves an orphan that the
next open for writing deletes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .catalog import Catalog
from .format import SEGMENTS, StoreSettings, kv_to_storage
from .segments import SegmentReader, write_segment


@dataclass
class CompactResult:
    segments_dropped: int = 0
    segments_rewritten: int = 0
    chunks_removed: int = 0
    bytes_freed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def compact_segments(root: Path, settings: StoreSettings, catalog: Catalog, reader: SegmentReader,
                     store_id: str) -> CompactResult:
    result = CompactResult()
    chunks_before = catalog.num_chunks()
    bytes_before = disk_usage(root / SEGMENTS)
    for seg in catalog.segments():
        live = catalog.live_chunks(seg.name)
        if sum(c.padded_length for c in live) == seg.rows:
            continue  # every row is live
        if live:
            data = np.concatenate([kv_to_storage(reader.read_kv(c)) for c in live])
            new = write_segment(root, settings, data, catalog.next_segment_seq(), store_id)
            offsets = np.cumsum([0] + [c.padded_length for c in live[:-1]]).tolist()
            placed = [(c.chunk_id, int(off)) for c, off in zip(live, offsets)]
            catalog.replace_segment(seg.name, new, placed, data.shape[0], data.nbytes)
            result.segments_rewritten += 1
        else:
            catalog.replace_segment(seg.name, None, [], 0, 0)
            result.segments_dropped += 1
        reader.forget(seg.name)
        old = root / SEGMENTS / seg.name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
    result.chunks_removed = chunks_before - catalog.num_chunks()
    result.bytes_freed = max(0, bytes_before - disk_usage(root / SEGMENTS))
    return result


def disk_usage(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (symbolic links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total
