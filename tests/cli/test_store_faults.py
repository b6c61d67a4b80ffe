"""Faults in a store's files and in a corpus: each command refuses, repairs or reports them
the same way, and what it says names the damage, not the store's totals."""

import shutil

import pytest
from cli_tools import TINY, cli, index_docs


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
