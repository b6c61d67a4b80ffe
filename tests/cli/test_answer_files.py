"""`lazyrag answer`'s files on random:tiny: failed queries kept out of the answers and retried,
bad lines costing nothing else, one writer per answers file, a torn last line repaired."""

import fcntl
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazyrag.cli import app

DEMO = Path(__file__).parents[2] / "examples" / "demo"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def demo_docs(*ids):
    rows = [json.loads(line) for line in (DEMO / "corpus.jsonl").read_text().splitlines()]
    return "".join(json.dumps(r) + "\n" for r in rows if r["id"] in ids)


def index(store, corpus_text, tmp_path):
    corpus = tmp_path / f"c{len(list(tmp_path.glob('c*.jsonl')))}.jsonl"
    corpus.write_text(corpus_text)
    res = cli("index", corpus, "--store", store, "--model", "random:tiny", "--device", "cpu",
              "--chunk-tokens", "256", "-q")
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    path = tmp / "s.zarr"
    index(path, demo_docs("jupiter", "saturn"), tmp)
    return path


def write_queries(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def answer(queries, store, out, *args):
    return cli("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--max-new-tokens", "2", *args)


def ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_failed_queries_go_to_the_errors_file_and_the_next_run_retries_them(tmp_path):
    store = tmp_path / "s.zarr"
    index(store, demo_docs("jupiter"), tmp_path)
    queries = write_queries(tmp_path / "q.jsonl",
                            {"id": "ok", "question": "How big is Jupiter?", "docs": ["jupiter"]},
                            {"id": "later", "question": "Why is Mars red?", "docs": ["mars"]},
                            {"id": "nochunk", "question": "What?", "chunks": ["no-such-chunk"]})
    out = tmp_path / "answers.jsonl"
    errors = tmp_path / "answers.errors.jsonl"
    res = answer(queries, store, out, "--json")
    assert res.exit_code == 0, res.output
    assert ids(out) == ["ok"]
    failed = {r["id"]: r for r in map(json.loads, errors.read_text().splitlines())}
    assert set(failed) == {"later", "nochunk"} and (failed["later"]["line"], failed["nochunk"]["line"]) == (2, 3)
    assert "mars" in failed["later"]["error"] and "no-such-chunk" in failed["nochunk"]["error"]
    assert json.loads(res.stdout)["failed"] == 2
    assert json.loads(cli("stats", "--store", store, "--json").stdout)["runs"][-1]["failed"] == 2

    index(store, demo_docs("mars"), tmp_path)
    res = answer(queries, store, out)
    assert res.exit_code == 0, res.output
    assert ids(out) == ["ok", "later"]
    assert [json.loads(line)["id"] for line in errors.read_text().splitlines()] == ["nochunk"]
    assert "1 queries failed" in res.stdout and str(errors) in res.stdout.replace("\n", "")


def test_a_run_where_every_query_fails_exits_3(store, tmp_path):
    queries = write_queries(tmp_path / "q.jsonl", {"id": "x", "question": "Who?", "docs": ["no-such-doc"]})
    res = answer(queries, store, tmp_path / "a.jsonl")
    assert res.exit_code == 3
    assert "1 queries failed" in res.stdout and "no-such-doc" in res.stderr
    assert not (tmp_path / "a.jsonl").exists() or ids(tmp_path / "a.jsonl") == []


def test_a_line_that_is_not_utf8_costs_only_itself(store, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_bytes(json.dumps({"id": "a", "question": "How big is Jupiter?", "docs": ["jupiter"]}).encode()
                        + b'\n{"id": "b", "question": "Caf\xe9?", "docs": ["saturn"]}\n'
                        + json.dumps({"id": "c", "question": "Rings?", "docs": ["saturn"]}).encode() + b"\n")
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out, "--json")
    assert res.exit_code == 0, res.output
    assert sorted(ids(out)) == ["a", "c"] and f"{queries}:2:" in res.stderr
    assert json.loads(res.stdout)["bad_lines"] == 1


def test_a_second_run_on_the_same_answers_is_refused_before_the_model_loads(store, tmp_path):
    queries = write_queries(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})
    out = tmp_path / "a.jsonl"
    with open(out, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        # a model that cannot load: the refusal must come first
        res = answer(queries, store, out, "--model", tmp_path / "no-model")
    assert res.exit_code == 1
    message = res.stderr.replace("\n", "")
    assert str(out) in message and "another answer run is writing" in message
    assert out.read_text() == ""


def test_out_that_is_a_directory_is_one_error_before_the_model_loads(store, tmp_path):
    queries = write_queries(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})
    res = answer(queries, store, tmp_path, "--model", tmp_path / "no-model")
    assert res.exit_code == 2 and "is a directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_torn_last_line_is_repaired_before_appending(store, tmp_path):
    queries = write_queries(tmp_path / "q.jsonl",
                            {"id": "a", "question": "How big is Jupiter?", "docs": ["jupiter"]},
                            {"id": "b", "question": "Rings?", "docs": ["saturn"]})
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "a", "answer": "big"}\n{"id": "b", "answer": "ri')
    res = answer(queries, store, out, "--json")
    assert res.exit_code == 0, res.output
    assert ids(out) == ["a", "b"] and json.loads(res.stdout)["skipped_already_answered"] == 1
    assert "torn" in res.stderr and str(out) in res.stderr.replace("\n", "")
