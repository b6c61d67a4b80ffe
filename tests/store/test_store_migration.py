"""Stores of format version 1 (no checksums, no document versions, no segment markers, no run
ids) are upgraded in place when opened for writing, and a reader is told how to upgrade them."""

from __future__ import annotations

import json
import sqlite3

import pytest
from store_samples import add_documents, make_chunks, random_kv, settings

from lazyrag.store import FORMAT_VERSION, Store, StoreError

# The catalog schema format 1 wrote (sqlite_master, in order), as a format 1 store holds it.
V1_SCHEMA = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE segments (\n    seq INTEGER PRIMARY KEY,\n    name TEXT NOT NULL UNIQUE,\n"
    "    rows INTEGER NOT NULL,\n    nbytes INTEGER NOT NULL,\n    created TEXT NOT NULL\n)",
    "CREATE TABLE chunks (\n    chunk_id TEXT PRIMARY KEY,\n    segment TEXT NOT NULL REFERENCES segments(name),\n"
    "    offset INTEGER NOT NULL,\n    length INTEGER NOT NULL,\n    padded_length INTEGER NOT NULL,\n"
    "    token_ids BLOB NOT NULL,\n    text TEXT NOT NULL\n)",
    "CREATE TABLE documents (doc_id TEXT PRIMARY KEY, seq INTEGER NOT NULL)",
    "CREATE TABLE doc_chunks (\n    doc_id TEXT NOT NULL,\n    ordinal INTEGER NOT NULL,\n"
    "    chunk_id TEXT NOT NULL REFERENCES chunks(chunk_id),\n    PRIMARY KEY (doc_id, ordinal)\n)",
    "CREATE INDEX doc_chunks_by_chunk ON doc_chunks(chunk_id)",
    "CREATE TABLE runs (id INTEGER PRIMARY KEY, created TEXT NOT NULL, record TEXT NOT NULL)",
]


def downgrade_to_v1(path) -> None:
    """Turn a current store into the store format 1 wrote for the same data."""
    with sqlite3.connect(path / "catalog.sqlite") as db:
        db.execute("DROP TABLE pending_chunks")  # drops its index too
        db.execute("ALTER TABLE chunks DROP COLUMN checksum")
        db.execute("ALTER TABLE runs DROP COLUMN run_id")
        db.execute("DELETE FROM meta WHERE key = 'store_id'")
        # ALTER TABLE rewrites the stored SQL; put back format 1's text
        db.execute("PRAGMA writable_schema = ON")
        db.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'chunks'", (V1_SCHEMA[2],))
        db.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'runs'", (V1_SCHEMA[-1],))
    for marker in (path / "segments").glob("*/lazyrag-segment.json"):
        marker.unlink()
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["lazyrag"]["format_version"] = 1
    (path / "zarr.json").write_text(json.dumps(meta))


def _schema(path) -> list[str]:
    with sqlite3.connect(path / "catalog.sqlite") as db:
        return [r[0] for r in db.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")]


def _columns(path) -> dict[str, list[tuple]]:
    """Each table's columns (name, type, not null, primary key), as a comparable shape of the schema."""
    with sqlite3.connect(path / "catalog.sqlite") as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: [(c[1], c[2], c[3], c[5]) for c in db.execute(f"PRAGMA table_info({t})")] for t in tables}


def test_a_format_1_store_is_upgraded_in_place(tmp_path):
    s = settings()
    path = tmp_path / "s.zarr"
    a, b = make_chunks(s, "a", [10, 20], seed=1), make_chunks(s, "b", [30], seed=2)
    with Store.create_or_open(path, s) as st:
        add_documents(st, a, random_kv(s, a, 1))
        add_documents(st, b, random_kv(s, b, 2))
        sums = {c.chunk_id: c.checksum for c in st.iter_chunks()}
    fresh = _columns(path)
    downgrade_to_v1(path)
    assert _schema(path) == V1_SCHEMA
    with sqlite3.connect(path / "catalog.sqlite") as db:  # a run format 1 logged
        db.execute("INSERT INTO runs (created, record) VALUES ('2020-01-01T00:00:00+00:00', '{\"queries\": 3}')")

    with pytest.raises(StoreError, match="store format 1; upgrade it in place with `lazyrag compact"):
        Store.open(path)
    with Store.create_or_open(path, s) as st:  # as `lazyrag index` opens it
        assert {c.chunk_id: c.checksum for c in st.iter_chunks()} == sums  # same ids, checksums from the data
        assert st.documents() == ["a", "b"] and st.check().ok
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]["lazyrag"]
    assert attrs["format_version"] == FORMAT_VERSION
    assert _columns(path) == fresh  # the tables and columns of a new store's catalog
    with Store.open(path) as st:
        assert [c.chunk_id for c in st.doc_chunks("b")] == [b[0].chunk_id]
        st.save_run("r1", {"queries": 1})
        st.save_run("r1", {"queries": 2})
        assert st.runs() == [{"queries": 3}, {"queries": 2}]


def test_an_unreadable_format_1_store_is_refused_with_re_index(tmp_path):
    s = settings()
    path = tmp_path / "s.zarr"
    a = make_chunks(s, "a", [10], seed=1)
    with Store.create_or_open(path, s) as st:
        add_documents(st, a, random_kv(s, a, 1))
        segment = st.doc_chunks("a")[0].segment
    downgrade_to_v1(path)
    shard = next(p for p in (path / "segments" / segment / "c").rglob("*") if p.is_file())
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(StoreError, match="cannot be upgraded.*re-index into a new --store"):
        Store.open(path, write=True)
