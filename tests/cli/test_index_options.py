"""`index` options that keep a store in step with its corpus: --sync, and re-indexing with the
store's own settings when the command line gives none."""

import json

from cli_tools import TINY, cli, corpus_of

from lazyrag.store import Store


def test_sync_takes_documents_gone_from_the_corpus_out_and_compact_reclaims_them(tmp_path):
    store = tmp_path / "s.zarr"
    corpus = corpus_of(tmp_path, a="Alpha is the first letter.", b="Gamma is the third letter.")
    assert cli("index", corpus, "--store", store, *TINY, "-q").exit_code == 0
    (corpus / "b.txt").unlink()
    res = cli("index", corpus, "--store", store, *TINY, "-q")
    assert res.exit_code == 0, res.output
    with Store.open(store) as st:
        assert st.documents() == ["a.txt", "b.txt"]  # without --sync nothing is removed
    res = cli("index", corpus, "--store", store, *TINY, "-q", "--sync")
    assert res.exit_code == 0, res.output
    assert "removed 1 documents no longer in the corpus ('b.txt')" in res.stdout
    with Store.open(store) as st:
        assert st.documents() == ["a.txt"] and st.summary()["unreferenced_chunks"] == 1
    res = cli("compact", "--store", store, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["chunks_removed"] == 1
    assert cli("check", "--store", store).exit_code == 0


def test_sync_is_refused_on_object_storage_before_the_model_loads(tmp_path):
    corpus = corpus_of(tmp_path, a="Alpha is the first letter.")
    res = cli("index", corpus, "--store", "s3://bucket/prefix", "--model", "/no/such/model", "--sync")
    assert res.exit_code == 2 and "--sync" in res.stderr and "object storage" in res.stderr, res.output


def test_reindexing_takes_the_stores_own_settings_when_none_are_given(tmp_path):
    store = tmp_path / "s.zarr"
    corpus = corpus_of(tmp_path, a="Alpha is the first letter.")
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "64", "--page-size", "16",
              "--kv-dtype", "fp16", "-q")
    assert res.exit_code == 0, res.output
    corpus_of(tmp_path, b="Gamma is the third letter.")
    res = cli("index", corpus, "--store", store, "--device", "cpu", "-q", "--json")  # no model, no settings
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chunks_added"] == 1
    with Store.open(store) as st:
        s = st.settings
        assert (s.model, s.chunking["chunk_tokens"], s.page_size, s.kv_dtype) == ("random:tiny", 64, 16, "float16")
        assert st.documents() == ["a.txt", "b.txt"]
    res = cli("index", corpus, "--store", store, "--device", "cpu", "--chunk-tokens", "128", "-q")
    assert res.exit_code == 4 and "chunk" in res.stderr, res.output  # a given setting that differs is refused


def test_the_summaries_of_index_and_answer_count_the_bad_lines_skipped(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "Alpha is the first letter."}\n{"id": \n')
    store = tmp_path / "s.zarr"
    res = cli("index", corpus, "--store", store, *TINY, "-q", "--skip-bad")
    assert res.exit_code == 0, res.output
    assert "1 bad inputs" in res.stdout and f"{corpus}:2" in res.stderr
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "q1", "question": "Alpha?", "docs": ["a"]}\nnot json\n{"id": 2}\n')
    res = cli("answer", queries, "--store", store, "--out", tmp_path / "a.jsonl", "--device", "cpu",
              "--max-new-tokens", "2", "-q")
    assert res.exit_code == 0, res.output
    assert "2 bad lines skipped" in res.stdout
