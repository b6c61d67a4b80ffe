"""The queries file: parsing each line into a Query, and finding the chunks a query needs.

A bad line is reported as `file:line: reason` and skipped, so the other queries are
still answered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from lazyrag.errors import InputError
from lazyrag.lines import text_lines
from lazyrag.config import ChunkOrder
from lazyrag.serve.ordering import PopularFirst, shared_prefixes
from lazyrag.store import ChunkInfo, Store, StoreError


@dataclass
class Query:
    id: str
    question: str
    line: int
    docs: list[str] | None = None
    chunks: list[str] | None = None
    answers: list[str] | None = None


class QueryError(InputError):
    """The queries file cannot be read at all (a bad line is reported and skipped instead)."""


# A line this long holds a question of ~250k tokens or more, past any supported model's context:
# it can only be rejected, so it is skipped without being held in memory.
MAX_LINE_BYTES = 1 << 20


def read_queries(path: Path, report: Callable[[str], None]) -> Iterator[Query]:
    """Parse the queries file; a bad line is reported as `file:line: reason` and skipped.
    Lines are decoded one by one, so a line that is not UTF-8 costs only itself."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise QueryError(f"{path}: cannot read the queries file ({exc.strerror})") from None
    seen: set[str] = set()
    with fh:
        for n, line in text_lines(fh, path, report, MAX_LINE_BYTES):
            try:
                q = _parse_query(line, n)
            except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
                report(f"{path}:{n}: {exc if isinstance(exc, ValueError) else 'JSON nested too deep'}")
                continue
            if q.id in seen:
                report(f"{path}:{n}: duplicate query id {q.id!r}")
                continue
            seen.add(q.id)
            yield q


def _is_id(value) -> bool:
    return isinstance(value, str) and bool(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What each list may hold (integers are kept as strings): chunk ids are always strings; the
# corpus reader accepts integer document ids; gold answers may be numbers.
_LIST_ITEMS = {"docs": lambda v: _is_id(v) or _is_int(v), "chunks": _is_id,
               "answers": lambda v: isinstance(v, str) or _is_int(v)}


def _parse_query(line: str, n: int) -> Query:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    qid, question = obj.get("id"), obj.get("question")
    if not _is_id(qid):
        raise ValueError(f'"id" must be a non-empty string, got {json.dumps(qid)[:40]}')
    if not isinstance(question, str) or not question.strip():
        raise ValueError('needs a non-empty "question"')
    lists = {}
    for key, valid in _LIST_ITEMS.items():
        value = obj.get(key)
        if value is not None and not (isinstance(value, list) and all(map(valid, value))):
            raise ValueError(f'"{key}" must be a list of strings')
        if value == [] and key != "answers":  # an empty list would silently mean "retrieve"
            raise ValueError(f'"{key}" is empty; leave it out to retrieve the top --top-k chunks')
        lists[key] = [str(v) for v in value] if value is not None else None
    return Query(qid, question, n, **lists)


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


class ChunkResolver:
    """The chunks of each query of a run (resolve_chunks), the BM25 retriever built when the
    first query that names no docs or chunks needs it."""

    def __init__(self, store: Store, top_k: int):
        self.store, self.top_k = store, top_k
        self._retriever = None

    def chunks(self, q: Query) -> list[ChunkInfo]:
        """StoreError, saying why, for a query that cannot be answered from the store."""
        if not q.chunks and not q.docs and self._retriever is None:
            if self.store.num_chunks == 0:
                raise StoreError("the store holds no chunks to retrieve from; index a corpus first")
            from lazyrag.retrieve import Retriever  # bm25s loads only when a query needs it

            self._retriever = Retriever(self.store)
        return resolve_chunks(self.store, q, self._retriever, self.top_k)


def in_prompt_order(resolved: Iterable[tuple[Query, list[ChunkInfo]]], order: str,
                    whole_prefix_uses: int | None = None) -> Iterator[tuple[Query, list[ChunkInfo], list[ChunkInfo], int]]:
    """Each resolved query with its chunks in the order its prompt takes them (--chunk-order,
    lazyrag/serve/ordering.py), in the order given, and its shared prefix: how many leading
    chunks at least `whole_prefix_uses` of the prompts start with (None: 0). Either count needs
    every query first."""
    if ChunkOrder(order) is ChunkOrder.GIVEN and whole_prefix_uses is None:
        yield from ((q, chunks, chunks, 0) for q, chunks in resolved)
        return
    resolved = list(resolved)
    popular = PopularFirst(chunks for _, chunks in resolved) if ChunkOrder(order) is ChunkOrder.POPULAR else None
    prompts = [popular.order(chunks) if popular else chunks for _, chunks in resolved]
    shared = shared_prefixes(prompts, whole_prefix_uses)
    yield from ((q, chunks, given, n) for (q, given), chunks, n in zip(resolved, prompts, shared))