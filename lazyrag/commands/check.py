"""`lazyrag check`: read every chunk of a store back against its checksum and compare the
catalog with the disk; report corrupt, missing and orphan chunks and segments."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lazyrag.store import CheckReport, Store
from lazyrag.store.location import StoreURL


def run_check(store_path: Path | StoreURL) -> CheckReport:
    with Store.open(store_path) as store:
        return store.check()


def render_check(report: CheckReport, store_path: Path | StoreURL, console: Console) -> None:
    """One line per problem, then a verdict that says what to do."""
    for row in report.corrupt:
        console.print(f"corrupt: chunk {row['chunk']} in segment {row['segment']}", highlight=False)
    for row in report.missing:
        console.print(f"missing: chunk {row['chunk']} in segment {row['segment']}", highlight=False)
    for row in report.dangling:
        console.print(f"missing: chunk {row['chunk']} of document {escape(row['document'])} is not in the catalog",
                      highlight=False)
    for name in report.missing_segments:
        console.print(f"missing: segment {name}", highlight=False)
    for path in report.orphan_segments:
        console.print(f"orphan: segment {escape(path)} (left by an interrupted write)", highlight=False)
    for message in report.unrecognised:
        console.print(f"warning: {escape(message)}", highlight=False)
    summary = f"{report.chunks} chunks in {report.segments} segments"
    if report.unreferenced_chunks:
        summary += (f"; {report.unreferenced_chunks} chunks no document uses any more "
                    f"(`lazyrag compact --store {store_path}` reclaims them)")
    if report.ok:
        console.print(f"ok: {summary}", highlight=False)
        return
    fixes = []
    if report.damaged_chunk_ids or report.dangling or report.missing_segments:
        verify = " --verify" if report.corrupt else ""  # only a verifying index finds corrupt chunks
        fixes.append(f"`lazyrag index CORPUS --store {store_path}{verify}` re-encodes damaged chunks")
    if report.orphan_segments:
        fixes.append("opening the store for writing (index or compact) deletes orphan segments")
    console.print(f"damaged: {summary}; " + "; ".join(fixes), highlight=False)
