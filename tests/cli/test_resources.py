"""Disk and filesystem faults, injected (CI runs as root, which ignores file modes): a full disk
while answering keeps every row already written and says what it needs; `index` refuses a
store the disk cannot hold; a store that cannot be written still answers, its run record
beside --out."""

import errno
import json
import os
import shutil
import sqlite3

import pytest
from cli_tools import TINY, answer, cli, index_docs, last_run, rows, write_jsonl

QUESTIONS = [{"id": f"q{i}", "question": f"Question {i} about rings?", "docs": ["saturn"]} for i in range(4)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resources")
    return index_docs(tmp / "s.zarr", tmp, "saturn")


def test_a_full_disk_while_answering_keeps_the_rows_written_and_the_run_resumes(store, tmp_path, monkeypatch):
    queries = write_jsonl(tmp_path / "q.jsonl", *QUESTIONS)
    out = tmp_path / "a.jsonl"
    real_fsync, synced = os.fsync, []

    def fsync(fd):  # the second answer row meets a full disk
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(out):
            synced.append(fd)
            if len(synced) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    res = answer(queries, store, out, "--batch-size", 1, "-q")
    assert res.exit_code == 5, res.output
    assert "disk full" in res.stderr and "bytes" in res.stderr and "Traceback" not in res.output
    assert len(rows(out)) == 1 and out.read_text().endswith("\n")  # the first row whole, nothing torn
    assert last_run(store)["queries"] == 1  # the run's record says how far it got

    monkeypatch.setattr(os, "fsync", real_fsync)
    res = answer(queries, store, out, "-q")
    assert res.exit_code == 0, res.output
    assert sorted(r["id"] for r in rows(out)) == [q["id"] for q in QUESTIONS]


def test_index_refuses_a_store_the_disk_cannot_hold_unless_forced(tmp_path, monkeypatch):
    """Before the model loads and before anything is written, naming the size and the free space."""
    from lazyrag.commands import index as index_command
    from lazyrag.models import loading

    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "a", "text": "Text to index. " * 200})
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    real_load = loading.load_model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the disk check refused the store")

    monkeypatch.setattr(index_command, "load_model", no_model)
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY)
    assert res.exit_code == 5
    message = res.stderr.strip()
    assert "needs about" in message and "--force" in message and len(message.splitlines()) == 1
    assert "(bf16, 1.0 KiB per token)" in message and "97.7 KiB free" in message, message  # random:tiny: 1,024 B
    assert not (tmp_path / "s.zarr").exists()
    monkeypatch.setattr(index_command, "load_model", real_load)
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "-q", "--force")
    assert res.exit_code == 0, res.output


def test_a_run_log_that_rejects_the_record_keeps_it_beside_out(store, tmp_path, monkeypatch):
    from lazyrag.store import Store

    def read_only(self, run_id, record):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    runs_before = len(json.loads(cli("stats", "--store", store, "--json").stdout)["runs"])
    monkeypatch.setattr(Store, "save_run", read_only)
    queries = write_jsonl(tmp_path / "q.jsonl", *QUESTIONS[:2])
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out)
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "a.run.json").read_text())
    assert record["queries"] == 2 and record["out"] == str(out) and "interrupted" not in record
    assert str(tmp_path / "a.run.json") in res.stdout.replace("\n", "") and "readonly" in res.stderr
    monkeypatch.undo()
    assert len(json.loads(cli("stats", "--store", store, "--json").stdout)["runs"]) == runs_before


def files_of(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_store_on_a_read_only_filesystem_is_read_and_answered_without_a_write(store, tmp_path, monkeypatch):
    import lazyrag.store.access

    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    before = files_of(copy)
    monkeypatch.setattr(lazyrag.store.access, "writable", lambda path: False)  # as a read-only mount says
    res = cli("stats", "--store", copy, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["store"]["documents"] == 1
    assert cli("check", "--store", copy).exit_code == 0
    queries = write_jsonl(tmp_path / "q.jsonl", *QUESTIONS[:2])
    res = answer(queries, copy, tmp_path / "a.jsonl", "-q")
    assert res.exit_code == 0, res.output
    assert len(rows(tmp_path / "a.jsonl")) == 2
    record = json.loads((tmp_path / "a.run.json").read_text())
    assert record["queries"] == 2 and "interrupted" not in record
    assert "cannot be written" in res.stderr and str(tmp_path / "a.run.json") in res.stderr.replace("\n", "")
    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "new", "text": "More text."})
    for args in (("compact",), ("index", corpus, *TINY)):
        res = cli(*args, "--store", copy)
        assert res.exit_code == 4 and "cannot be written" in res.stderr, res.output
    assert files_of(copy) == before  # not a byte changed, no lock, WAL or index file made


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_stats_and_answer_work_on_a_store_without_write_permission(store, tmp_path):
    copy = tmp_path / "s.zarr"
    shutil.copytree(store, copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        assert cli("stats", "--store", copy).exit_code == 0
        queries = write_jsonl(tmp_path / "q.jsonl", *QUESTIONS[:1])
        res = answer(queries, copy, tmp_path / "a.jsonl")
        assert res.exit_code == 0, res.output
        assert (tmp_path / "a.run.json").exists()
    finally:
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_index_refuses_to_create_a_store_where_it_cannot_write(tmp_path, monkeypatch):
    real_access = os.access
    ro = tmp_path / "ro"
    ro.mkdir()
    # as a read-only mount answers, even to root
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(ro) and mode & os.W_OK
                        else real_access(path, mode, **kw))
    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "a", "text": "Some text."})
    res = cli("index", corpus, "--store", ro / "new.zarr", *TINY)
    assert res.exit_code == 4, res.output
    assert "cannot create a store" in res.stderr and "cannot be written" in res.stderr
    assert list(ro.iterdir()) == []
