"""The queries file: parsing each line into a Query, and finding the chunks a query needs.

A bad line is reported as `file:line: reason` and skipped, so the other queries are
still answered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from lazyrag.store import ChunkInfo, Store, StoreError


@dataclass
class Query:
    id: str
    question: str
    line: int
    docs: list[str] | None = None
    chunks: list[str] | None = None
    answers: list[str] | None = None


class QueryError(ValueError):
    pass


def read_queries(path: Path, report: Callable[[str], None]) -> Iterator[Query]:
    """Parse the queries file; a bad line is reported as `file:line: reason` and skipped."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise QueryError(f"{path}: cannot read the queries file ({exc.strerror})") from None
    seen: set[str] = set()
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                q = _parse_query(line, n)
            except (ValueError, UnicodeDecodeError) as exc:
                report(f"{path}:{n}: {exc}")
                continue
            if q.id in seen:
                report(f"{path}:{n}: duplicate query id {q.id!r}")
                continue
            seen.add(q.id)
            yield q


def _parse_query(line: str, n: int) -> Query:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    qid, question = obj.get("id"), obj.get("question")
    if qid is None or not isinstance(question, str) or not question.strip():
        raise ValueError('needs "id" and a non-empty "question"')
    lists = {}
    for key in ("docs", "chunks", "answers"):
        value = obj.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, (str, int)) for v in value)):
            raise ValueError(f'"{key}" must be a list of strings')
        lists[key] = [str(v) for v in value] if value is not None else None
    return Query(str(qid), question, n, **lists)


def resolve_chunks(store: Store, q: Query, retriever, top_k: int) -> list[ChunkInfo]:
    """A query's chunks, else all chunks of its docs in order, else the top-k retrieved
    (`retriever`: a lazyrag.retrieve.Retriever, needed only by queries that name neither)."""
    if q.chunks:
        return [store.chunk(cid) for cid in q.chunks]
    if q.docs:
        missing = [d for d in q.docs if not store.doc_chunks(d)]
        if missing:
            raise StoreError(f"unknown doc ids: {', '.join(missing)}")
        return [c for d in q.docs for c in store.doc_chunks(d)]
    return [store.chunk(cid) for cid in retriever.top_k(q.question, top_k)]
