"""`lazyrag compact`: reclaim the disk space of chunks no document uses any more (the old
versions of re-indexed documents). Takes the writer lock, and refuses (or with --wait, waits)
while an `answer` or `stats` has the store open."""

from __future__ import annotations

from pathlib import Path

from lazyrag.store import CompactResult, Store
from lazyrag.store.location import StoreURL


def run_compact(store_path: Path | StoreURL, wait: bool = False) -> CompactResult:
    with Store.open(store_path, write=True) as store:
        return store.compact(wait=wait)


def describe(result: CompactResult) -> str:
    return (f"freed {result.bytes_freed / 1e6:,.1f} MB: removed {result.chunks_removed} unused chunks, "
            f"dropped {result.segments_dropped} segments and rewrote {result.segments_rewritten}")
