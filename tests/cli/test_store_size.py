"""How big a store is: the default (bf16 on every device) against fp32, the estimate `index` prints
before it starts, the size its summary names after, and fp32 stores made before the default changed."""

import json
import re

from cli_tools import TINY, cli, demo_docs, write_jsonl

from lazyrag.store import Store

DOCS = ("jupiter", "mars", "saturn", "gold", "tokyo")


def corpus_file(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(demo_docs(*DOCS))
    return corpus


def segment_bytes(store) -> int:
    return sum(p.stat().st_size for p in (store / "segments").rglob("*") if p.is_file())


def test_the_default_cpu_store_takes_at_most_half_the_bytes_per_token_of_fp32(tmp_path):
    corpus = corpus_file(tmp_path)
    per_token, settings = {}, {}
    for dtype in ("auto", "fp32"):
        store = tmp_path / f"{dtype}.zarr"
        args = () if dtype == "auto" else ("--kv-dtype", dtype)
        res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "64", "-q", *args)
        assert res.exit_code == 0, res.output
        stats = json.loads(cli("stats", "--store", store, "--json").stdout)["store"]
        with Store.open(store) as st:
            settings[dtype] = st.settings
            padded = st.summary()["padded_tokens"]
        per_token[dtype] = segment_bytes(store) / padded  # on disk, the segments' metadata included
        assert stats["kv_dtype"] == settings[dtype].kv_dtype
    assert settings["auto"].kv_dtype == "bfloat16" and settings["fp32"].kv_dtype == "float32"
    assert settings["auto"].row_bytes * 2 <= settings["fp32"].row_bytes
    assert per_token["auto"] <= per_token["fp32"] / 2 * 1.02, per_token


def test_index_says_the_size_it_expects_before_and_the_size_it_made_after(tmp_path):
    corpus, store = corpus_file(tmp_path), tmp_path / "s.zarr"
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "64")
    assert res.exit_code == 0, res.output
    line = next(l for l in res.stderr.splitlines() if l.startswith("index: about"))
    m = re.match(r"index: about ([\d.]+) (KiB|MiB|GiB) of KV for ~([\d,]+) tokens \(bf16, ([\d.]+) (B|KiB) per "
                 r"token\); [\d.]+ (KiB|MiB|GiB) free on ", line)
    assert m, line
    with Store.open(store) as st:
        summary, row_bytes = st.summary(), st.settings.row_bytes
    estimate = float(m[1]) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m[2]]
    assert summary["kv_bytes"] / 2 < estimate < summary["kv_bytes"] * 2  # bytes / 4 tokens: an estimate
    assert f"{m[4]} {m[5]}" == ("1.0 KiB" if row_bytes == 1024 else f"{row_bytes} B")  # the store's row_bytes
    assert re.search(rf"{store} holds \d+ chunks of \d+ documents \([\d.]+ (KiB|MiB)\)", res.stdout), res.stdout

    res = cli("index", corpus, "--store", store, *TINY, "--json")  # machine-readable: one JSON object, no estimate
    assert res.exit_code == 0 and "about" not in res.stderr, res.output
    assert json.loads(res.stdout)["store_bytes"] >= summary["kv_bytes"]  # the segments, the catalog beside them
    res = cli("index", corpus, "--store", store, *TINY, "-q")
    assert "about" not in res.stderr and "already in" in res.stdout, res.output


def test_an_fp32_store_made_before_the_default_changed_still_indexes_and_answers(tmp_path):
    corpus, store = corpus_file(tmp_path), tmp_path / "s.zarr"
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "64", "--kv-dtype", "fp32", "-q")
    assert res.exit_code == 0, res.output
    write_jsonl(tmp_path / "more.jsonl", {"id": "extra", "text": "Extra text about the Moon and its craters."})
    corpus.write_text(corpus.read_text() + (tmp_path / "more.jsonl").read_text())
    res = cli("index", corpus, "--store", store, "--device", "cpu", "-q")  # the store's fp32, not auto's bf16
    assert res.exit_code == 0, res.output
    with Store.open(store) as st:
        assert st.settings.kv_dtype == "float32" and "extra" in st.documents()
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "q1", "question": "What is on Mars?", "docs": ["mars"]})
    res = cli("answer", queries, "--store", store, "--out", tmp_path / "a.jsonl", "--device", "cpu",
              "--cache-gb", "0.02", "--max-new-tokens", "2", "-q")
    assert res.exit_code == 0, res.output
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 1
