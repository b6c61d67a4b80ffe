"""`index --kv-dtype fp8` end to end on the CPU: the store records its dtype, `answer` follows it with no
flag, and a store of one KV dtype refuses an index run of the other (exit 4)."""

import json

from cli_tools import TINY, answer, cli, demo_docs, rows, write_jsonl


def index(corpus, store, kv_dtype):
    return cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "128", "--kv-dtype", kv_dtype, "-q")


def test_fp8_store_is_indexed_and_answered_without_a_flag(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(demo_docs("nile", "lake-baikal"))
    store = tmp_path / "s.zarr"
    assert index(corpus, store, "fp8").exit_code == 0
    settings = json.loads((store / "zarr.json").read_text())["attributes"]["lazyrag"]["settings"]
    assert settings["kv_dtype"] == "float8_e4m3fn"
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "n", "question": "Where does the Nile flow?", "docs": ["nile"]},
                          {"id": "b", "question": "How deep is Lake Baikal?", "docs": ["lake-baikal", "nile"]})
    for mode in ("lazy", "block"):
        out = tmp_path / f"{mode}.jsonl"
        res = answer(queries, store, out, "--mode", mode, "-q")
        assert res.exit_code == 0, res.output
        assert {r["id"] for r in rows(out)} == {"n", "b"}
    stats = json.loads(cli("stats", "--store", store, "--json").stdout)["store"]
    assert stats["kv_dtype"] == "float8_e4m3fn"


def test_a_store_refuses_an_index_run_of_the_other_kv_dtype(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(demo_docs("nile"))
    for stored, other in (("fp8", "bf16"), ("bf16", "fp8")):
        store = tmp_path / f"{stored}.zarr"
        assert index(corpus, store, stored).exit_code == 0
        res = index(corpus, store, other)
        assert res.exit_code == 4
        assert "kv_dtype: store has" in res.stderr and "--store" in res.stderr
    res = index(corpus, tmp_path / "x.zarr", "int4")
    assert res.exit_code == 2 and "choose auto, bf16, fp16, fp32 or fp8" in res.stderr
