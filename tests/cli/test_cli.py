"""The command line, end to end on random:tiny: index, answer, stats, bad input, resume."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazyrag.cli import app

DEMO = Path(__file__).parents[2] / "examples" / "demo"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("demo") / "s.zarr"
    res = cli("index", DEMO / "corpus.jsonl", "--store", store, "--model", "random:tiny", "--device", "cpu",
              "--chunk-tokens", "256", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["chunks_added"] == data["chunks_total"] > 36 and data["documents_total"] == 36
    for key in ("tokens_added", "tokens_total", "seconds", "store_bytes"):
        assert key in data
    return store


def test_reindex_says_nothing_new(demo_store):
    res = cli("index", DEMO / "corpus.jsonl", "--store", demo_store, "--model", "random:tiny", "--device", "cpu",
              "--chunk-tokens", "256")
    assert res.exit_code == 0 and "nothing new" in res.stdout


def test_bad_corpus_line_names_file_and_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": \n{"id": "c", "text": "also fine"}\n')
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", "--model", "random:tiny", "--device", "cpu", "-q")
    assert res.exit_code == 3
    assert f"{corpus}:2" in res.stderr
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", "--model", "random:tiny", "--device", "cpu",
              "--skip-bad", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["documents_total"] == 2 and data["bad_skipped"] == 1


def test_other_model_refused_with_both_fingerprints(demo_store):
    from lazyrag.store import Store

    stored = Store.open(demo_store).settings.fingerprint
    res = cli("index", DEMO / "corpus.jsonl", "--store", demo_store, "--model", "random:tiny", "--device", "cpu",
              "--dtype", "fp32", "--chunk-tokens", "256", "-q")  # the store's is auto's bf16
    assert res.exit_code == 4
    assert stored[:12] in res.stderr.replace("\n", "")


def test_answer_reports_bad_lines_and_unknown_docs_and_answers_the_rest(demo_store, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text("\n".join([
        json.dumps({"id": "ok1", "question": "How deep is Lake Baikal?", "answers": ["1,642 metres"]}),
        "{not json",
        json.dumps({"id": "missing", "question": "Who?", "docs": ["no-such-doc"]}),
        json.dumps({"id": "ok2", "question": "Where does the Nile flow?", "docs": ["nile"]}),
    ]) + "\n")
    out = tmp_path / "a.jsonl"
    res = cli("answer", queries, "--store", demo_store, "--out", out, "--device", "cpu", "--max-new-tokens", "4",
              "--json")
    assert res.exit_code == 0, res.output
    assert f"{queries}:2" in res.stderr and "no-such-doc" in res.stderr
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"ok1", "ok2"}  # the failed query is in a.errors.jsonl, retried next run
    for rid in ("ok1", "ok2"):
        row = rows[rid]
        for key in ("answer", "chunks", "ttft_ms", "latency_ms", "new_tokens", "cache"):
            assert key in row
        assert row["cache"]["hits"] + row["cache"]["misses"] == len(row["chunks"]) > 0
    assert "score" in rows["ok1"] and "score" not in rows["ok2"]
    summary = json.loads(res.stdout)
    assert summary["queries"] == 2 and summary["cache"]["lookups"] == sum(len(rows[i]["chunks"]) for i in ("ok1", "ok2"))

    again = cli("answer", queries, "--store", demo_store, "--out", out, "--device", "cpu", "--json")
    assert json.loads(again.stdout)["skipped_already_answered"] == 2

    stats = cli("stats", "--store", demo_store, "--json")
    data = json.loads(stats.stdout)
    for key in ("documents", "chunks", "tokens", "bytes", "model", "fingerprint"):
        assert key in data["store"]
    retry, run = data["runs"][-1], data["runs"][-2]
    assert retry["queries"] == 0 and retry["failed"] == 1  # the second run retried the failed query
    assert run["mode"] == "lazy" and run["queries"] == 2
    for key in ("lookups", "hits", "misses", "hit_ratio"):
        assert key in run["cache"]
    assert run["ttft_ms"]["p50"] is not None and run["ttft_ms"]["p95"] is not None
    assert cli("stats", "--store", demo_store).exit_code == 0


def test_answer_killed_midway_resumes_each_query_once(demo_store, tmp_path):
    out = tmp_path / "a.jsonl"
    args = [sys.executable, "-m", "lazyrag.cli", "answer", str(DEMO / "queries.jsonl"), "--store", str(demo_store),
            "--out", str(out), "--device", "cpu", "--batch-size", "1", "--max-new-tokens", "24", "-q"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while (not out.exists() or len(out.read_text().splitlines()) < 3) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "answer finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(out.read_text().splitlines())
    subprocess.run(args, check=True, capture_output=True)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    expected = [json.loads(line)["id"] for line in (DEMO / "queries.jsonl").read_text().splitlines()]
    assert 0 < partial < len(expected)
    assert sorted(ids) == sorted(expected)  # every query, exactly once


def test_stats_into_a_reader_that_stopped_reading_exits_quietly(demo_store):
    # `lazyrag stats --json | head -c 1`: the pipe closes before stats writes
    args = [sys.executable, "-m", "lazyrag.cli", "stats", "--store", str(demo_store), "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr and "error" not in stderr


def test_help_explains_the_commands():
    res = cli("--help")
    assert res.exit_code == 0
    for command in ("index", "answer", "stats"):
        assert command in res.stdout
    assert "--cache-gb" in cli("answer", "--help").stdout


def test_option_defaults_are_the_config_defaults():
    """The CLI reads every default from lazyrag.config, so the two cannot drift apart."""
    import dataclasses

    import typer.main

    from lazyrag.config import AnswerConfig, IndexConfig

    group = typer.main.get_command(app)
    field_of = {"out_path": "out"}  # parameter names that differ from the config field
    for command, config_cls in (("index", IndexConfig), ("answer", AnswerConfig)):
        options = {field_of.get(p.name, p.name): p.default for p in group.commands[command].params}
        checked = 0
        for f in dataclasses.fields(config_cls):
            if f.name in options and f.default is not dataclasses.MISSING:
                assert options[f.name] == f.default, (command, f.name)
                checked += 1
        assert checked >= 8, command


def test_unknown_mode_is_a_usage_error():
    res = cli("answer", "q.jsonl", "--mode", "fast")
    assert res.exit_code == 2 and "lazy" in res.output and "block" in res.output



AUDIT_KEYS = {"queries", "identical", "f1_to_full", "kl_mean", "top1_agreement", "tokens"}


def demo_queries(tmp_path, n, single_chunk_of=None):
    """The first n demo queries; with a store, each reads only the first chunk of its first doc."""
    rows = [json.loads(line) for line in (DEMO / "queries.jsonl").read_text().splitlines()][:n]
    if single_chunk_of is not None:
        rows = [{"id": q["id"], "question": q["question"],
                 "chunks": [single_chunk_of.doc_chunks(q["docs"][0])[0].chunk_id]} for q in rows]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in rows))
    return path


def answer_with_audit(store, queries, out, *args):
    """The audit of an `answer` run, as the run log holds it; and what `answer` printed."""
    res = cli("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--max-new-tokens", "6", *args)
    assert res.exit_code == 0, res.output
    audit = json.loads(cli("stats", "--store", store, "--json").stdout)["runs"][-1]["audit"]
    assert set(audit) == AUDIT_KEYS
    return audit, res.stdout


def test_audit_records_the_distance_to_full_and_the_tables_show_it(demo_store, tmp_path):
    audit, printed = answer_with_audit(demo_store, demo_queries(tmp_path, 4), tmp_path / "a.jsonl", "--audit", 3)
    assert audit["queries"] == 3 and 0 < audit["tokens"] <= 3 * 6
    assert audit["kl_mean"] > 1e-6  # several chunks a query: lazy is not full
    assert 0 <= audit["identical"] <= 1 and 0 <= audit["top1_agreement"] <= 1
    for shown in (printed, cli("stats", "--store", demo_store).stdout):
        assert "vs full attention (audit)" in shown and "identical" in shown


def test_audit_of_full_is_identical(demo_store, tmp_path):
    audit, _ = answer_with_audit(demo_store, demo_queries(tmp_path, 2), tmp_path / "a.jsonl", "--mode", "full",
                                 "--audit", 2)
    assert audit["queries"] == 2 and audit["identical"] == 1.0 and audit["top1_agreement"] == 1.0
    assert audit["kl_mean"] < 1e-9


def test_audit_of_lazy_on_single_chunk_prompts_matches_full(demo_store, tmp_path):
    """One chunk after the preamble is encoded exactly as full encodes it: any gap here is a bug,
    not the modelling gap between chunks."""
    from lazyrag.store import Store

    with Store.open(demo_store) as store:
        queries = demo_queries(tmp_path, 4, single_chunk_of=store)
    audit, _ = answer_with_audit(demo_store, queries, tmp_path / "a.jsonl", "--audit", 10, "--json")
    assert audit["queries"] == 4  # every answered query, when fewer than asked
    assert audit["kl_mean"] < 1e-6 and audit["identical"] == 1.0 and audit["top1_agreement"] == 1.0


def test_ape_is_recorded_and_audited_against_plain_full_and_refused_in_full(demo_store, tmp_path):
    queries = demo_queries(tmp_path, 2)
    audit, _ = answer_with_audit(demo_store, queries, tmp_path / "a.jsonl", "--ape-temperature", 0.8,
                                 "--ape-scale", 1.5, "--audit", 2)
    assert audit["queries"] == 2
    settings = json.loads(cli("stats", "--store", demo_store, "--json").stdout)["runs"][-1]["settings"]
    assert (settings["ape_temperature"], settings["ape_scale"]) == (0.8, 1.5)
    res = cli("answer", queries, "--store", demo_store, "--out", tmp_path / "f.jsonl", "--device", "cpu",
              "--mode", "full", "--ape-temperature", 0.8)
    assert res.exit_code == 3 and "lazy and block only" in res.output  # an option refused before the load
