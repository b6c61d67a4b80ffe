"""`index`, `check` and `compact` on the command line: versioned documents, damaged chunks encoded
again, documents invisible until whole, compaction under readers."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from typer.testing import CliRunner

from lazyrag.cli import app
from lazyrag.commands.index import store_settings, stored_chunks
from lazyrag.corpus import Document
from lazyrag.models import load_model
from lazyrag.store import Store, kv_to_storage

SIX = "\n\n".join(f"Paragraph {i} tells of river number {i}, its towns, bridges and floods." for i in range(6))


def lazyrag(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def write_corpus(path, docs: dict[str, str]):
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return path


@pytest.fixture
def indexed(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", {"rivers": SIX, "iron": "Iron is element 26."})
    store = tmp_path / "s.zarr"
    index = ["index", corpus, "--store", store, "--model", "random:tiny", "--device", "cpu",
             "--chunk-tokens", "16", "-q", "--json"]
    result = lazyrag(*index)
    assert result.exit_code == 0, result.output
    return corpus, store, index


def test_reindexing_a_shortened_document_replaces_its_chunks_and_compact_reclaims(indexed):
    corpus, store, index = indexed
    with Store.open(store) as st:
        before = len({c.chunk_id for c in st.doc_chunks("rivers")})  # repeated text is stored once
    assert before >= 6
    write_corpus(corpus, {"rivers": "Paragraph 0 only.", "iron": "Iron is element 26."})
    assert lazyrag(*index).exit_code == 0
    with Store.open(store) as st:
        assert "".join(c.text for c in st.doc_chunks("rivers")) == "Paragraph 0 only."
        assert st.summary()["unreferenced_chunks"] == before
    held = Store.open(store)  # an answer run reading the store
    refused = lazyrag("compact", "--store", store)
    assert refused.exit_code == 4 and "--wait" in refused.output
    held.close()
    done = lazyrag("compact", "--store", store, "--json")
    assert done.exit_code == 0, done.output
    freed = json.loads(done.output)
    assert freed["chunks_removed"] == before and freed["bytes_freed"] > 0
    assert lazyrag("check", "--store", store).exit_code == 0


def test_check_finds_a_corrupt_chunk_and_index_verify_encodes_it_again(indexed):
    corpus, store, index = indexed
    with Store.open(store) as st:
        bad = st.doc_chunks("rivers")[2]
        good = st.read_kv(bad).clone()
        row_bytes = st.settings.row_bytes
    shard = next(p for p in (store / "segments" / bad.segment / "c").rglob("*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[bad.offset * row_bytes + 8] ^= 0x40
    shard.write_bytes(bytes(data))
    found = lazyrag("check", "--store", store, "--json")
    assert found.exit_code == 4
    assert [r["chunk"] for r in json.loads(found.output)["corrupt"]] == [bad.chunk_id]
    said = lazyrag("check", "--store", store).output
    assert bad.chunk_id in said and "--verify` re-encodes" in said
    # a plain index checks only the segments' sizes: it does not read the store back
    plain = lazyrag(*index)
    assert plain.exit_code == 0 and json.loads(plain.output)["chunks_repaired"] == 0
    assert lazyrag("check", "--store", store).exit_code == 4
    repaired = lazyrag(*index, "--verify")
    assert repaired.exit_code == 0 and json.loads(repaired.output)["chunks_repaired"] == 1
    assert lazyrag("check", "--store", store).exit_code == 0
    with Store.open(store) as st:
        assert st.read_kv(st.chunk(bad.chunk_id)).equal(good)


def test_index_encodes_the_chunks_of_a_truncated_or_missing_segment_again(indexed):
    corpus, store, index = indexed
    with Store.open(store) as st:
        kv = {c.chunk_id: st.read_kv(c).clone() for c in st.iter_chunks()}
    for damage in ("truncate", "remove"):
        with Store.open(store) as st:
            segment = store / "segments" / st.chunk(next(iter(kv))).segment
        if damage == "truncate":
            shard = next(p for p in (segment / "c").rglob("*") if p.is_file())
            os.truncate(shard, shard.stat().st_size - 1)
        else:
            shutil.rmtree(segment)
        assert lazyrag("check", "--store", store).exit_code == 4
        repaired = lazyrag(*index)
        assert repaired.exit_code == 0, repaired.output
        assert json.loads(repaired.output)["chunks_repaired"] == len(kv), damage
        assert lazyrag("check", "--store", store).exit_code == 0, damage
        with Store.open(store) as st:
            assert all(st.read_kv(st.chunk(cid)).equal(want) for cid, want in kv.items())


def test_a_document_cut_off_by_a_kill_is_not_answered_or_counted(indexed, tmp_path):
    corpus, store, index = indexed
    loaded = load_model("random:tiny", "cpu")  # the store's: auto's bf16
    with Store.open(store) as st:
        settings = st.settings
    long = stored_chunks([Document("late", SIX.replace("river", "lake"), None, "c.jsonl:3")], loaded.tokenizer,
                         settings)[0]
    assert store_settings(loaded, "random:tiny", 16, settings.page_size).compat_key() == settings.compat_key()
    with Store.create_or_open(store, settings) as st:  # as an index killed after its first chunk
        st.put_documents(long)
        rows = settings.padded(len(long[0].token_ids))
        st.append(long[:1], kv_to_storage(torch.zeros(rows, *settings.row_shape, dtype=loaded.kv_dtype)))
    stats = json.loads(lazyrag("stats", "--store", store, "--json").output)
    assert stats["store"]["documents"] == 2
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"id": "q1", "question": "Which lake?", "docs": ["late"]}) + "\n"
                       + json.dumps({"id": "q2", "question": "Which element?", "docs": ["iron"]}) + "\n")
    out = tmp_path / "a.jsonl"
    result = lazyrag("answer", queries, "--store", store, "--out", out, "--max-new-tokens", "2", "-q",
                     "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["q2"]
    errors = [json.loads(line) for line in (tmp_path / "a.errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["q1"] and "not indexed yet" in errors[0]["error"]


def test_check_help_says_what_exits_4_and_that_compact_reclaims_unused_chunks():
    text = " ".join(lazyrag("check", "--help").output.split())
    assert "Exits 4 when the store is damaged: a corrupt chunk" in text
    assert "missing or truncated chunk or segment" in text and "orphan segment" in text
    assert "`lazyrag compact` reclaims them" in text
    index_help = " ".join(lazyrag("index", "--help").output.split())
    assert "--verify" in index_help
