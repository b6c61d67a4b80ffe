"""`answer` checks its options and its --out before the model loads (lazyrag/commands/answer_checks.py),
each refusal one line with its exit code and nothing touched or left behind; and the other
findings' exit codes: an unwritable --out, a damaged run record under `stats`, SIGTERM during
`index`, out of memory at run level (random:tiny on the CPU)."""

import json
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from cli_tools import TINY, answer, cli, index_docs, write_jsonl

from lazyrag.failures import classify

NO_MODEL = ("--model", "/no/such/model")  # loading it would fail: an error about it means the check came too late


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checks")
    return index_docs(tmp / "s.zarr", tmp, "jupiter", "saturn")


@pytest.fixture
def queries(tmp_path):
    return write_jsonl(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})


def refused(res, code, *words):
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == code, res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("content", [b"my notes\nlast line\n", b"my notes\nlast line", b'{"id": "x"}\n',
                                     b"SQLite format 3\x00\x10\x00"])
def test_an_out_that_is_not_an_answers_file_is_refused_and_left_as_it_was(store, queries, tmp_path, content):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    refused(answer(queries, store, notes, *NO_MODEL), 3, "not an answers file")
    assert notes.read_bytes() == content


def test_an_out_inside_the_store_or_equal_to_the_queries_file_is_refused(store, queries, tmp_path):
    catalog = store / "catalog.sqlite"
    before = catalog.read_bytes()
    refused(answer(queries, store, catalog, *NO_MODEL), 3, "inside the store")
    assert catalog.read_bytes() == before
    refused(answer(queries, store, store / "new.jsonl", *NO_MODEL), 3, "inside the store")
    assert not (store / "new.jsonl").exists()
    text = queries.read_text()
    refused(answer(queries, store, queries, *NO_MODEL), 3, "is the queries file")
    assert queries.read_text() == text


@pytest.mark.parametrize("option, says", [
    (("--recompute-policy", "bogus"), "--recompute-policy 'bogus': choose head or attention"),
    (("--ape-scale", "0"), "--ape-scale must be a positive"),
    (("--ape-temperature", "-1"), "--ape-temperature must be a positive"),
    (("--recompute-layer", "99"), "--recompute-layer 99 is past the last layer"),
    (("--device", "cuda:99"), "--device cuda:99: torch sees"),
    (("--host-cache-gb", "-1"), "--host-cache-gb must be 0"),
    (("--max-new-tokens", "1000000"), "--max-new-tokens 1,000,000 leaves no room"),
    (("--cache-gb", "-5"), "--cache-gb must be a positive"),
])
def test_every_option_is_checked_before_the_model_loads(store, queries, tmp_path, option, says):
    out = tmp_path / "a.jsonl"
    args = option if option[0] == "--max-new-tokens" else (*option, *NO_MODEL)  # that one reads the store's model
    refused(answer(queries, store, out, *args), 3, says)
    assert not out.exists()


def test_a_cache_the_machine_cannot_hold_is_a_resource_error_before_the_model_loads(store, queries, tmp_path):
    refused(answer(queries, store, tmp_path / "a.jsonl", "--cache-gb", "100000", *NO_MODEL), 5,
            "--cache-gb 100000 is more than", "lower --cache-gb")


def test_the_cpu_allocators_out_of_memory_is_exit_5_with_a_hint():
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 57892878336 bytes. Error code 12 (Cannot allocate memory)")
    failure = classify(exc)
    assert failure.code == 5 and failure.message.startswith("out of memory (DefaultCPUAllocator")
    assert "lower --cache-gb" in failure.message and "LAZYRAG_DEBUG" not in failure.message


def test_an_out_that_cannot_be_written_is_bad_input(store, queries, tmp_path):
    (tmp_path / "file").write_text("x")
    refused(answer(queries, store, tmp_path / "file" / "a.jsonl", *NO_MODEL), 3, "cannot write the answers file")


def test_no_empty_out_is_left_when_the_queries_file_is_missing_or_the_store_refused(store, tmp_path):
    out = tmp_path / "a.jsonl"
    refused(answer(tmp_path / "missing.jsonl", store, out, *NO_MODEL), 3, "cannot read the queries file")
    assert not out.exists()
    q = write_jsonl(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?"})
    res = answer(q, store, out, "--model", "random:smollm2-135m", "-q")  # another fingerprint: refused
    assert res.exit_code == 4, res.output
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_a_damaged_run_record_is_a_store_error_naming_the_run(store, queries, tmp_path):
    damaged = tmp_path / "damaged.zarr"
    import shutil

    shutil.copytree(store, damaged)
    assert answer(queries, damaged, tmp_path / "a.jsonl", "-q").exit_code == 0
    with sqlite3.connect(damaged / "catalog.sqlite") as db:
        run_id = db.execute("SELECT run_id FROM runs").fetchone()[0]
        db.execute("UPDATE runs SET record = '{not json'")
    refused(cli("stats", "--store", damaged), 4, f"record of run {run_id} is damaged", "DELETE FROM runs")
    with sqlite3.connect(damaged / "catalog.sqlite") as db:
        db.execute("UPDATE runs SET record = '[1, 2]'")
    refused(cli("stats", "--store", damaged, "--json"), 4, "not a run record")


def test_sigterm_during_index_is_exit_130_with_a_message(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3000):
        (corpus / f"d{i}.txt").write_text(f"Document {i} is about letters and numbers. " * 8)
    store = tmp_path / "s.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "lazyrag.cli", "index", str(corpus), "--store", str(store),
                             *TINY, "-q"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (store / "zarr.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "index ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted; run the same command again to resume"


def test_a_run_record_that_cannot_be_written_beside_out_leaves_no_tmp_file(store, queries, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from lazyrag.store import Store

    def read_only(self, run_id, record):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    real_write = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        if self.name.endswith(".run.json.tmp"):
            real_write(self, "")  # created, then nothing fits
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Store, "save_run", read_only)
    monkeypatch.setattr(Path, "write_text", disk_full)
    res = answer(queries, store, tmp_path / "a.jsonl", "-q")
    assert res.exit_code == 0, res.output
    assert "could not write the run's record" in res.stderr
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "a.run.json").exists()
