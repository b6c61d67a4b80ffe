"""`lazyrag index --workers N`: two encoding processes store what one stores; a run killed part-way
(the index process, or one of its workers) resumes with nothing stored twice; a worker's failure
is one line naming it, with the exit code one process gives; more workers than GPUs is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forked_cli import ForkServer
from test_index_faults import assert_consistent, chunk_rows, write_corpus
from typer.testing import CliRunner

from lazyrag.cli import app
from lazyrag.commands.index import build_index, store_settings
from lazyrag.commands.index_workers import worker_of
from lazyrag.config import IndexConfig
from lazyrag.store import Store

OPTIONS = dict(model="random:tiny", device="cpu", chunk_tokens=16, batch_tokens=64)
ARGS = ["--model", "random:tiny", "--device", "cpu", "--chunk-tokens", "16", "--batch-tokens", "64", "-q"]


def lazyrag(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def contents(path: Path) -> tuple[dict, dict, dict]:
    """A store as readers see it: each document's chunk ids, each chunk's tokens and text, its KV."""
    with Store.open(path) as st:
        assert st.check().ok
        documents = {doc: [c.chunk_id for c in st.doc_chunks(doc)] for doc in st.documents()}
        chunks = {c.chunk_id: (c.token_ids, c.text) for c in st.iter_chunks()}
        kv = {c.chunk_id: st.read_kv(c).float().numpy() for c in st.iter_chunks()}
    return documents, chunks, kv


def stored_rows(path: Path) -> int:
    """Rows of KV in the store's segments: a chunk stored twice counts twice."""
    with sqlite3.connect(path / "catalog.sqlite") as db:
        return db.execute("SELECT SUM(rows) FROM segments").fetchone()[0]


def assert_same_store(got: Path, want: Path) -> None:
    got_docs, got_chunks, got_kv = contents(got)
    want_docs, want_chunks, want_kv = contents(want)
    assert got_docs == want_docs and got_chunks == want_chunks
    assert stored_rows(got) == stored_rows(want)
    for cid, kv in want_kv.items():  # other batches: fp32 sums in another order, then bf16's rounding (2**-8)
        np.testing.assert_allclose(got_kv[cid], kv, rtol=2**-7, atol=1e-5)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_bf16):
    """A corpus (a text two documents on different workers share, a bad line) and its store built
    by one process, with that build's result."""
    tmp = tmp_path_factory.mktemp("workers")
    corpus = write_corpus(tmp / "c.jsonl")
    shared = "The harbour of the north held a hundred ships."
    assert worker_of("copy-0", 2) != worker_of("copy-4", 2)
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "copy-0", "text": shared}) + "\n" + json.dumps({"id": "copy-4", "text": shared})
                + "\n{not json\n")
    one = tmp / "one.zarr"
    result = build_index(IndexConfig(corpus=corpus, store=one, skip_bad=True, **OPTIONS), report=lambda m: None,
                         progress=False, loaded=tiny_bf16)
    return corpus, one, result


def test_two_workers_store_what_one_process_stores(tmp_path, built):
    corpus, one, want = built
    two = tmp_path / "two.zarr"
    result = lazyrag("index", corpus, "--store", two, *ARGS, "--skip-bad", "--workers", "2", "--json")
    assert result.exit_code == 0, result.output
    assert result.output.count("skipped:") == 1  # the bad line is reported once, not by each worker
    got = json.loads(result.stdout)
    for key in ("chunks_added", "chunks_total", "tokens_added", "tokens_total", "documents_total", "bad_skipped"):
        assert got[key] == want.to_json()[key], key
    assert_same_store(two, one)
    counts = [{k: v for k, v in json.loads(lazyrag("stats", "--store", s, "--json").stdout)["store"].items()
               if k in ("documents", "chunks", "tokens", "padded_tokens", "unreferenced_chunks")} for s in (one, two)]
    assert counts[0] == counts[1]


def workers_of(pid: int) -> list[int]:
    """The pids of an index process's workers (its spawned children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def committed_chunks(store: Path) -> int:
    """Chunk rows in the catalog, read with recovery (a killed writer may leave its WAL to recover)."""
    if not (store / "catalog.sqlite").exists():
        return 0
    with sqlite3.connect(store / "catalog.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]


def wait_for_more_rows(store: Path, run, before: int) -> None:
    deadline = time.time() + 600  # bounds a hang only: the wait ends at the first new row
    while chunk_rows(store) <= before and run.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert run.poll() is None, f"index ended before it could be killed: {run.error_tail()}"


def answers(store: Path, queries: Path, out: Path) -> dict[str, str]:
    result = lazyrag("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--cache-gb", "0.02",
                     "--max-new-tokens", "4", "-q")
    assert result.exit_code == 0, result.output
    return {row["id"]: row["answer"] for row in map(json.loads, out.read_text().splitlines())}


def test_a_killed_index_or_worker_resumes_with_nothing_stored_twice(tmp_path, built):
    corpus, clean, _ = built
    killed = tmp_path / "killed.zarr"
    whole = contents(clean)[0]
    args = ["index", corpus, "--store", killed, *ARGS, "--skip-bad", "--workers", "2"]
    server = ForkServer()
    try:
        # the index process killed once it has committed segments: its workers end with it
        run = server.run(args, tmp_path / "run1.err")
        wait_for_more_rows(killed, run, 0)
        run.kill()
        assert run.wait() == -signal.SIGKILL
        assert_consistent(killed, whole)
        # one worker killed: the run ends at once, naming it
        run = server.run(args, tmp_path / "run2.err")
        wait_for_more_rows(killed, run, committed_chunks(killed))
        os.kill(workers_of(run.pid)[0], signal.SIGKILL)
        assert run.wait() == 1
        errors = [line for line in run.error_tail().splitlines() if not line.startswith("skipped:")]
        assert len(errors) == 1, errors
        assert errors[0].startswith("error: index worker ") and "killed by SIGKILL" in errors[0]
        assert "run the same command again to resume" in errors[0]
        assert_consistent(killed, whole)
        assert committed_chunks(killed) < len(contents(clean)[1])
        finish = server.run(args, tmp_path / "finish.err")
        assert finish.wait() == 0, finish.error_tail()
    finally:
        server.close()
    assert_same_store(killed, clean)
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": f"q{i}", "question": "Which river?", "docs": [f"d{i:02d}"]}) + "\n"
                               for i in (3, 7, 12)))
    assert answers(killed, queries, tmp_path / "a1.jsonl") == answers(clean, queries, tmp_path / "a2.jsonl")


def test_a_worker_that_fails_ends_the_run_in_one_line_with_the_exit_code_of_one_process(tmp_path, tiny):
    corpus = write_corpus(tmp_path / "c.jsonl")
    results = []
    for workers in ("1", "2"):
        store = tmp_path / f"s{workers}.zarr"
        Store.create_or_open(store, store_settings(tiny, "random:tiny", 16, 64)).close()
        shutil.rmtree(store / "segments", ignore_errors=True)
        (store / "segments").touch()  # a disk that refuses the segments' writes
        results.append(lazyrag("index", corpus, "--store", store, *ARGS, "--workers", workers))
    one, two = results
    assert one.exit_code == two.exit_code != 0
    assert "Not a directory" in one.stderr and "Not a directory" in two.stderr
    assert len(two.stderr.strip().splitlines()) == 1
    assert two.stderr.startswith("error: index worker ") and "the same command resumes" in two.stderr


def test_more_workers_than_gpus_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    corpus = write_corpus(tmp_path / "c.jsonl")
    for device, says in (("cuda", "use --workers 1 or fewer"), ("cuda:0", "pass --device cuda")):
        result = lazyrag("index", corpus, "--store", tmp_path / "s.zarr", "--model", "random:tiny", "--device", device,
                         "--workers", "2")
        assert result.exit_code == 2 and says in result.stderr, result.output
    assert not (tmp_path / "s.zarr").exists()
