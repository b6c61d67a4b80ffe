"""`--store s3://...` end to end against a local S3 (moto): the same answers and counts as a local store,
a segment whose manifest was never written stays invisible, and the refusals."""

import json

import pytest
from cli_tools import TINY, answer, cli, demo_docs, index_docs, rows, write_jsonl

from lazyrag.store.location import store_location
from lazyrag.store.objects import Objects
from lazyrag.store.storage import ObjectStorage

DOCS = ("jupiter", "mars", "nile")
# the counts `stats` shows that depend only on what is stored, not on where
SAME = ("documents", "chunks", "tokens", "padded_tokens", "pending_documents", "unreferenced_chunks", "kv_bytes",
        "model", "fingerprint", "kv_dtype", "page_size")


def queries(tmp_path):
    return write_jsonl(tmp_path / "queries.jsonl",
                       {"id": "named", "question": "How big is Jupiter?", "docs": ["jupiter", "mars"]},
                       {"id": "retrieved", "question": "Which river is the longest?"})


def stats(store) -> dict:
    res = cli("stats", "--store", store, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def answers(store, tmp_path, name) -> dict:
    out = tmp_path / f"{name}.jsonl"
    res = answer(queries(tmp_path), store, out)
    assert res.exit_code == 0, res.output
    return {r["id"]: (r["answer"], r["chunks"]) for r in rows(out)}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A local store of DOCS, its answers and stats."""
    tmp = tmp_path_factory.mktemp("local")
    store = index_docs(tmp / "s.zarr", tmp, *DOCS)
    return answers(store, tmp, "answers"), stats(store)


def test_index_answer_and_stats_on_s3_match_a_local_store(local, s3_url, tmp_path):
    local_answers, local_stats = local
    index_docs(s3_url, tmp_path, *DOCS)
    assert answers(s3_url, tmp_path, "answers") == local_answers
    got = stats(s3_url)
    assert got["path"] == s3_url
    assert {k: got["store"][k] for k in (*SAME, "segments", "runs")} == \
        {k: local_stats["store"][k] for k in (*SAME, "segments", "runs")}
    counters = ("lookups", "hits", "misses", "lookup_tokens", "bytes_read")
    assert [{k: r["cache"][k] for k in counters} | {"queries": r["queries"]} for r in got["runs"]] == \
        [{k: r["cache"][k] for k in counters} | {"queries": r["queries"]} for r in local_stats["runs"]]


def test_a_segment_without_its_manifest_is_never_visible_and_index_completes_it(local, s3_url, tmp_path,
                                                                                   monkeypatch):
    index_docs(s3_url, tmp_path, "jupiter", "mars")
    before, first_answers = stats(s3_url)["store"], answers(s3_url, tmp_path, "before")

    def killed(*args):  # the writer dies after the segment's objects, before its manifest
        raise KeyboardInterrupt

    corpus = tmp_path / "all.jsonl"
    corpus.write_text(demo_docs(*DOCS))
    with monkeypatch.context() as patch:
        patch.setattr(ObjectStorage, "commit_append", killed)
        res = cli("index", corpus, "--store", s3_url, *TINY, "--chunk-tokens", "256", "-q")
    assert res.exit_code == 130
    written = Objects(store_location(s3_url)).folders("segments/")
    assert len(written) == before["segments"] + 1  # the new segment's objects are there, named by no manifest

    after = stats(s3_url)["store"]
    assert {k: after[k] for k in ("documents", "chunks", "tokens", "segments")} == \
        {k: before[k] for k in ("documents", "chunks", "tokens", "segments")}
    assert answers(s3_url, tmp_path, "after") == first_answers
    res = cli("check", "--store", s3_url)
    assert res.exit_code == 0 and "named by no manifest" in res.stdout

    res = cli("index", corpus, "--store", s3_url, *TINY, "--chunk-tokens", "256", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chunks_added"] > 0
    done = stats(s3_url)["store"]
    assert {k: done[k] for k in SAME} == {k: local[1]["store"][k] for k in SAME}


def test_an_s3_store_refuses_another_model_and_compaction(s3_url, tmp_path):
    index_docs(s3_url, tmp_path, "mars")
    stored = stats(s3_url)["store"]["fingerprint"]
    res = cli("index", tmp_path / "corpus.jsonl", "--store", s3_url, *TINY, "--dtype", "fp32",
              "--chunk-tokens", "256", "-q")
    assert res.exit_code == 4
    assert stored[:12] in res.stderr.replace("\n", "") and "model fingerprint" in res.stderr
    res = cli("compact", "--store", s3_url)
    assert res.exit_code == 4 and "local stores only" in res.stderr
