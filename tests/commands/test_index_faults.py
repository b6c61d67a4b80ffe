"""Fault injection: `lazyrag index` killed (SIGKILL) at seeded random points, resumed each time.
After every kill readers see each document whole or not at all, every chunk reads back against
its checksum, and no orphan is visible; the finished store holds the KV of a clean build."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from forked_cli import ForkServer

from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.store import Store

WORDS = ("river town bridge flood stone iron gold north south empire king queen war peace harbour ship "
         "mountain valley forest lake").split()
OPTIONS = dict(model="random:tiny", device="cpu", chunk_tokens=16, batch_tokens=64)
KILLS = 10


def write_corpus(path: Path, seed: int = 15) -> Path:
    """30 documents of 3 to 90 words, some of several paragraphs."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(30):
            words = [rng.choice(WORDS) for _ in range(rng.choice([3, 10, 30, 90]))]
            paragraphs = [" ".join(words[j: j + 30]).capitalize() + "." for j in range(0, len(words), 30)]
            f.write(json.dumps({"id": f"d{i:02d}", "text": "\n\n".join(paragraphs)}) + "\n")
    return path


def chunk_rows(store: Path) -> int:
    try:
        with sqlite3.connect(f"file:{store / 'catalog.sqlite'}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    except sqlite3.Error:
        return 0


def assert_consistent(path: Path, whole: dict[str, list[str]]) -> None:
    """What a reader sees after a kill: each document whole (its chunk list as in ``whole``) or
    not at all, every chunk verifying against its checksum, no orphan chunk."""
    if not (path / "zarr.json").exists():
        return  # killed before the store was created
    with Store.open(path) as st:
        report = st.check()
        assert not (report.corrupt or report.missing or report.dangling or report.missing_segments), report
        for doc in st.documents():
            assert [c.chunk_id for c in st.doc_chunks(doc)] == whole[doc]
        assert st.summary()["unreferenced_chunks"] == 0


def test_index_killed_at_random_points_resumes_to_a_clean_build(tmp_path, tiny_bf16):
    corpus = write_corpus(tmp_path / "c.jsonl")
    clean, killed = tmp_path / "clean.zarr", tmp_path / "killed.zarr"
    build_index(IndexConfig(corpus=corpus, store=clean, **OPTIONS), progress=False, loaded=tiny_bf16)
    with Store.open(clean) as want:
        whole = {doc: [c.chunk_id for c in want.doc_chunks(doc)] for doc in want.documents()}
    args = ["index", str(corpus), "--store", str(killed), "-q", "--model", OPTIONS["model"], "--device", "cpu",
            "--chunk-tokens", "16", "--batch-tokens", "64"]
    # the first run is a fresh interpreter, killed while it starts up; the others are forked
    # from one that has imported lazyrag already, and killed once they have stored something
    first = subprocess.Popen([sys.executable, "-m", "lazyrag.cli", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    time.sleep(random.Random(2024).uniform(0.5, 2.0))
    assert first.poll() is None, "index ended before it could be killed while starting up"
    first.kill()
    assert first.wait() == -signal.SIGKILL
    assert_consistent(killed, whole)
    rng = random.Random(2024)
    server = ForkServer()
    killed_mid_index = 0
    try:
        for run in range(1, KILLS):
            before = chunk_rows(killed)
            proc = server.run(args, tmp_path / f"run{run}.err")
            deadline = time.time() + 60
            while chunk_rows(killed) <= before and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.15))
            proc.kill()
            assert proc.wait() == -signal.SIGKILL, f"run {run} was not killed: {proc.error_tail()}"
            killed_mid_index += chunk_rows(killed) > before
            assert_consistent(killed, whole)
        assert killed_mid_index >= 3, "too few kills landed while chunks were being stored"
        finish = server.run(args, tmp_path / "finish.err")
        assert finish.wait() == 0, finish.error_tail()
    finally:
        server.close()

    with Store.open(killed) as got, Store.open(clean) as want:
        assert got.check().ok and got.summary()["unreferenced_chunks"] == 0
        assert {doc: [c.chunk_id for c in got.doc_chunks(doc)] for doc in got.documents()} == whole
        kv_got = {c.chunk_id: got.read_kv(c).float().numpy() for c in got.iter_chunks()}
        kv_want = {c.chunk_id: want.read_kv(c).float().numpy() for c in want.iter_chunks()}
    assert sorted(kv_got) == sorted(kv_want)
    for cid, kv in kv_want.items():  # batches differ between the runs: fp32 sums in another order, bf16 (2**-8)
        np.testing.assert_allclose(kv_got[cid], kv, rtol=2**-7, atol=1e-5)
