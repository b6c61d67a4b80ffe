"""The zarr KV store (lazyrag/store.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from lazyrag.store import store as store_mod
from lazyrag.store import (
    FORMAT_VERSION,
    NewChunk,
    Store,
    StoreError,
    StoreMismatch,
    StoreSettings,
    chunk_id_for,
    kv_to_storage,
    storage_dtype,
)

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 16


def settings(**changes) -> StoreSettings:
    base = StoreSettings(
        model="random:tiny",
        fingerprint="f" * 8 + "0123",
        kv_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        preamble_ids=(1, 2, 3),
        rope={"theta": 10000.0},
        chunking={"chunk_tokens": 64, "splitter": "paragraph-sentence-v1"},
        encoding={"attend": "preamble+self"},
    )
    return dataclasses.replace(base, **changes)


def make_chunks(s: StoreSettings, doc_id: str, lengths, seed: int = 0) -> list[NewChunk]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = tuple(int(t) for t in rng.integers(0, 50_000, size=n))
        out.append(NewChunk(chunk_id_for(s, ids), doc_id, i, ids, f"{doc_id} chunk {i}"))
    return out


def random_kv(s: StoreSettings, chunks, seed: int = 0) -> np.ndarray:
    """Random KV in the storage dtype; padding rows zero, as an indexer makes them."""
    rng = np.random.default_rng(seed)
    parts = []
    for c in chunks:
        rows = np.zeros((s.padded(len(c.token_ids)), *s.row_shape), dtype=storage_dtype(s.kv_dtype))
        n = len(c.token_ids)
        if s.kv_dtype == "bfloat16":
            rows[:n] = rng.integers(0, 2**16, size=(n, *s.row_shape), dtype=np.uint16)  # every bit pattern
        else:
            rows[:n] = rng.standard_normal((n, *s.row_shape)).astype(rows.dtype)
        parts.append(rows)
    return np.concatenate(parts)


def rows_of(kv: np.ndarray, s: StoreSettings, chunks, i: int) -> np.ndarray:
    start = sum(s.padded(len(c.token_ids)) for c in chunks[:i])
    return kv[start : start + s.padded(len(chunks[i].token_ids))]


def as_bits(t: torch.Tensor) -> np.ndarray:
    return kv_to_storage(t).view(np.uint8)


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
            assert t.dtype == store_mod.torch_dtype(kv_dtype)
            assert t.shape == (info.padded_length, LAYERS, 2, HEADS, HEAD_DIM)
            assert np.array_equal(as_bits(t), rows_of(kv, s, chunks, i).view(np.uint8))
            if kv_dtype == "bfloat16" and i == 0:
                bits = t.view(torch.int16).numpy().view(np.uint16)[0, 0, 0, 0, :5]
                assert bits.tolist() == [0x7FC1, 0xFFA5, 0x7F80, 0xFF80, 0x8000]
                assert torch.isnan(t[0, 0, 0, 0, 0]) and torch.isinf(t[0, 0, 0, 0, 2])
            out = torch.full_like(t, 7)
            assert st.read_kv(info, out=out) is out
            assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_read_kv_from_several_segments_and_reopen(tmp_path):
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    a = make_chunks(s, "a", [20, 3], seed=1)
    b = make_chunks(s, "b", [33], seed=2)
    kva, kvb = random_kv(s, a, 1), random_kv(s, b, 2)
    with Store.create_or_open(path, s) as st:
        st.append(a, kva)
        st.append(b, kvb)
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


def test_zarr_sees_the_same_data(tmp_path):
    """The segments are ordinary zarr arrays: zarr reads the bytes read_kv reads."""
    import zarr

    s = settings(kv_dtype="float16")
    chunks = make_chunks(s, "d", [5, 21])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(chunks, kv)
        info = st.chunk(chunks[1].chunk_id)
        arr = zarr.open_array(str(tmp_path / "s.zarr" / "segments" / info.segment), mode="r")
        assert np.array_equal(arr[:], kv)
        assert st._segment(info.segment).contiguous  # the one-read fast path is in use
    attrs = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]["lazyrag"]
    assert attrs["format"] == "lazyrag-kv" and attrs["format_version"] == FORMAT_VERSION
    assert StoreSettings.from_json(attrs["settings"]) == s


def test_append_is_idempotent_and_records_shared_chunks(tmp_path):
    s = settings()
    chunks = make_chunks(s, "a", [10, 30])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(chunks, kv)
        before = st.summary()
        st.append(chunks, kv)  # everything present: nothing written
        assert st.summary()["segments"] == before["segments"] == 1
        assert st.num_chunks == 2
        # a new document repeating chunk 1 and adding one new chunk: only the new
        # chunk's rows are written, but the document lists both
        new = make_chunks(s, "b", [7], seed=9)[0]
        b = [dataclasses.replace(chunks[1], doc_id="b", ordinal=0), dataclasses.replace(new, doc_id="b", ordinal=1)]
        kvb = np.concatenate([rows_of(kv, s, chunks, 1), random_kv(s, [new], 9)])
        st.append(b, kvb)
        assert st.num_chunks == 3 and st.summary()["segments"] == 2
        assert [c.chunk_id for c in st.doc_chunks("b")] == [chunks[1].chunk_id, new.chunk_id]
        assert st.chunk(new.chunk_id).offset == 0 and st.chunk(new.chunk_id).padded_length == PAGE
        assert np.array_equal(st.read_kv(st.chunk(new.chunk_id)).numpy(), kvb[32:])
        assert st.chunk(chunks[1].chunk_id).doc_id == "a"  # first document that had it
        # link: a document made only of stored chunks
        st.link([dataclasses.replace(chunks[0], doc_id="c", ordinal=0)])
        assert [c.chunk_id for c in st.doc_chunks("c")] == [chunks[0].chunk_id]
        # a reference to a chunk not stored yet shows once the chunk is appended
        later = make_chunks(s, "x", [3], seed=5)
        st.link(later)
        assert st.doc_chunks("x") == [] and "x" in st.documents()
        st.append(later, random_kv(s, later, 5))
        assert [c.chunk_id for c in st.doc_chunks("x")] == [later[0].chunk_id]
        st.note_documents(["a", "d"])
        assert st.documents() == ["a", "b", "c", "x", "d"]


def test_append_checks_shapes_and_dtype(tmp_path):
    s = settings(kv_dtype="bfloat16")
    chunks = make_chunks(s, "a", [10])
    kv = random_kv(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        with pytest.raises(StoreError, match="shape"):
            st.append(chunks, kv[:10])
        with pytest.raises(StoreError, match="dtype"):
            st.append(chunks, kv.astype(np.float16))
        assert st.num_chunks == 0


def test_kv_to_storage_bf16_bits():
    t = torch.randn(4, 3, dtype=torch.float32).to(torch.bfloat16)
    bits = kv_to_storage(t)
    assert bits.dtype == np.uint16
    assert torch.equal(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), t)


def test_mismatch_refused_with_both_fingerprints(tmp_path):
    path = tmp_path / "s.zarr"
    Store.create_or_open(path, settings()).close()
    other = settings(fingerprint="abcdef987654", model="other-model")
    with pytest.raises(StoreMismatch) as e:
        Store.create_or_open(path, other)
    msg = str(e.value)
    assert settings().fingerprint in msg and "abcdef987654" in msg and "--store" in msg
    with pytest.raises(StoreMismatch, match="chunking"):
        Store.create_or_open(path, settings(chunking={"chunk_tokens": 128, "splitter": "paragraph-sentence-v1"}))
    for change in ({"kv_dtype": "float16"}, {"page_size": 32}, {"preamble_ids": (1, 2)}, {"encoding": {"attend": "self"}}):
        with pytest.raises(StoreMismatch):
            Store.create_or_open(path, settings(**change))
    # the display name and informational rope parameters do not block reuse
    Store.create_or_open(path, settings(model="renamed", rope={"theta": 10000.0, "note": "x"})).close()


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
        with pytest.raises(StoreError, match="another process"):
            Store.create_or_open(path, settings())
        Store.open(path).close()  # readers are fine
    Store.create_or_open(path, settings()).close()


def test_crash_between_data_and_commit(tmp_path, monkeypatch):
    s = settings(kv_dtype="bfloat16")
    path = tmp_path / "s.zarr"
    a, b = make_chunks(s, "a", [12], seed=1), make_chunks(s, "b", [40, 9], seed=2)
    kva, kvb = random_kv(s, a, 1), random_kv(s, b, 2)
    st = Store.create_or_open(path, s)
    st.append(a, kva)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before the catalog commit")

    monkeypatch.setattr(Store, "_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        st.append(b, kvb)
    monkeypatch.undo()
    st.close()
    segs = sorted(p.name for p in (path / "segments").iterdir() if p.is_dir())
    assert len(segs) == 2  # the data of the lost append is on disk...

    with Store.open(path) as ro:  # ...but invisible
        assert ro.num_chunks == 1 and ro.documents() == ["a"] and not ro.has_chunk(b[0].chunk_id)
        assert ro.summary()["segments"] == 1 and ro.doc_chunks("b") == []
    with Store.create_or_open(path, s) as st:  # opening for writing deletes the orphan
        assert len([p for p in (path / "segments").iterdir() if p.is_dir()]) == 1
        st.append(b, kvb)
        assert st.num_chunks == 3
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
        st.add_run({"mode": "lazy", "queries": 3, "hits": 5, "nested": {"ttft_ms": [1.5, 2.0]}})
        st.add_run({"mode": "block", "queries": 1})
    with Store.open(path) as st:
        assert st.runs() == [
            {"mode": "lazy", "queries": 3, "hits": 5, "nested": {"ttft_ms": [1.5, 2.0]}},
            {"mode": "block", "queries": 1},
        ]
        assert st.summary()["runs"] == 2


def test_summary_numbers(tmp_path):
    s = settings(kv_dtype="float16")
    path = tmp_path / "s.zarr"
    a = make_chunks(s, "a", [5, 17])
    b = make_chunks(s, "b", [16], seed=3)
    with Store.create_or_open(path, s) as st:
        empty = st.summary()
        assert (empty["documents"], empty["chunks"], empty["tokens"], empty["segments"]) == (0, 0, 0, 0)
        st.append(a, random_kv(s, a))
        st.append(b, random_kv(s, b, 3))
        st.note_documents(["c"])
        got = st.summary()
    row_bytes = LAYERS * 2 * HEADS * HEAD_DIM * 2
    assert got["documents"] == 3 and got["chunks"] == 3 and got["tokens"] == 5 + 17 + 16
    assert got["padded_tokens"] == 16 + 32 + 16 and got["kv_bytes"] == 64 * row_bytes
    assert got["bytes"] >= got["kv_bytes"]
    assert got["segments"] == 2
    assert (got["model"], got["fingerprint"], got["kv_dtype"], got["page_size"]) == (s.model, s.fingerprint, "float16", PAGE)
    assert got["created"] <= got["updated"] and got["created"].startswith("20")


def test_chunk_id_stable_and_content_addressed():
    s = settings()
    ids = (5, 6, 7)
    cid = chunk_id_for(s, ids)
    assert len(cid) == 24 and int(cid, 16) >= 0
    assert cid == chunk_id_for(settings(), [5, 6, 7])  # same content, same id
    assert cid == chunk_id_for(settings(model="renamed"), ids)
    assert chunk_id_for(s, (5, 6, 8)) != cid
    assert chunk_id_for(s, (5, 6)) != chunk_id_for(s, (5, 6, 0))
    assert chunk_id_for(settings(fingerprint="beef"), ids) != cid
    assert chunk_id_for(settings(chunking={"chunk_tokens": 32}), ids) != cid
    assert chunk_id_for(settings(encoding={"attend": "self"}), ids) != cid
    # pinned value: if this changes, every existing store's chunk ids change with it
    # (bump FORMAT_VERSION when that is intended)
    assert cid == "58603fa1a1a7ae6696454266"
    assert s.compat_key() == StoreSettings.from_json(json.loads(json.dumps(s.to_json()))).compat_key()


def test_settings_json_round_trip():
    s = settings()
    d = json.loads(json.dumps(s.to_json()))
    assert StoreSettings.from_json(d) == s
    with pytest.raises(StoreError):
        settings(kv_dtype="int8")


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


def test_zarr_fallback_read_and_repeated_chunk_in_one_append(tmp_path, monkeypatch):
    s = settings(kv_dtype="bfloat16")
    c = make_chunks(s, "a", [20])[0]
    twice = [c, dataclasses.replace(c, ordinal=1)]  # the same content twice in one document
    kv = np.concatenate([random_kv(s, [c], 4)] * 2)
    with Store.create_or_open(tmp_path / "s.zarr", s) as st:
        st.append(twice, kv)
        assert st.num_chunks == 1 and st.summary()["padded_tokens"] == 32
        assert [i.chunk_id for i in st.doc_chunks("a")] == [c.chunk_id, c.chunk_id]
    # a segment whose layout the fast path does not recognise is read through zarr
    real = Store._load_segment

    def slow(self, name):
        seg = real(self, name)
        seg.contiguous = False
        return seg

    monkeypatch.setattr(Store, "_load_segment", slow)
    with Store.open(tmp_path / "s.zarr") as st:
        got = st.read_kv(st.chunk(c.chunk_id))
        assert not st._segment(st.chunk(c.chunk_id).segment).contiguous
        assert np.array_equal(as_bits(got), kv[:32].view(np.uint8))
