"""A chunk that cannot be read while answering fails only the requests that need it: the
scheduler gives back what their placement took, the engine hands them to `on_error`, and
`lazyrag answer` lists them in the errors file and answers the rest."""

from __future__ import annotations

import json
import time

import pytest
import torch
from serve_fakes import PAGE_SIZE, PREAMBLE, chunk, sequence
from serve_stores import DOCS, make_store, request
from typer.testing import CliRunner

from lazyrag.cli import app
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader, LoadReport
from lazyrag.serve.modes import Block, Lazy
from lazyrag.serve.paged import PagePool
from lazyrag.serve.scheduler import Scheduler
from lazyrag.store import ChunkInfo, ChunkReadError, SegmentReader, Store

A, B, C = chunk("a", 8), chunk("b", 8), chunk("c", 8)  # 2 pages each
QUESTION = [7, 8]


class UnreadableLoader:
    """Loads nothing, and fails the chunks in `unreadable` as a damaged store would."""

    def __init__(self, unreadable: set[str]):
        self.unreadable = unreadable

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        pass

    def reading(self, chunk_id: str) -> bool:
        return False

    def queued(self, chunk_id: str) -> bool:
        return False

    def finished(self) -> list[ChunkInfo]:
        return []

    def after_copy(self, copied) -> None:
        pass

    def settle(self, copied) -> None:
        pass

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport:
        if info.chunk_id in self.unreadable:
            raise ChunkReadError(f"chunk {info.chunk_id} (segment {info.segment}) cannot be read", info.chunk_id,
                                 info.segment, corrupt=True)
        return LoadReport()

    def close(self) -> None:
        pass


def scheduler_over(mode_class, seqs, unreadable: set[str], on_error=None, lookahead=64):
    pool = PagePool(1, 1, 2, 24, PAGE_SIZE, torch.float32, torch.device("cpu"))
    cache = ChunkCache(pool, UnreadableLoader(unreadable))
    mode = mode_class(PREAMBLE, PAGE_SIZE, lambda copies: None)
    mode.place_preamble(cache)
    return Scheduler(mode, cache, 4, seqs, lookahead, on_error=on_error), cache


@pytest.mark.parametrize("mode_class", [Lazy, Block])
def test_a_request_with_an_unreadable_chunk_fails_alone_and_gives_back_its_pins(mode_class):
    seqs = [sequence("ab", [A, B], QUESTION, 2), sequence("c", [C], QUESTION, 2),
            sequence("cb", [C, B], QUESTION, 2), sequence("ac", [A, C], QUESTION, 2)]
    failed = []
    sched, cache = scheduler_over(mode_class, seqs, {"b"}, on_error=lambda s, e: failed.append((s.id, e)))
    free_before = cache.available_pages()
    step = sched.schedule()
    assert [s.id for s in step.batch] == ["c", "ac"]
    assert [(sid, e.chunk_id) for sid, e in failed] == [("ab", "b"), ("cb", "b")]
    assert all(s.placement is None for s in seqs if s.id in ("ab", "cb"))
    for seq in step.batch:
        seq.finished_at = time.perf_counter()
    sched.retire()
    # a's pin, taken before b failed, is given back: every chunk is evictable again
    assert cache.available_pages() == free_before
    assert sched.schedule() is None


def test_without_on_error_the_read_error_ends_the_run_after_giving_back_the_pins():
    sched, cache = scheduler_over(Lazy, [sequence("ab", [A, B], QUESTION, 2)], {"b"})
    free_before = cache.available_pages()
    with pytest.raises(ChunkReadError, match="chunk b"):
        sched.schedule()
    assert cache.available_pages() == free_before


def test_when_every_waiting_request_fails_the_later_ones_still_run():
    seqs = [sequence(f"bad{i}", [B], QUESTION, 2) for i in range(3)] + [sequence("good", [A], QUESTION, 2)]
    failed = []
    sched, _ = scheduler_over(Lazy, seqs, {"b"}, on_error=lambda s, e: failed.append(s.id), lookahead=2)
    step = sched.schedule()
    assert [s.id for s in step.batch] == ["good"] and failed == ["bad0", "bad1", "bad2"]


def corrupt(store_path, info: ChunkInfo) -> None:
    """Flip one byte of a stored chunk's rows, where the store's reader says they are."""
    with Store.open(store_path) as st:
        reader = SegmentReader(store_path, st.settings)
        file, start, _nbytes = reader.byte_range(info)
        reader.close()
    with open(file, "r+b") as f:
        f.seek(start + 40)
        byte = f.read(1)
        f.seek(start + 40)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_corrupt_chunk_read_directly_or_by_prefetch_is_a_chunk_read_error(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny")
    bad = store.doc_chunks("nile")[0]
    corrupt(tmp_path / "s.zarr", bad)
    s = store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 16, s.page_size, tiny.dtype, tiny.device)
    loader = ChunkLoader(store, pool)
    pages = pool.alloc(pool.pages_for(bad.padded_length))
    with pytest.raises(ChunkReadError, match=bad.chunk_id):
        loader.load(bad, pages)
    loader.prefetch([bad])  # read on a reader thread: the error reaches the load that waits for it
    with pytest.raises(ChunkReadError, match=bad.chunk_id):
        loader.load(bad, pages)
    with pytest.raises(ChunkReadError, match=bad.chunk_id):  # nothing stale is left behind
        loader.load(bad, pages)
    loader.close()
    store.close()


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_the_engine_answers_the_requests_that_do_not_need_a_corrupt_chunk(tmp_path, tiny, mode):
    store = make_store(tmp_path, "random:tiny")
    fmt = PromptFormat(tiny.tokenizer)
    bad = store.doc_chunks("nile")[1]
    corrupt(tmp_path / "s.zarr", bad)

    def requests():
        return [request(store, fmt, "nile", ["nile"], "How long?", 3),
                request(store, fmt, "iron", ["iron"], "Which symbol?", 3),
                request(store, fmt, "both", ["iron", "nile"], "Which?", 3),
                request(store, fmt, "tokyo", ["tokyo", "bach"], "When?", 3),
                request(store, fmt, "bach", ["bach"], "Where?", 3)]

    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=2)
    free_before = engine.cache.available_pages()
    done, failed = [], []
    engine.run(requests(), lambda s: done.append(s.id), on_error=lambda s, e: failed.append((s.id, e)))
    assert sorted(done) == ["bach", "iron", "tokyo"]
    assert sorted(sid for sid, _ in failed) == ["both", "nile"]
    assert all(e.chunk_id == bad.chunk_id and bad.segment in str(e) for _, e in failed)
    assert engine.cache.available_pages() == free_before  # no pin or page is left held

    again = []  # the same engine serves the next run in full
    engine.run([r for r in requests() if r.id not in ("nile", "both")], lambda s: again.append(s.id))
    assert sorted(again) == ["bach", "iron", "tokyo"]
    with pytest.raises(ChunkReadError, match=bad.chunk_id):  # no on_error: the error ends the run
        engine.run(requests()[:1], lambda s: None)
    assert engine.cache.available_pages() == free_before
    engine.close()
    store.close()


def test_answer_lists_queries_needing_a_corrupt_chunk_as_errors_and_answers_the_rest(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    store = tmp_path / "s.zarr"
    cli = CliRunner()
    built = cli.invoke(app, ["index", str(corpus), "--store", str(store), "--model", "random:tiny", "--device", "cpu",
                             "--chunk-tokens", "16", "-q"])
    assert built.exit_code == 0, built.output
    with Store.open(store) as st:
        bad = st.doc_chunks("iron")[0]
    corrupt(store, bad)
    queries = tmp_path / "q.jsonl"
    docs = {"q1": ["nile"], "q2": ["iron"], "q3": ["tokyo"], "q4": ["bach", "iron"], "q5": ["bach"]}
    queries.write_text("".join(json.dumps({"id": q, "question": "What?", "docs": d}) + "\n" for q, d in docs.items()))
    out = tmp_path / "a.jsonl"
    result = cli.invoke(app, ["answer", str(queries), "--store", str(store), "--out", str(out), "--device", "cpu",
                              "--max-new-tokens", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["q1", "q3", "q5"]
    errors = [json.loads(line) for line in (tmp_path / "a.errors.jsonl").read_text().splitlines()]
    assert sorted((e["id"], e["line"]) for e in errors) == [("q2", 2), ("q4", 4)]
    assert all(bad.chunk_id in e["error"] and bad.segment in e["error"] for e in errors)
