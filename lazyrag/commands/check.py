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
        report = store.check()
        report.retrieval_index = retrieval_problem(store)
        return report


def retrieval_problem(store: Store) -> str | None:
    """Why the saved BM25 index is damaged, or None (lazyrag/retrieve.py; bm25s loads only if one is saved)."""
    if not (store.local_dir / "bm25").exists():
        return None
    from lazyrag.retrieve import index_problem

    return index_problem(store)


def render_check(report: CheckReport, store_path: Path | StoreURL, console: Console) -> None:
    """One line per problem, then a verdict that counts the damage (the store's totals apart)
    and says what to do."""
    for line in problem_lines(report):
        console.print(line, highlight=False)
    totals = f"{_count(report.chunks, 'chunk')} in {_count(report.segments, 'segment')}"
    if report.unreferenced_chunks:
        totals += (f"; {report.unreferenced_chunks} chunks no document uses any more "
                   f"(`lazyrag compact --store {store_path}` reclaims them)")
    if report.ok:
        console.print(f"ok: {totals}", highlight=False)
        return
    console.print(f"damaged: {damage_summary(report)} (the store holds {totals}); "
                  + "; ".join(fixes(report, store_path)), highlight=False)


def problem_lines(report: CheckReport) -> list[str]:
    lines = [f"corrupt: chunk {row['chunk']} in segment {row['segment']}" for row in report.corrupt]
    lines += [f"missing: chunk {row['chunk']} in segment {row['segment']}" for row in report.missing]
    lines += [f"missing: chunk {row['chunk']} of document {escape(row['document'])} is not in the catalog"
              for row in report.dangling]
    lines += [f"missing: segment {name}" for name in report.missing_segments]
    lines += [f"orphan: segment {escape(path)} (left by an interrupted write)" for path in report.orphan_segments]
    if report.retrieval_index:
        lines.append(f"damaged: retrieval index: {escape(report.retrieval_index)}")
    lines += [f"warning: {escape(message)}" for message in report.unrecognised]
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def damage_summary(report: CheckReport) -> str:
    """What is damaged, counted: the chunks and segments named above, not the whole store."""
    parts = []
    damaged = report.damaged_chunk_ids
    if damaged:
        segments = {r["segment"] for r in report.corrupt + report.missing} | set(report.missing_segments)
        parts.append(f"{_count(len(damaged), 'chunk')} in {_count(len(segments), 'segment')}")
    elif report.missing_segments:
        parts.append(_count(len(report.missing_segments), "missing segment"))
    if report.dangling:
        parts.append(_count(len(report.dangling), "document reference") + " to chunks not in the catalog")
    if report.orphan_segments:
        parts.append(_count(len(report.orphan_segments), "orphan segment"))
    if report.retrieval_index:
        parts.append("the retrieval index")
    return ", ".join(parts)


def fixes(report: CheckReport, store_path: Path | StoreURL) -> list[str]:
    found = []
    if report.damaged_chunk_ids or report.dangling or report.missing_segments:
        verify = " --verify" if report.corrupt else ""  # only a verifying index finds corrupt chunks
        found.append(f"`lazyrag index CORPUS --store {store_path}{verify}` re-encodes damaged chunks")
    if report.orphan_segments:
        found.append("opening the store for writing (index or compact) deletes orphan segments")
    if report.retrieval_index:
        found.append(f"`lazyrag index CORPUS --store {store_path}` rebuilds the retrieval index (so does the next "
                     "`answer` that retrieves)")
    return found
