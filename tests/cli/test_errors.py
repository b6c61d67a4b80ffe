"""One line on stderr and an exit code by class for every failure: 2 usage, 3 bad input,
4 store damaged or incompatible, 5 resources, 1 anything else (with LAZYRAG_DEBUG=1 for the
traceback). Inputs and options are checked before the model loads."""

import json
import shutil

import pytest
from cli_tools import TINY, answer, cli, index_docs, write_jsonl

NO_MODEL = ("--model", "/no/such/model")  # loading it would fail: an error about it means the check came too late


def one_error_line(res):
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    return index_docs(tmp / "s.zarr", tmp, "jupiter", "saturn")


@pytest.fixture
def queries(tmp_path):
    return write_jsonl(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})


def test_device_gpu_is_a_usage_error_naming_the_choices(store, queries, tmp_path):
    for args in (("answer", queries, "--store", store, "--out", tmp_path / "a.jsonl"),
                 ("index", queries, "--store", tmp_path / "new.zarr", "--model", "random:tiny")):
        res = cli(*args, "--device", "gpu")
        assert res.exit_code == 2
        assert "cpu, cuda or cuda:N" in one_error_line(res)


def test_a_page_size_the_kernels_cannot_take_is_refused_before_a_store_exists(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "a", "text": "Some text."})
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "--page-size", 7)
    assert res.exit_code == 2 and "16, 32, 64, 128" in one_error_line(res)
    assert not (tmp_path / "s.zarr").exists()
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "--page-size", 16, "-q")
    assert res.exit_code == 0, res.output  # nothing left behind fixes the page size


def test_a_missing_corpus_is_bad_input_reported_before_the_model_loads(tmp_path):
    res = cli("index", tmp_path / "missing.jsonl", "--store", tmp_path / "s.zarr", *NO_MODEL, "--device", "cpu")
    assert res.exit_code == 3 and "missing.jsonl" in one_error_line(res)
    assert not (tmp_path / "s.zarr").exists()


def test_a_missing_queries_file_is_bad_input_reported_before_the_model_loads(store, tmp_path):
    res = cli("answer", tmp_path / "missing.jsonl", "--store", store, "--out", tmp_path / "a.jsonl",
              "--device", "cpu", *NO_MODEL)
    assert res.exit_code == 3 and "missing.jsonl" in one_error_line(res)


def test_an_unexpected_error_is_one_line_and_its_traceback_only_with_lazyrag_debug(store, monkeypatch):
    import lazyrag.commands.stats

    def broken(path):
        raise RuntimeError("boom")

    monkeypatch.setattr(lazyrag.commands.stats, "stats_json", broken)
    res = cli("stats", "--store", store)
    line = one_error_line(res)
    assert res.exit_code == 1 and "RuntimeError: boom" in line and "LAZYRAG_DEBUG=1" in line
    res = cli("stats", "--store", store, env={"LAZYRAG_DEBUG": "1"})
    assert res.exit_code == 1 and "Traceback" in res.stderr and "boom" in res.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_catalog_is_a_store_error(store, tmp_path, damage):
    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    catalog = copy / "catalog.sqlite"
    data = catalog.read_bytes()
    catalog.write_bytes(b"not a database at all " * 64 if damage == "garbage" else data[: len(data) // 3])
    for wal in copy.glob("catalog.sqlite-*"):
        wal.unlink()
    res = cli("stats", "--store", copy)
    assert res.exit_code == 4, res.output
    one_error_line(res)


@pytest.mark.parametrize("damage, says", [("no settings", "holds no settings"),
                                           ("wrong types", "'num_layers' is a string, expected an integer"),
                                           ("a list of strings", "'preamble_ids' is a list, expected a list of integers"),
                                           ("a version string", "format_version is a string, not a positive integer")])
def test_a_zarr_json_without_settings_or_with_wrong_types_is_a_store_error_naming_it(store, tmp_path, damage, says):
    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    meta = json.loads((copy / "zarr.json").read_text())
    attributes = meta["attributes"]["lazyrag"]
    if damage == "no settings":
        del attributes["settings"]
    elif damage == "wrong types":
        attributes["settings"]["num_layers"] = "two"
    elif damage == "a list of strings":
        attributes["settings"]["preamble_ids"] = ["1", "2"]
    else:
        attributes["format_version"] = "2"
    (copy / "zarr.json").write_text(json.dumps(meta))
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})
    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "a", "text": "Some text."})
    for args in (("stats",), ("check",), ("compact",), ("answer", queries, "--out", tmp_path / "a.jsonl", *TINY),
                 ("index", corpus, *TINY)):
        res = cli(*args, "--store", copy)
        assert res.exit_code == 4, (args, res.output)
        line = one_error_line(res)
        assert str(copy / "zarr.json") in line and says in line, line


def test_retrieval_on_an_empty_store_fails_the_query_not_the_run(tiny, tmp_path, queries):
    from lazyrag.commands.index import store_settings
    from lazyrag.store import Store

    empty = tmp_path / "empty.zarr"
    Store.create_or_open(empty, store_settings(tiny, "random:tiny", 256, 64)).close()
    retrieve = write_jsonl(tmp_path / "r.jsonl", {"id": "r", "question": "Anything?"})
    res = answer(retrieve, empty, tmp_path / "a.jsonl")
    assert res.exit_code == 3 and "Traceback" not in res.output
    (failed,) = [json.loads(line) for line in (tmp_path / "a.errors.jsonl").read_text().splitlines()]
    assert failed["id"] == "r" and "no chunks" in failed["error"]


def test_a_cache_too_small_for_one_request_says_what_it_needs(store, queries, tmp_path):
    res = answer(queries, store, tmp_path / "a.jsonl", "--cache-gb", "0.0001", "-q")
    # the query is refused in the errors file; answering none for want of memory is exit 5
    warning, line = res.stderr.strip().splitlines()
    assert warning.startswith("warning: ") and line.startswith("error: no query was answered")
    assert res.exit_code == 5 and "raise --cache-gb to at least" in line and "--max-prompt-tokens" in line
    (refused,) = [json.loads(r) for r in (tmp_path / "a.errors.jsonl").read_text().splitlines()]
    assert refused["id"] == "a" and "raise --cache-gb" in refused["error"]
    needed = line.rsplit("at least ", 1)[1].split()[0].rstrip(",")
    res = answer(queries, store, tmp_path / "a.jsonl", "--cache-gb", needed)
    assert res.exit_code == 0, res.output  # the size it named is enough


def test_usage_errors_of_click_are_one_line_too(queries):
    res = cli("answer", queries, "--mode", "fast")
    assert res.exit_code == 2 and "lazy" in one_error_line(res)

