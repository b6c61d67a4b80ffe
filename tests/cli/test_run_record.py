"""The run log: a run saves its record every few answers and when SIGINT or SIGTERM ends it,
each save replacing the last, so `stats` shows a killed run with its counts; a run whose every query fails is recorded too;
its times have the store's one timestamp format."""

import json
import signal
import subprocess
import sys
import time

import pytest
from cli_tools import answer, cli, index_docs, last_run, write_jsonl

from lazyrag.commands.answer_run import FLUSH_EVERY
from lazyrag.store import Store
from lazyrag.store.format import timestamp

MANY = [{"id": f"q{i:02d}", "question": f"What is said about the rings, part {i}?", "docs": ["saturn"]}
        for i in range(40)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runlog")
    return index_docs(tmp / "s.zarr", tmp, "saturn", "jupiter")


def start_answer(store, queries, out):
    args = [sys.executable, "-m", "lazyrag.cli", "answer", str(queries), "--store", str(store), "--out", str(out),
            "--device", "cpu", "--cache-gb", "0.02", "--batch-size", "1", "--max-new-tokens", "24", "-q"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_rows(proc, out, n):
    deadline = time.time() + 240
    while (not out.exists() or len(out.read_text().splitlines()) < n) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "answer finished before it could be stopped"


def runs_of(store, out):
    data = json.loads(cli("stats", "--store", store, "--json").stdout)
    return [r for r in data["runs"] if r["out"] == str(out)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_run_ended_by_a_signal_is_in_the_run_log_with_its_counts(store, tmp_path, sig):
    queries, out = write_jsonl(tmp_path / "q.jsonl", *MANY), tmp_path / "a.jsonl"
    proc = start_answer(store, queries, out)
    wait_for_rows(proc, out, 2)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and b"Traceback" not in stderr, stderr
    (run,) = runs_of(store, out)
    assert run["interrupted"] is True
    assert run["queries"] == len(out.read_text().splitlines()) >= 2
    assert run["cache"]["lookups"] >= run["queries"]


def test_a_killed_run_keeps_its_counters_up_to_the_last_flush(store, tmp_path):
    queries, out = write_jsonl(tmp_path / "q.jsonl", *MANY), tmp_path / "a.jsonl"
    proc = start_answer(store, queries, out)
    wait_for_rows(proc, out, FLUSH_EVERY + 1)
    proc.kill()
    proc.wait()
    (run,) = runs_of(store, out)
    assert run["interrupted"] is True and FLUSH_EVERY <= run["queries"] <= len(out.read_text().splitlines())
    res = answer(queries, store, out, "-q")  # the resumed run is a run of its own
    assert res.exit_code == 0, res.output
    assert [r.get("interrupted", False) for r in runs_of(store, out)] == [True, False]
    with Store.open(store) as st:  # every save of a run replaced its last: the log holds one row per run
        assert [r["out"] for r in st.runs()].count(str(out)) == 2


def test_a_run_whose_every_query_fails_is_recorded(store, tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "x", "question": "Who?", "docs": ["no-such-doc"]},
                          {"id": "y", "question": "What?", "chunks": ["no-such-chunk"]})
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out, "-q")
    assert res.exit_code == 3
    run = last_run(store)
    assert run["out"] == str(out) and run["queries"] == 0 and run["failed"] == 2


def test_a_file_with_only_bad_lines_or_no_queries_is_bad_input(store, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n[1, 2]\n")
    res = answer(bad, store, tmp_path / "a.jsonl", "--model", tmp_path / "no-model")  # no model is loaded
    assert res.exit_code == 3 and f"{bad}:1" in res.stderr and f"{bad}:2" in res.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    res = answer(empty, store, tmp_path / "b.jsonl", "--model", tmp_path / "no-model")
    assert res.exit_code == 3 and "holds no queries" in res.stdout


def test_run_records_use_the_stores_timestamp_format(store, tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", MANY[0])
    assert answer(queries, store, tmp_path / "a.jsonl", "-q").exit_code == 0
    stamp = last_run(store)["time"]
    assert len(stamp) == len(timestamp()) and stamp[-6:] == timestamp()[-6:]  # same layout, same zone
    created = json.loads(cli("stats", "--store", store, "--json").stdout)["store"]["created"]
    assert len(created) == len(stamp)
