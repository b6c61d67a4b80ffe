"""The Store: opening and creating, one writer, appending and linking, crash safety, run log, summary."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from store_samples import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE,
    add_documents,
    as_bits,
    make_chunks,
    random_kv,
    rows_of,
    settings,
)

from lazyrag.store import FORMAT_VERSION, Store, StoreBusy, StoreError
from lazyrag.store.catalog import Catalog


def test_append_is_idempotent_and_documents_share_chunks(tmp_path):
    s = settings()
    chunks = make_chunks(s, "a", [10, 30])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        add_documents(st, chunks, kv)
        before = st.summary()
        st.append(chunks, kv)  # everything present: nothing written
        assert st.summary()["segments"] == before["segments"] == 1
        assert st.num_chunks == 2 and st.has_chunk(chunks[0].chunk_id)
        # a new document repeating chunk 1 and adding one new chunk: only the new
        # chunk's rows are written, but the document lists both
        new = make_chunks(s, "b", [7], seed=9)[0]
        b = [dataclasses.replace(chunks[1], doc_id="b", ordinal=0), dataclasses.replace(new, doc_id="b", ordinal=1)]
        kvb = np.concatenate([rows_of(kv, s, chunks, 1), random_kv(s, [new], 9)])
        add_documents(st, b, kvb)
        assert st.num_chunks == 3 and st.summary()["segments"] == 2
        assert [c.chunk_id for c in st.doc_chunks("b")] == [chunks[1].chunk_id, new.chunk_id]
        assert st.chunk(new.chunk_id).offset == 0 and st.chunk(new.chunk_id).padded_length == PAGE
        assert np.array_equal(st.read_kv(st.chunk(new.chunk_id)).numpy(), kvb[32:])
        assert st.chunk(chunks[1].chunk_id).doc_id == "a"  # first document that had it
        # a document made only of stored chunks is visible at once
        st.put_documents([dataclasses.replace(chunks[0], doc_id="c", ordinal=0)])
        assert [c.chunk_id for c in st.doc_chunks("c")] == [chunks[0].chunk_id]
        assert st.documents() == ["a", "b", "c"]
        assert st.max_padded_length() == 32


def test_append_checks_shapes_and_dtype(tmp_path):
    s = settings(kv_dtype="bfloat16")
    chunks = make_chunks(s, "a", [10])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        with pytest.raises(StoreError, match="shape"):
            st.append(chunks, kv[:10])
        with pytest.raises(StoreError, match="dtype"):
            st.append(chunks, kv.astype(np.float16))
        with pytest.raises(StoreError, match="numpy array"):
            st.append(chunks, kv.tolist())
        assert st.num_chunks == 0 and st.max_padded_length() == 0


def test_open_errors(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        Store.open(tmp_path / "missing.zarr")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(StoreError, match="not a lazyrag store"):
        Store.open(tmp_path / "junk")
    with pytest.raises(StoreError, match="not a lazyrag store"):
        Store.create_or_open(tmp_path / "junk", settings())
    path = tmp_path / "s.zarr"
    Store.create_or_open(path, settings()).close()
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["lazyrag"]["format_version"] = FORMAT_VERSION + 1
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="newer"):
        Store.open(path)


def test_one_writer_at_a_time(tmp_path):
    path = tmp_path / "s.zarr"
    with Store.create_or_open(path, settings()):
        with pytest.raises(StoreBusy, match="another process"):
            Store.create_or_open(path, settings())
        Store.open(path).close()  # readers are fine
    Store.create_or_open(path, settings()).close()


def test_crash_between_data_and_commit(tmp_path, monkeypatch):
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    a, b = make_chunks(s, "a", [12], seed=1), make_chunks(s, "b", [40, 9], seed=2)
    kva, kvb = random_kv(s, a, 1), random_kv(s, b, 2)
    st = Store.create_or_open(path, s)
    add_documents(st, a, kva)
    st.put_documents(b)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before the catalog commit")

    monkeypatch.setattr(Catalog, "commit_append", crash)
    with pytest.raises(KeyboardInterrupt):
        st.append(b, kvb)
    monkeypatch.undo()
    st.close()
    segs = sorted(p.name for p in (path / "segments").iterdir() if p.is_dir())
    assert len(segs) == 2  # the data of the lost append is on disk...

    with Store.open(path) as ro:  # ...but invisible
        assert ro.num_chunks == 1 and ro.documents() == ["a"] and not ro.has_chunk(b[0].chunk_id)
        assert ro.summary()["segments"] == 1 and ro.summary()["pending_documents"] == 1
    with Store.create_or_open(path, s) as st:  # opening for writing deletes the orphan
        assert len([p for p in (path / "segments").iterdir() if p.is_dir()]) == 1
        st.append(b, kvb)
        assert st.num_chunks == 3 and st.documents() == ["a", "b"]
        names = {c.segment for c in st.iter_chunks()}
        assert len(names) == 2 and not (names & (set(segs) - {st.chunk(a[0].chunk_id).segment}))
        for i, c in enumerate(b):
            got = st.read_kv(st.chunk(c.chunk_id))
            assert np.array_equal(as_bits(got), rows_of(kvb, s, b, i).view(np.uint8))


def test_run_log_round_trip(tmp_path):
    path = tmp_path / "s.zarr"
    Store.create_or_open(path, settings()).close()
    with Store.open(path) as st:
        assert st.runs() == []
        st.save_run("r1", {"mode": "lazy", "queries": 3, "hits": 5, "nested": {"ttft_ms": [1.5, 2.0]}})
        st.save_run("r2", {"mode": "block", "queries": 1})
    with Store.open(path) as st:
        assert st.runs() == [
            {"mode": "lazy", "queries": 3, "hits": 5, "nested": {"ttft_ms": [1.5, 2.0]}},
            {"mode": "block", "queries": 1},
        ]
        assert st.summary()["runs"] == 2


def test_saving_a_run_again_replaces_its_record_in_place(tmp_path):
    path = tmp_path / "s.zarr"
    Store.create_or_open(path, settings()).close()
    with Store.open(path) as st:
        st.save_run("r1", {"queries": 8, "interrupted": True})
        st.save_run("r2", {"queries": 1})
        st.save_run("r1", {"queries": 16, "interrupted": True})
        st.save_run("r1", {"queries": 20})
    with Store.open(path) as st:
        assert st.runs() == [{"queries": 20}, {"queries": 1}] and st.summary()["runs"] == 2


def test_summary_numbers(tmp_path):
    s = settings(kv_dtype="float16")
    path = tmp_path / "s.zarr"
    a = make_chunks(s, "a", [5, 17])
    b = make_chunks(s, "b", [16], seed=3)
    with Store.create_or_open(path, s) as st:
        empty = st.summary()
        assert (empty["documents"], empty["chunks"], empty["tokens"], empty["segments"]) == (0, 0, 0, 0)
        add_documents(st, a, random_kv(s, a))
        add_documents(st, b, random_kv(s, b, 3))
        got = st.summary()
    row_bytes = LAYERS * 2 * HEADS * HEAD_DIM * 2
    assert got["documents"] == 2 and got["chunks"] == 3 and got["tokens"] == 5 + 17 + 16
    assert got["padded_tokens"] == 16 + 32 + 16 and got["kv_bytes"] == 64 * row_bytes
    assert got["bytes"] >= got["kv_bytes"]
    assert got["segments"] == 2
    identity = (got["model"], got["fingerprint"], got["kv_dtype"], got["page_size"])
    assert identity == (s.model, s.fingerprint, "float16", PAGE)
    assert got["created"] <= got["updated"] and got["created"].startswith("20")
