"""Faults in a store's files and in a corpus: each command refuses, repairs or reports them
the same way, and what it says names the damage, not the store's totals."""

import json
import os
import shutil

import pytest
from cli_tools import TINY, answer, cli, corpus_of, index_docs

from lazyrag.store import Store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    return index_docs(tmp / "s.zarr", tmp, "jupiter", "saturn")


def copy_of(store, tmp_path):
    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    return copy


def test_an_emptied_catalog_is_refused_by_every_command_compact_included(store, tmp_path):
    copy = copy_of(store, tmp_path)
    (copy / "catalog.sqlite").write_bytes(b"")
    for wal in copy.glob("catalog.sqlite-*"):
        wal.unlink()
    for command in ("stats", "check", "compact"):
        res = cli(command, "--store", copy)
        assert res.exit_code == 4, (command, res.output)
        assert "not a lazyrag catalog" in res.stderr, (command, res.stderr)
    # nothing re-initialised it: the file is still empty and its segments still there
    assert (copy / "catalog.sqlite").stat().st_size == 0
    assert any((copy / "segments").glob("seg-*"))


def index(corpus, store, *args):
    res = cli("index", corpus, "--store", store, *TINY, "-q", *args)
    assert res.exit_code == 0, res.output
    return res


def test_a_segment_replaced_by_a_symlink_is_re_encoded_by_index(tmp_path):
    store = tmp_path / "s.zarr"
    corpus = corpus_of(tmp_path, a="Alpha is the first letter.\n\nBeta is the second letter.",
                       b="Gamma is the third letter.")
    index(corpus, store)
    segment = next((store / "segments").glob("seg-*"))
    segment.rename(tmp_path / "elsewhere")
    segment.symlink_to(tmp_path / "elsewhere")  # the same bytes, but no longer the store's own
    res = cli("check", "--store", store)
    assert res.exit_code == 4 and "lazyrag index" in res.stdout, res.output
    index(corpus, store)
    res = cli("check", "--store", store)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "elsewhere").is_dir()  # nothing outside the store was touched


def test_checks_verdict_counts_the_damage_not_the_stores_totals(tmp_path):
    store = tmp_path / "s.zarr"
    corpus = corpus_of(tmp_path, **{f"d{i}": f"Document {i} is about topic number {i}." for i in range(4)})
    index(corpus, store)
    with Store.open(store) as st:
        bad = st.doc_chunks("d2.txt")[0]
        row_bytes = st.settings.row_bytes
    shard = next(p for p in (store / "segments" / bad.segment / "c").rglob("*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[bad.offset * row_bytes + 8] ^= 0x40
    shard.write_bytes(bytes(data))
    res = cli("check", "--store", store)
    assert res.exit_code == 4
    verdict = res.stdout.strip().splitlines()[-1]
    assert verdict.startswith("damaged: 1 chunk in 1 segment "), verdict
    assert "the store holds 4 chunks in 1 segment)" in verdict
    assert f"corrupt: chunk {bad.chunk_id}" in res.stdout


def test_a_file_name_that_is_not_utf8_is_a_bad_input_named_by_its_escapes(tmp_path):
    corpus = corpus_of(tmp_path, a="Alpha is the first letter.")
    (corpus / os.fsdecode(b"\xff.txt")).write_text("Delta is the fourth letter.")
    store = tmp_path / "s.zarr"
    # refused before the model loads: this model would fail to load
    res = cli("index", corpus, "--store", store, "--model", "/no/such/model", "--device", "cpu")
    assert res.exit_code == 3, res.output
    assert "\\xff.txt:1: the file name is not valid UTF-8" in res.stderr
    assert not store.exists()
    res = cli("index", corpus, "--store", store, *TINY, "--skip-bad")
    assert res.exit_code == 0, res.output
    assert "skipped: " in res.stderr and "\\xff.txt:1" in res.stderr
    with Store.open(store) as st:
        assert st.documents() == ["a.txt"]


def test_a_run_record_the_disk_cannot_hold_leaves_no_tmp_file(store, tmp_path, monkeypatch):
    import errno
    import pathlib
    import sqlite3

    def read_only(self, run_id, record):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    real_write_text = pathlib.Path.write_text

    def disk_full(self, text, *args, **kwargs):
        if self.name.endswith(".run.json.tmp"):
            real_write_text(self, "")  # the file is made, then its data does not fit
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Store, "save_run", read_only)
    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    queries = tmp_path / "q.jsonl"
    real_write_text(queries, json.dumps({"id": "q", "question": "Rings?", "docs": ["saturn"]}) + "\n")
    res = answer(queries, store, tmp_path / "a.jsonl")
    assert res.exit_code == 0, res.output
    assert "could not write the run's record" in res.stderr
    assert not list(tmp_path.glob("*.tmp"))
