"""Integrity: checksums checked on every read, damaged segments named, `check`, and the orphan
clean-up that deletes only this store's own segments."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from store_samples import add_documents, make_chunks, random_kv, settings

from lazyrag.store import ChunkReadError, Store


def _shard(path, segment):
    return next(p for p in (path / "segments" / segment / "c").rglob("*") if p.is_file())


def _flip_a_byte(path, s, chunk):
    """One byte of ``chunk``'s rows changed, as a disk or a stray write would."""
    with open(_shard(path, chunk.segment), "r+b") as f:
        f.seek(chunk.offset * s.row_bytes + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _two_segments(path):
    s = settings()
    a, b = make_chunks(s, "a", [10, 20], seed=1), make_chunks(s, "b", [30], seed=2)
    kvb = random_kv(s, b, 2)
    with Store.create_or_open(path, s) as st:
        add_documents(st, a, random_kv(s, a, 1))
        add_documents(st, b, kvb)
    return s, a, b, kvb


def test_a_flipped_byte_is_an_error_naming_chunk_and_segment(tmp_path):
    path = tmp_path / "s.zarr"
    s, a, b, kvb = _two_segments(path)
    with Store.open(path) as st:
        bad = st.doc_chunks("a")[1]
    _flip_a_byte(path, s, bad)
    with Store.open(path) as st:
        with pytest.raises(ChunkReadError, match=f"chunk {bad.chunk_id} \\(segment {bad.segment}") as info:
            st.read_kv(st.chunk(bad.chunk_id))
        assert info.value.corrupt and (info.value.chunk_id, info.value.segment) == (bad.chunk_id, bad.segment)
        st.read_kv(st.doc_chunks("a")[0])  # its neighbour in the same segment is intact
        np.testing.assert_array_equal(st.read_kv(st.doc_chunks("b")[0]).numpy(), kvb)
        report = st.check()
    assert not report.ok and [r["chunk"] for r in report.corrupt] == [bad.chunk_id] and not report.missing


def test_a_truncated_shard_names_its_segment_and_spares_the_others(tmp_path):
    path = tmp_path / "s.zarr"
    s, a, b, kvb = _two_segments(path)
    with Store.open(path) as st:
        seg_a = st.doc_chunks("a")[0].segment
    shard = _shard(path, seg_a)
    os.truncate(shard, shard.stat().st_size // 3)
    with Store.open(path) as st:
        with pytest.raises(ChunkReadError, match=f"segment {seg_a} is truncated") as info:
            st.read_kv(st.doc_chunks("a")[0])
        assert not info.value.corrupt and "offset-sized" not in str(info.value)
        np.testing.assert_array_equal(st.read_kv(st.doc_chunks("b")[0]).numpy(), kvb)
        report = st.check()
    assert {r["chunk"] for r in report.missing} == {c.chunk_id for c in a} and not report.corrupt
    shutil.rmtree(path / "segments" / seg_a)
    with Store.open(path) as st:
        with pytest.raises(ChunkReadError, match=f"segment {seg_a} is missing"):
            st.read_kv(st.doc_chunks("a")[0])
        assert st.check().missing_segments == [seg_a]


def test_a_check_without_verify_finds_missing_and_truncated_segments_but_reads_no_chunk(tmp_path):
    path = tmp_path / "s.zarr"
    s, a, b, kvb = _two_segments(path)
    with Store.open(path) as st:
        bad, seg_b = st.doc_chunks("a")[1], st.doc_chunks("b")[0].segment
    _flip_a_byte(path, s, bad)
    with Store.open(path) as st:
        assert st.check(verify=False).ok  # the sizes are right: only reading the data shows the damage
        assert [r["chunk"] for r in st.check().corrupt] == [bad.chunk_id]
    shard = _shard(path, seg_b)
    os.truncate(shard, shard.stat().st_size - 16)
    with Store.open(path) as st:
        report = st.check(verify=False)
    assert [(r["chunk"], r["segment"]) for r in report.missing] == [(b[0].chunk_id, seg_b)]
    assert "truncated" in report.missing[0]["reason"] and not report.corrupt and report.chunks == 3
    shutil.rmtree(path / "segments" / seg_b)
    with Store.open(path) as st:
        report = st.check(verify=False)
    assert report.missing_segments == [seg_b] and [r["chunk"] for r in report.missing] == [b[0].chunk_id]


def test_check_is_clean_on_a_sound_store_and_finds_orphans(tmp_path):
    path = tmp_path / "s.zarr"
    s, a, b, kvb = _two_segments(path)
    with Store.open(path) as st:
        assert st.check().ok and st.check().chunks == 3
        seg_b = st.doc_chunks("b")[0].segment
    shutil.copytree(path / "segments" / seg_b, path / "segments" / "seg-000009-0123abcd")  # a lost append
    marker = (path / "segments" / "seg-000009-0123abcd" / "lazyrag-segment.json")
    marker.write_text(marker.read_text().replace(seg_b, "seg-000009-0123abcd"))
    with Store.open(path) as st:
        report = st.check()
    assert not report.ok and report.orphan_segments == [str(path / "segments" / "seg-000009-0123abcd")]
    Store.open(path, write=True).close()  # opening for writing deletes it
    assert not (path / "segments" / "seg-000009-0123abcd").exists()


def test_clean_up_never_deletes_what_the_store_did_not_create(tmp_path):
    """A symlinked segments/ holding another store's segments and unrelated files, symlinked
    entries, unmarked look-alikes and another store's marked segment: all left in place."""
    other = tmp_path / "other.zarr"
    _two_segments(other)
    other_segments = sorted(p.name for p in (other / "segments").iterdir())
    (other / "segments" / "notes.txt").write_text("mine")
    (other / "segments" / "seg-000077-deadbeef").mkdir()  # our naming, no marker

    path = tmp_path / "s.zarr"
    s = settings()
    Store.create_or_open(path, s).close()
    shutil.rmtree(path / "segments", ignore_errors=True)
    (path / "segments").symlink_to(other / "segments")
    warnings: list[str] = []
    Store.create_or_open(path, s, warn=warnings.append).close()
    assert sorted(p.name for p in (other / "segments").iterdir()) == sorted(
        other_segments + ["notes.txt", "seg-000077-deadbeef"])
    assert any("symbolic link" in w for w in warnings)

    (path / "segments").unlink()
    (path / "segments").mkdir()
    victim = next(p for p in (other / "segments").iterdir() if (p / "lazyrag-segment.json").exists())
    (path / "segments" / "seg-000050-aaaaaaaa").symlink_to(victim)  # a symlinked entry
    shutil.copytree(victim, path / "segments" / victim.name)  # another store's marked segment
    (path / "segments" / "seg-000060-bbbbbbbb").mkdir()  # our naming, no marker, some data
    (path / "segments" / "seg-000060-bbbbbbbb" / "zarr.json").write_text("{}")
    (path / "segments" / "keep.bin").write_bytes(b"x")
    warnings.clear()
    Store.create_or_open(path, s, warn=warnings.append).close()
    left = sorted(p.name for p in (path / "segments").iterdir())
    assert left == sorted(["seg-000050-aaaaaaaa", victim.name, "seg-000060-bbbbbbbb", "keep.bin"])
    assert victim.exists() and len(warnings) == 4


def test_a_segment_stopped_before_its_marker_was_whole_is_deleted_and_nothing_holding_data(tmp_path):
    """A crash between a segment's mkdir and its marker leaves an empty directory or a torn marker:
    no data, so opening for writing deletes it. A torn marker beside any other file stays."""
    path = tmp_path / "s.zarr"
    s = settings()
    Store.create_or_open(path, s).close()
    segments = path / "segments"
    segments.mkdir(exist_ok=True)
    (segments / "seg-000001-00000001").mkdir()
    (segments / "seg-000002-00000002").mkdir()
    (segments / "seg-000002-00000002" / "lazyrag-segment.json").write_text('{"store_id": "')
    (segments / "seg-000003-00000003").mkdir()
    (segments / "seg-000003-00000003" / "lazyrag-segment.json").write_text("")
    (segments / "seg-000003-00000003" / "c").write_bytes(b"data")
    (segments / "seg-000004-00000004").mkdir()
    (segments / "seg-000004-00000004" / "lazyrag-segment.json").write_text(" " * 4096)  # too large to be one
    with Store.open(path) as st:
        assert sorted(Path(p).name for p in st.check().orphan_segments) == ["seg-000001-00000001",
                                                                          "seg-000002-00000002"]
    warnings: list[str] = []
    Store.create_or_open(path, s, warn=warnings.append).close()
    assert sorted(p.name for p in segments.iterdir() if p.is_dir()) == ["seg-000003-00000003", "seg-000004-00000004"]
    assert len(warnings) == 2 and all("left in place" in w for w in warnings)


def test_a_half_written_copy_of_the_segments_folders_metadata_is_deleted(tmp_path):
    """zarr rewrites segments/zarr.json through a temporary file as each segment's array is made: a
    kill in between leaves that file, which opening for writing deletes (no warning on every run)."""
    path = tmp_path / "s.zarr"
    s = settings()
    Store.create_or_open(path, s).close()
    segments = path / "segments"
    segments.mkdir(exist_ok=True)
    torn = segments / f"zarr.{'7da1ad70' * 4}.partial"
    torn.write_text('{"zarr_format": 3, "node_')
    (segments / "zarr.notzarrs.partial").write_text("{}")  # not zarr's name for one: left, with a warning
    with Store.open(path) as st:
        assert [Path(p).name for p in st.check().orphan_segments] == [torn.name]
    warnings: list[str] = []
    Store.create_or_open(path, s, warn=warnings.append).close()
    assert not torn.exists() and (segments / "zarr.notzarrs.partial").exists()
    assert len(warnings) == 1 and "zarr.notzarrs.partial" in warnings[0]
