"""The engine actor as a plain object (no Ray): queries submitted while it runs are answered as
one open stream, each collect returning the rows finished since the last, and an error of its
engine is raised by the next collect."""

import json
from pathlib import Path

import pytest

from lazyrag.commands.index import build_index
from lazyrag.commands.queries import Query
from lazyrag.config import AnswerConfig, IndexConfig
from lazyrag.parallel.engines import EngineActor
from lazyrag.store import Store

DOCS = {
    "nile": "The Nile is about 6,650 kilometres long. It flows north into the Mediterranean Sea.",
    "iron": "Iron has the symbol Fe and atomic number 26. Most of Earth's core is iron.",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("engine")
    corpus = tmp / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    build_index(IndexConfig(corpus=corpus, store=tmp / "s.zarr", model="random:tiny", device="cpu"),
                report=lambda msg: None, progress=False)
    return tmp / "s.zarr"


def work(store: Path, n: int, start: int = 0) -> list[tuple[Query, list[str]]]:
    """n queries, each with the chunk ids of one document, as the driver sends them."""
    with Store.open(store) as s:
        chunk_ids = {d: [c.chunk_id for c in s.doc_chunks(d)] for d in DOCS}
    docs = list(DOCS)
    return [(Query(f"q{i}", f"What is said here, part {i}?", line=i + 1), chunk_ids[docs[i % 2]])
            for i in range(start, start + n)]


def engine(store: Path, **settings) -> EngineActor:
    settings = {"cache_gb": 0.02, "batch_size": 1, "max_new_tokens": 4, **settings}
    return EngineActor(AnswerConfig(queries=Path("q.jsonl"), store=store, device="cpu", **settings))


def test_rows_come_back_as_they_finish_and_the_stream_stays_open(store):
    actor = engine(store)
    info = actor.start()
    assert info["device"] == "cpu" and info["model"] == "random:tiny"
    try:
        unknown = (Query("lost", "Where is it?", line=99), ["no-such-chunk"])
        actor.submit([unknown, *work(store, 6)])
        collected, failed = [], []
        while sum(map(len, collected)) < 6:
            got = actor.collect(wait_s=60)
            failed += [qid for qid, _ in got["errors"]]
            if got["rows"]:
                collected.append([r["id"] for r in got["rows"]])
        assert failed == ["lost"]
        # one request at a time (batch size 1): the first rows came back while the others still ran
        assert len(collected) > 1
        # each once; not necessarily in order: one whose chunks were read first may go ahead of one
        # still reading (lazyrag/serve/scheduler.py)
        assert sorted(sum(collected, [])) == [f"q{i}" for i in range(6)]
        # the engine waits for more instead of ending: a query submitted now is answered too
        actor.submit(work(store, 1, start=6))
        late = actor.collect(wait_s=60)
        assert [r["id"] for r in late["rows"]] == ["q6"] and late["cache"]["lookups"] > 0
    finally:
        actor.close()


def test_a_query_the_pool_cannot_hold_fails_alone_and_the_engine_goes_on(store):
    actor = engine(store, cache_gb=0.00001)  # the pool holds the preamble and nothing else
    actor.start()
    actor.submit(work(store, 2))
    errors = []
    for _ in range(60):
        got = actor.collect(wait_s=1)
        assert got["rows"] == []
        errors += got["errors"]
        if len(errors) == 2:
            break
    assert len(errors) == 2 and all("--cache-gb" in reason for _, reason in errors)
    actor.close()
