"""Versioned documents: a new chunk list replaces the old one whole, a document is visible only
once all its chunks are stored, and compaction reclaims what no document uses."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from store_samples import add_documents, make_chunks, random_kv, settings

from lazyrag.store import DocumentIncomplete, Store, StoreBusy


def test_new_version_replaces_the_chunk_list_whole(tmp_path):
    s = settings()
    six = make_chunks(s, "d", [10] * 6, seed=1)
    one = make_chunks(s, "d", [12], seed=2)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        add_documents(st, six, random_kv(s, six, 1))
        assert [c.chunk_id for c in st.doc_chunks("d")] == [c.chunk_id for c in six]
        st.put_documents(one)  # its chunk is not stored yet: readers still see the six
        assert [c.chunk_id for c in st.doc_chunks("d")] == [c.chunk_id for c in six]
        st.append(one, random_kv(s, one, 2))
        assert [c.chunk_id for c in st.doc_chunks("d")] == [one[0].chunk_id]
        assert [c.chunk_id for c in st.iter_chunks()] == [one[0].chunk_id]
        got = st.summary()
        assert (got["documents"], got["chunks"], got["unreferenced_chunks"]) == (1, 1, 6)


def test_a_document_is_invisible_until_its_last_chunk_is_stored(tmp_path):
    s = settings()
    doc = make_chunks(s, "long", [20, 20, 20], seed=3)
    kv = random_kv(s, doc, 3)
    rows = s.padded(20)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.put_documents(doc)
        st.append(doc[:2], kv[: 2 * rows])  # killed before the last chunk
    with Store.open(tmp_path / "s.zarr") as ro:
        with pytest.raises(DocumentIncomplete, match="not indexed yet: 2 of its 3 chunks"):
            ro.doc_chunks("long")
        assert ro.documents() == [] and list(ro.iter_chunks()) == []
        assert ro.summary()["documents"] == 0 and ro.summary()["pending_documents"] == 1
        assert ro.doc_chunks("unknown") == []
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(doc, kv)  # resumed: only the third is written
        assert [c.chunk_id for c in st.doc_chunks("long")] == [c.chunk_id for c in doc]
        assert st.summary()["segments"] == 2


def test_compact_reclaims_unused_chunks_and_keeps_the_rest_readable(tmp_path):
    s = settings()
    path = tmp_path / "s.zarr"
    a, b = make_chunks(s, "a", [16, 16], seed=4), make_chunks(s, "b", [16], seed=5)
    kva, kvb = random_kv(s, a, 4), random_kv(s, b, 5)
    a2 = make_chunks(s, "a", [16], seed=6)
    with Store.create_or_open(path, s) as st:
        st.put_documents(a + b)
        st.append(a + b, np.concatenate([kva, kvb]))  # one segment: a's two chunks and b's
        add_documents(st, a2, random_kv(s, a2, 6))  # a's new version: its old chunks are dead
        result = st.compact()
        assert (result.segments_rewritten, result.segments_dropped, result.chunks_removed) == (1, 0, 2)
        assert result.bytes_freed >= 2 * 16 * s.row_bytes  # the two dead chunks' rows
        assert st.num_chunks == 2 and st.summary()["unreferenced_chunks"] == 0
        np.testing.assert_array_equal(st.read_kv(st.doc_chunks("b")[0]).numpy(), kvb)
        assert st.check().ok
        b2 = make_chunks(s, "b", [5], seed=7)
        add_documents(st, b2, random_kv(s, b2, 7))
        assert st.compact().segments_dropped == 1  # b's old chunk was its segment's only one


def test_compact_refuses_or_waits_while_a_reader_has_the_store(tmp_path):
    s = settings()
    path = tmp_path / "s.zarr"
    with Store.create_or_open(path, s) as st:
        add_documents(st, make_chunks(s, "a", [8]), random_kv(s, make_chunks(s, "a", [8])))
    reader = Store.open(path)
    with Store.open(path, write=True) as st:
        with pytest.raises(StoreBusy, match="--wait"):
            st.compact()
        threading.Timer(0.3, reader.close).start()
        assert st.compact(wait=True).chunks_removed == 0  # returned once the reader closed
        # one writer at a time: compaction holds the writer lock
        with pytest.raises(StoreBusy, match="another process"):
            Store.open(path, write=True)
