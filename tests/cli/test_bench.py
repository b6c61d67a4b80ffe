"""`lazyrag bench` end to end on random:tiny stores: the rows of --json, full's exact fidelity,
the plot, options refused before the model loads, no answers file, and the bench run in stats."""
import json
import sys

import pytest

from cli_tools import cli, index_docs, last_run, write_jsonl

from lazyrag.commands import answer_engine, bench
from lazyrag.commands.bench import ROW_KEYS

DOCS = ("saturn", "jupiter", "mars", "piano", "violin")
FAST = ("--device", "cpu", "--cache-gb", "0.05", "--limit", "4", "--max-new-tokens", "4")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    index_docs(root / "s.zarr", root, *DOCS)
    queries = write_jsonl(root / "q.jsonl", *[
        {"id": f"q{i}", "question": f"Which planet or instrument is number {i}?", "docs": [DOCS[i % 5], DOCS[(i + 1) % 5]]}
        for i in range(6)])
    return root / "s.zarr", queries


def bench_json(store, queries, *args):
    res = cli("bench", queries, "--store", store, *FAST, "--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_rows_carry_the_documented_keys_and_full_is_exact(store, tmp_path):
    path, queries = store
    before = sorted(p.name for p in queries.parent.iterdir())
    plot = tmp_path / "frontier.png"
    rec = bench_json(path, queries, "--modes", "lazy,full", "--recompute", "0,0.5", "--batch-sizes", "4",
                     "--warm", "--plot", plot)
    rows = rec["bench"]
    assert [(r["mode"], r["recompute"], r["pass"]) for r in rows] == [
        ("full", None, "cold"), ("full", None, "warm"), ("lazy", 0.0, "cold"), ("lazy", 0.0, "warm"),
        ("lazy", 0.5, "cold"), ("lazy", 0.5, "warm")]
    assert all(set(r) == set(ROW_KEYS) for r in rows)
    assert all(r["queries"] == 4 and r["batch_size"] == 4 and r["failed"] == 0 for r in rows)
    full = rows[0]
    assert (full["kl_mean"], full["identical"], full["top1_agreement"], full["f1_to_full"]) == (0.0, 1.0, 1.0, 1.0)
    assert rows[3]["hit_ratio"] == 1.0  # the warm pass finds every chunk resident
    assert all(r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 1 for r in rows)
    # the plot is a PNG; nothing else was written beside the queries (no answers file)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in queries.parent.iterdir()) == before


def test_the_run_shows_in_stats_as_a_bench_run(store):
    path, queries = store
    rec = bench_json(path, queries, "--modes", "block", "--recompute", "0", "--batch-sizes", "2")
    run = last_run(path)
    assert run["kind"] == "bench" and run["mode"] == "bench"
    assert run["bench"] == rec["bench"] and run["configurations"] == ["block 0 @2"]
    assert "interrupted" not in run
    shown = cli("stats", "--store", path)
    assert shown.exit_code == 0 and "bench: 1 configurations on 4 queries" in shown.stdout


def test_every_row_key_is_documented_in_help():
    text = " ".join(cli("bench", "--help").stdout.split())
    assert all(key in text for key in ROW_KEYS)


@pytest.mark.parametrize("option, value, says", [
    ("--modes", "lazy,fast", "unknown mode 'fast'"),
    ("--modes", "", "no empty item"),
    ("--recompute", "0,1.5", "'1.5' is not a share in [0, 1]"),
    ("--recompute", "0,,0.1", "no empty item"),
    ("--batch-sizes", "0", "at least 1"),
])
def test_bad_options_exit_3_before_the_model_loads(store, monkeypatch, option, value, says):
    path, queries = store

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(answer_engine, "load_model_for", no_model)
    monkeypatch.setattr(bench, "load_model_for", no_model)
    res = cli("bench", queries, "--store", path, *FAST, option, value)
    assert res.exit_code == 3, res.output
    assert says in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_plot_without_matplotlib_names_the_install(store, monkeypatch, tmp_path):
    path, queries = store
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    res = cli("bench", queries, "--store", path, *FAST, "--plot", tmp_path / "f.png")
    assert res.exit_code == 3 and "pip install matplotlib" in res.stderr
    assert not (tmp_path / "f.png").exists()


def test_synthetic_writes_indexes_and_benches_the_paper_workload(tmp_path):
    work, path = tmp_path / "work", tmp_path / "s.zarr"
    res = cli("bench", "--synthetic", "paper", "--docs", "8", "--doc-tokens", "64", "--work", work,
              "--store", path, "--index-model", "random:tiny", *FAST, "--modes", "lazy,full", "--recompute", "0",
              "--batch-sizes", "4", "--json", "-q")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["bench"]
    assert [r["mode"] for r in rows] == ["full", "lazy"] and all(r["queries"] == 4 for r in rows)
    queries = [json.loads(line) for line in (work / "queries.jsonl").read_text().splitlines()]
    assert len(queries) == 4 and all(len(q["docs"]) == 5 for q in queries)
    assert len((work / "corpus.jsonl").read_text().splitlines()) == 8
    run = last_run(path)
    assert run["kind"] == "bench" and run["synthetic"] == "paper"


@pytest.mark.parametrize("with_queries, args, says", [
    (True, ("--synthetic", "paper"), "one of the two"),
    (False, (), "one of the two"),
    (False, ("--synthetic", "zipf3"), "choose paper or uniform"),
])
def test_queries_or_synthetic_is_named_once(store, with_queries, args, says):
    path, queries = store
    res = cli("bench", *([queries] if with_queries else []), *args, "--store", path, *FAST)
    assert res.exit_code == 3 and says in res.stderr, res.output


def test_staging_is_pinned_while_the_model_loads_and_before_the_first_pass(store, monkeypatch):
    """So the first configuration's cold pass pins no buffer that the later ones find pinned."""
    path, queries = store
    calls = []
    load, measure = bench.load_model_for, bench.Bench.measure
    monkeypatch.setattr(bench, "pin_staging_ahead", lambda s, device: calls.append(("pin", device.type)))
    monkeypatch.setattr(bench, "load_model_for", lambda s, cfg: calls.append("load") or load(s, cfg))
    monkeypatch.setattr(bench, "wait_staging_pinned", lambda: calls.append("wait"))
    monkeypatch.setattr(bench.Bench, "measure", lambda self, *a: calls.append("measure") or measure(self, *a))
    bench_json(path, queries, "--modes", "lazy", "--recompute", "0", "--batch-sizes", "4")
    assert calls == [("pin", "cpu"), "load", "wait", "measure"]
