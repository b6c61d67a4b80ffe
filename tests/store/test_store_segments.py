"""Segment files: KV written by append reads back bit-exact, by pread or through zarr."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import zarr
from store_samples import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    add_documents,
    as_bits,
    make_chunks,
    random_kv,
    rows_of,
    settings,
)

from lazyrag.store import FORMAT_VERSION, SegmentReader, Store, StoreError, StoreSettings, torch_dtype


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_append_read_round_trip_bit_exact(tmp_path, kv_dtype):
    s = settings(kv_dtype=kv_dtype)
    chunks = make_chunks(s, "doc", [1, 15, 16, 17, 40])
    kv = random_kv(s, chunks)
    if kv_dtype == "bfloat16":  # NaNs with payloads, infinities, signed zero
        kv[0, 0, 0, 0, :5] = [0x7FC1, 0xFFA5, 0x7F80, 0xFF80, 0x8000]
    else:
        kv[0, 0, 0, 0, :3] = [np.nan, np.inf, -0.0]
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(chunks, kv)
        for i, c in enumerate(chunks):
            info = st.chunk(c.chunk_id)
            assert (info.length, info.padded_length) == (len(c.token_ids), s.padded(len(c.token_ids)))
            t = st.read_kv(info)
            assert t.dtype == torch_dtype(kv_dtype)
            assert t.shape == (info.padded_length, LAYERS, 2, HEADS, HEAD_DIM)
            assert np.array_equal(as_bits(t), rows_of(kv, s, chunks, i).view(np.uint8))
            if kv_dtype == "bfloat16" and i == 0:
                bits = t.view(torch.int16).numpy().view(np.uint16)[0, 0, 0, 0, :5]
                assert bits.tolist() == [0x7FC1, 0xFFA5, 0x7F80, 0xFF80, 0x8000]
                assert torch.isnan(t[0, 0, 0, 0, 0]) and torch.isinf(t[0, 0, 0, 0, 2])
            out = torch.full_like(t, 7)
            assert st.read_kv(info, out=out) is out
            assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        with pytest.raises(StoreError, match="contiguous CPU tensor"):
            st.read_kv(st.chunk(chunks[0].chunk_id), out=torch.empty(1, dtype=torch_dtype(kv_dtype)))


def test_read_kv_from_several_segments_and_reopen(tmp_path):
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    a = make_chunks(s, "a", [20, 3], seed=1)
    b = make_chunks(s, "b", [33], seed=2)
    kva, kvb = random_kv(s, a, 1), random_kv(s, b, 2)
    with Store.create_or_open(path, s) as st:
        add_documents(st, a, kva)
        add_documents(st, b, kvb)
    with Store.open(path) as st:
        assert st.settings == s
        assert st.documents() == ["a", "b"]
        assert [c.chunk_id for c in st.doc_chunks("a")] == [c.chunk_id for c in a]
        assert [c.token_ids for c in st.doc_chunks("a")] == [c.token_ids for c in a]
        assert [c.chunk_id for c in st.iter_chunks()] == [c.chunk_id for c in a + b]
        assert st.num_chunks == 3
        info = st.chunk(b[0].chunk_id)
        assert (info.doc_id, info.ordinal, info.text, info.offset) == ("b", 0, "b chunk 0", 0)
        assert np.array_equal(as_bits(st.read_kv(info)), kvb.view(np.uint8))
        assert np.array_equal(as_bits(st.read_kv(st.chunk(a[1].chunk_id))), rows_of(kva, s, a, 1).view(np.uint8))
        with pytest.raises(StoreError, match="unknown chunk"):
            st.chunk("0" * 24)
        with pytest.raises(StoreError, match="read-only"):
            st.append(b, kvb)


def test_zarr_sees_the_same_data_and_one_read_gets_a_chunk(tmp_path):
    """The segments are ordinary zarr arrays: zarr reads the bytes read_kv reads, and
    each chunk is one byte range of its segment's file."""
    s = settings(kv_dtype="float16")
    chunks = make_chunks(s, "d", [5, 21])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(chunks, kv)
        infos = [st.chunk(c.chunk_id) for c in chunks]
        arr = zarr.open_array(str(tmp_path / "s.zarr" / "segments" / infos[1].segment), mode="r")
        assert np.array_equal(arr[:], kv)
    reader = SegmentReader(tmp_path / "s.zarr", s)
    try:
        for i, info in enumerate(infos):
            file, start, nbytes = reader.byte_range(info)
            with open(file, "rb") as f:
                raw = os.pread(f.fileno(), nbytes, start)
            assert raw == rows_of(kv, s, chunks, i).tobytes()
    finally:
        reader.close()
    attrs = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]["lazyrag"]
    assert attrs["format"] == "lazyrag-kv" and attrs["format_version"] == FORMAT_VERSION
    assert StoreSettings.from_json(attrs["settings"]) == s


def test_copied_store_still_reads(tmp_path):
    """Nothing in a store depends on its absolute path."""
    s = settings()
    chunks = make_chunks(s, "a", [9])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "one.zarr", s) as st:
        st.append(chunks, kv)
    shutil.copytree(tmp_path / "one.zarr", tmp_path / "two.zarr")
    with Store.open(tmp_path / "two.zarr") as st:
        assert np.array_equal(st.read_kv(st.chunk(chunks[0].chunk_id)).numpy(), kv)


def test_zarr_fallback_read_and_repeated_chunk_in_one_append(tmp_path):
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    c = make_chunks(s, "a", [20])[0]
    twice = [c, dataclasses.replace(c, ordinal=1)]  # the same content twice in one document
    kv = np.concatenate([random_kv(s, [c], 4)] * 2)
    with Store.create_or_open(path, s) as st:
        add_documents(st, twice, kv)
        assert st.num_chunks == 1 and st.summary()["padded_tokens"] == 32
        assert [i.chunk_id for i in st.doc_chunks("a")] == [c.chunk_id, c.chunk_id]
        name = st.chunk(c.chunk_id).segment
    # the segment rewritten by zarr itself, compressed: a layout the one-read path does
    # not recognise, so it is read through zarr
    seg_dir = path / "segments" / name
    data = zarr.open_array(str(seg_dir), mode="r")[:]
    shutil.rmtree(seg_dir)
    zarr.create_array(store=str(path), name=f"segments/{name}", data=data, chunks=(8, *s.row_shape))
    with Store.open(path) as st:
        info = st.chunk(c.chunk_id)
        got = st.read_kv(info)
        assert np.array_equal(as_bits(got), kv[:32].view(np.uint8))
    reader = SegmentReader(path, s)
    try:
        assert reader.byte_range(info) is None
    finally:
        reader.close()


@pytest.mark.parametrize("encoding, key", [({"name": "default", "configuration": {"separator": "."}}, "c.0.0.0.0.0"),
                                           ({"name": "v2", "configuration": {"separator": "/"}}, "0/0/0/0/0")])
def test_a_segment_under_another_chunk_key_encoding_still_reads_in_one_read(tmp_path, encoding, key):
    """The shard is found where the segment's own metadata puts it, not at zarr's default key."""
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    chunks = make_chunks(s, "a", [20, 7])
    kv = random_kv(s, chunks)
    with Store.create_or_open(path, s) as st:
        st.append(chunks, kv)
        infos = [st.chunk(c.chunk_id) for c in chunks]
    seg_dir = path / "segments" / infos[0].segment
    meta = json.loads((seg_dir / "zarr.json").read_text())
    meta["chunk_key_encoding"] = encoding
    (seg_dir / "zarr.json").write_text(json.dumps(meta))
    (seg_dir / key).parent.mkdir(parents=True, exist_ok=True)
    (seg_dir / "c" / "0" / "0" / "0" / "0" / "0").rename(seg_dir / key)
    shutil.rmtree(seg_dir / "c")  # the default key's empty folders
    assert np.array_equal(zarr.open_array(str(seg_dir), mode="r")[:], kv)
    reader = SegmentReader(path, s)
    try:
        for i, info in enumerate(infos):
            assert reader.byte_range(info)[0] == seg_dir / key
            assert np.array_equal(as_bits(reader.read_kv(info)), rows_of(kv, s, chunks, i).view(np.uint8))
    finally:
        reader.close()


def test_a_new_segment_is_durable_with_one_fsync_of_each_file_and_directory_in_order(tmp_path, monkeypatch):
    s = settings()
    chunks = make_chunks(s, "doc", [16, 40])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        real, synced = os.fsync, []
        monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
        st.append(chunks, kv)
        monkeypatch.setattr(os, "fsync", real)
    segs = tmp_path / "s.zarr" / "segments"
    (seg,) = [p for p in segs.iterdir() if p.is_dir()]
    on_disk = [str(p) for p in [seg, *seg.rglob("*")]] + [str(segs)]
    kept = [p for p in synced if p.startswith(str(segs))]
    assert sorted(kept) == sorted(on_disk)  # every file and directory of the segment once, and segments/
    shard = next(p for p in on_disk if os.path.isfile(p) and os.path.getsize(p) > kv.nbytes // 2)
    assert kept.index(shard) < kept.index(os.path.dirname(shard))  # its directory after it, holding its name
