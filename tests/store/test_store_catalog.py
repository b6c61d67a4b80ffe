"""The SQLite catalog: one transaction per write, all or nothing."""

from __future__ import annotations

import sqlite3

import pytest
from store_samples import make_chunks, settings

from lazyrag.store.catalog import Catalog


@pytest.fixture
def catalog(tmp_path):
    file = tmp_path / "catalog.sqlite"
    Catalog.create(file, "2020-01-01T00:00:00+00:00")
    cat = Catalog(file)
    yield cat
    cat.close()


def test_new_catalog_is_empty(catalog):
    assert catalog.counts() == {
        "documents": 0, "chunks": 0, "tokens": 0, "padded_tokens": 0, "segments": 0,
        "updated": "2020-01-01T00:00:00+00:00",
    }
    assert catalog.next_segment_seq() == 1 and catalog.segment_names() == set()


def test_failed_transaction_leaves_nothing(catalog):
    with pytest.raises(KeyboardInterrupt):
        with catalog.transaction() as db:
            db.execute("INSERT INTO documents VALUES ('lost', 1)")
            raise KeyboardInterrupt
    assert catalog.documents() == []
    with catalog.transaction() as db:
        db.execute("INSERT INTO documents VALUES ('kept', 1)")
    assert catalog.documents() == ["kept"]


def test_commit_append_is_one_transaction(catalog):
    """A failure part way through an append's commit leaves neither its segment nor its chunks."""
    s = settings()
    chunks = make_chunks(s, "a", [3, 20])
    placed = [(chunks[0], 0, 16), (chunks[0], 16, 32)]  # the same chunk id twice: the second insert fails
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        catalog.commit_append(chunks, "seg-000001-00000000", placed, 48, 48 * s.row_bytes)
    assert catalog.counts()["segments"] == 0 and catalog.documents() == []
    placed = [(chunks[0], 0, 16), (chunks[1], 16, 32)]
    catalog.commit_append(chunks, "seg-000001-00000000", placed, 48, 48 * s.row_bytes)
    assert catalog.segment_names() == {"seg-000001-00000000"} and catalog.next_segment_seq() == 2
    assert catalog.stored([c.chunk_id for c in chunks] + ["0" * 24]) == {c.chunk_id for c in chunks}
    assert [(c.chunk_id, c.offset, c.padded_length) for c in catalog.iter_chunks()] == [
        (chunks[0].chunk_id, 0, 16), (chunks[1].chunk_id, 16, 32)
    ]
    assert catalog.chunk("0" * 24) is None
