"""`lazyrag answer --data-parallel N` and `--ray-address`: CPU engine actors on the test run's Ray
cluster give the answers one engine gives, each query once in --out, also when an engine or the
driver is killed mid-run; affinity routing reads fewer chunks than round-robin; the run record
has each engine's stats."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from cli_tools import answer, cli, index_docs, last_run, rows, write_jsonl

DOCS = ["jupiter", "mars", "saturn", "mercury-planet", "nile", "amazon-river"]
# consecutive pairs share a document, so round-robin sends every document to both engines
QUERIES = [{"id": f"q{i:02d}", "question": f"What is said here, part {i}?", "docs": [DOCS[(i // 2) % len(DOCS)]]}
           for i in range(32)]
# calls of 2 x 2 queries: several calls per engine
SMALL_BATCHES = ("--batch-size", "2", "--max-new-tokens", "4", "-q")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    return index_docs(tmp / "s.zarr", tmp, *DOCS)


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("queries") / "q.jsonl", *QUERIES)


@pytest.fixture(scope="module")
def one_engine(store, queries, tmp_path_factory):
    """The answers of the plain one-engine path, by id."""
    out = tmp_path_factory.mktemp("one") / "a.jsonl"
    res = answer(queries, store, out, *SMALL_BATCHES)
    assert res.exit_code == 0, res.output
    return by_id(rows(out))


@pytest.fixture(scope="module")
def affinity_run(ray_cluster, store, queries, tmp_path_factory):
    out = tmp_path_factory.mktemp("affinity") / "a.jsonl"
    res = answer(queries, store, out, "--data-parallel", "2", *SMALL_BATCHES)
    assert res.exit_code == 0, res.output
    return rows(out), last_run(store)


def by_id(answer_rows):
    ids = [r["id"] for r in answer_rows]
    assert sorted(ids) == [q["id"] for q in QUERIES], "every query exactly once"
    return {r["id"]: (r["answer"], r["chunks"], r["new_tokens"]) for r in answer_rows}


def test_two_engines_give_the_answers_of_one(one_engine, affinity_run, store):
    answered, run = affinity_run
    assert by_id(answered) == one_engine
    assert run["settings"]["data_parallel"] == 2 and run["device"] == "2 x cpu"
    engines = run["engines"]
    assert [e["engine"] for e in engines] == [0, 1] and all(e["queries"] > 0 for e in engines)
    assert sum(e["queries"] for e in engines) == run["queries"] == len(QUERIES)
    for key in ("lookups", "hits", "misses", "bytes_read"):  # the run's counters are the engines' sums
        assert run["cache"][key] == sum(e["cache"][key] for e in engines)
    table = cli("stats", "--store", store).stdout
    assert "engine 0 (cpu on" in table and "engine 1 (cpu on" in table


def test_sampled_answers_do_not_depend_on_the_number_of_engines(ray_cluster, store, queries, tmp_path):
    sampling = ("--temperature", "1.0", "--seed", "7", *SMALL_BATCHES)
    assert answer(queries, store, tmp_path / "one.jsonl", *sampling).exit_code == 0
    assert answer(queries, store, tmp_path / "two.jsonl", "--data-parallel", "2", *sampling).exit_code == 0
    one = by_id(rows(tmp_path / "one.jsonl"))
    assert by_id(rows(tmp_path / "two.jsonl")) == one
    assert len({a for a, _, _ in one.values()}) > len(QUERIES) // 2  # sampled: mostly different answers


def test_affinity_routing_hits_the_cache_more_than_round_robin(affinity_run, store, queries, tmp_path):
    res = answer(queries, store, tmp_path / "a.jsonl", "--data-parallel", "2", "--routing", "round-robin",
                 *SMALL_BATCHES)
    assert res.exit_code == 0, res.output
    round_robin = last_run(store)
    assert round_robin["settings"]["routing"] == "round-robin"
    assert affinity_run[1]["cache"]["hit_ratio"] > round_robin["cache"]["hit_ratio"]


def test_an_engine_killed_mid_run_is_restarted_and_nothing_is_answered_twice(ray_cluster, one_engine, store,
                                                                               queries, tmp_path):
    out = tmp_path / "a.jsonl"
    killed = []

    def kill_an_engine():  # once the first answers are in, as the run goes on
        while not (out.exists() and out.read_text().count("\n") >= 1):
            time.sleep(0.005)
        name = sorted(n for n in ray_cluster.util.list_named_actors() if n.startswith("lazyrag-engine-"))[0]
        ray_cluster.kill(ray_cluster.get_actor(name))
        killed.append(name)

    killer = threading.Thread(target=kill_an_engine, daemon=True)
    killer.start()
    res = answer(queries, store, out, "--data-parallel", "2", "--batch-size", "1", "--max-new-tokens", "4", "-q")
    killer.join(timeout=10)
    assert res.exit_code == 0, res.output
    assert killed
    assert by_id(rows(out)) == one_engine
    assert sum(e["restarts"] for e in last_run(store)["engines"]) == 1


def test_a_killed_driver_resumes_on_a_re_run(ray_cluster, one_engine, store, queries, tmp_path):
    out = tmp_path / "a.jsonl"
    address = ray_cluster.get_runtime_context().gcs_address
    args = [sys.executable, "-m", "lazyrag.cli", "answer", str(queries), "--store", str(store), "--out", str(out),
            "--device", "cpu", "--cache-gb", "0.02", "--ray-address", address, "--data-parallel", "2",
            "--batch-size", "1", "--max-new-tokens", "4", "-q"]
    driver = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # the wait ends at the second answer; the deadline only bounds a hang (a loaded 2-core
    # machine has taken over 2 minutes to start two engines)
    deadline = time.time() + 600
    while not (out.exists() and out.read_text().count("\n") >= 2) and driver.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert driver.poll() is None, driver.stderr.read().decode()
    assert out.exists() and out.read_text().count("\n") >= 2, "no two answers within 600 s"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    written = out.read_text().count("\n")
    assert 2 <= written < len(QUERIES)
    res = answer(queries, store, out, "--data-parallel", "2", *SMALL_BATCHES, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["skipped_already_answered"] == written
    assert by_id(rows(out)) == one_engine


def test_without_ray_the_options_say_how_to_install_it(store, queries, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    res = answer(queries, store, tmp_path / "a.jsonl", "--data-parallel", "2")
    assert res.exit_code == 2
    assert "pip install 'lazyrag[ray]'" in res.stderr
    assert not (tmp_path / "a.jsonl").exists()


def test_audit_is_refused_with_engine_actors(store, queries, tmp_path):
    pytest.importorskip("ray")
    res = answer(queries, store, tmp_path / "a.jsonl", "--data-parallel", "2", "--audit", "2")
    assert res.exit_code == 2 and "--audit" in res.stderr
