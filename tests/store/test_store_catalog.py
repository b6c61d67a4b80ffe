"""The SQLite catalog: one transaction per write, all or nothing."""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3

import pytest
from store_samples import make_chunks, settings

from lazyrag.store.catalog import Catalog


@pytest.fixture
def catalog(tmp_path):
    file = tmp_path / "catalog.sqlite"
    Catalog.create(file, "2020-01-01T00:00:00+00:00", "0" * 32)
    cat = Catalog(file)
    yield cat
    cat.close()


def test_new_catalog_is_empty(catalog):
    assert catalog.counts() == {
        "documents": 0, "chunks": 0, "tokens": 0, "padded_tokens": 0, "segments": 0,
        "pending_documents": 0, "unreferenced_chunks": 0, "updated": "2020-01-01T00:00:00+00:00",
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
    """A failure part way through an append's commit leaves neither its segment, its chunks nor
    the documents it would have published."""
    s = settings()
    chunks = make_chunks(s, "a", [3, 20])
    catalog.put_documents({"a": [c.chunk_id for c in chunks]})
    assert catalog.documents() == [] and catalog.counts()["pending_documents"] == 1
    broken = dataclasses.replace(chunks[1], text=None)  # violates NOT NULL after the segment row went in
    with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
        catalog.commit_append("seg-000001-00000000", [(chunks[0], 0, 16, 1), (broken, 16, 32, 2)], 48, 48)
    assert catalog.counts()["segments"] == 0 and catalog.stored([chunks[0].chunk_id]) == set()
    catalog.commit_append("seg-000001-00000000", [(chunks[0], 0, 16, 1), (chunks[1], 16, 32, 2)], 48, 48)
    assert catalog.segment_names() == {"seg-000001-00000000"} and catalog.next_segment_seq() == 2
    assert catalog.documents() == ["a"] and catalog.counts()["pending_documents"] == 0
    assert catalog.stored([c.chunk_id for c in chunks] + ["0" * 24]) == {c.chunk_id for c in chunks}
    assert [(c.chunk_id, c.offset, c.padded_length, c.checksum) for c in catalog.iter_chunks()] == [
        (chunks[0].chunk_id, 0, 16, 1), (chunks[1].chunk_id, 16, 32, 2)
    ]
    assert catalog.chunk("0" * 24) is None


def frozen_copy(tmp_path, name):
    """The catalog's files as a crash would leave them on a disk that is then only read: the commits
    of its writer, still open, are in the WAL."""
    copy = tmp_path / name
    copy.mkdir()
    for f in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"):
        shutil.copy(tmp_path / f, copy / f)
    return copy / "catalog.sqlite"


def test_a_frozen_catalog_is_read_without_changing_a_file(catalog, tmp_path):
    with catalog.transaction() as db:
        db.execute("INSERT INTO documents VALUES ('a', 1)")
    catalog.close()  # the last connection merges the WAL into the catalog
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    frozen = Catalog(tmp_path / "catalog.sqlite", writable=False, frozen=True)
    assert frozen.documents() == ["a"]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        with frozen.transaction() as db:
            db.execute("INSERT INTO documents VALUES ('b', 2)")
    frozen.close()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_frozen_catalog_reads_the_commits_a_crashed_writer_left_in_its_wal(catalog, tmp_path):
    with catalog.transaction() as db:
        db.execute("INSERT INTO documents VALUES ('a', 1)")
    assert (tmp_path / "catalog.sqlite-wal").stat().st_size > 0
    frozen = Catalog(frozen_copy(tmp_path, "copy"), writable=False, frozen=True)
    assert frozen.documents() == ["a"]
    frozen.close()
