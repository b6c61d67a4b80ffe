"""Upgrading a store of format version 1 to the current format, in place, under the writer lock.

Version 1 had no chunk checksums, no document versions, no segment markers and no run ids in
the run log (its runs keep none: each was saved once). The upgrade adds the catalog's new
columns and table, computes each chunk's checksum from its data as it
is now, marks the segments the catalog names, and only then records the new version in
``zarr.json``: every step can run again, so an upgrade interrupted anywhere completes on the
next open. A store whose data cannot all be read is not upgraded: it says to re-index.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from .catalog import Catalog
from .format import ATTRS_KEY, FORMAT_VERSION, SEGMENTS, ChunkReadError, StoreError, checksum, kv_to_storage
from .segments import SegmentReader, fsync_path, marked_by, write_marker


def upgrade(path: Path, catalog: Catalog, reader: SegmentReader) -> str:
    """Bring the store at ``path`` (format 1) to the current format; return its store id."""
    with catalog.transaction() as db:
        columns = {r[1] for r in db.execute("PRAGMA table_info(chunks)")}
        if "checksum" not in columns:
            db.execute("ALTER TABLE chunks ADD COLUMN checksum INTEGER")
        if "run_id" not in {r[1] for r in db.execute("PRAGMA table_info(runs)")}:
            db.execute("ALTER TABLE runs ADD COLUMN run_id TEXT")
        row = db.execute("SELECT value FROM meta WHERE key = 'store_id'").fetchone()
        store_id = row[0] if row else secrets.token_hex(16)
        db.execute("INSERT OR REPLACE INTO meta VALUES ('store_id', ?)", (store_id,))
    sums = []
    for chunk in catalog.iter_chunks(everything=True):
        if chunk.checksum is None:
            try:
                sums.append((checksum(kv_to_storage(reader.read_kv(chunk))), chunk.chunk_id))
            except ChunkReadError as e:
                raise StoreError(f"{path} (store format 1) cannot be upgraded: chunk {e.chunk_id} in segment "
                                 f"{e.segment} cannot be read back; re-index into a new --store") from None
    with catalog.transaction() as db:
        db.executemany("UPDATE chunks SET checksum = ? WHERE chunk_id = ?", sums)
    for name in catalog.segment_names():
        seg = path / SEGMENTS / name
        if seg.is_dir() and not seg.is_symlink() and marked_by(seg) != store_id:
            write_marker(seg, store_id)
            fsync_path(seg)
    set_format_version(path, FORMAT_VERSION)
    return store_id


def set_format_version(path: Path, version: int) -> None:
    """Record ``version`` in the store's root attributes (replaced atomically)."""
    meta_file = path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["attributes"][ATTRS_KEY]["format_version"] = version
    tmp = meta_file.with_name(".zarr.json.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, meta_file)
    fsync_path(path)
