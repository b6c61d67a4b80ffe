"""A store on object storage (a local S3): conditional puts, writers racing for a manifest number, chunk
reads checked against their checksums, the run log, and the settings check."""

from __future__ import annotations

import numpy as np
import pytest
from store_samples import add_documents, make_chunks, random_kv, settings

from lazyrag.store import ChunkReadError, Store, StoreError, StoreMismatch
from lazyrag.store.location import store_location
from lazyrag.store.objects import Objects


def open_as(monkeypatch, tmp_path, machine: str, url: str, **kwargs) -> Store:
    """The store at ``url`` as a process with its own local cache sees it (another machine)."""
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / machine))
    return Store.open(url, **kwargs)


def test_the_local_s3_refuses_a_conditional_put_on_an_existing_key(s3_url):
    """The manifest log relies on it: If-None-Match: * answered 412, not 500 (some moto releases)."""
    objects = Objects(store_location(s3_url))
    assert objects.create("manifests/000000000001.json", b"{}")
    assert not objects.create("manifests/000000000001.json", b"{\"other\": 1}")
    assert objects.read("manifests/000000000001.json") == b"{}"


def test_writers_racing_for_a_manifest_number_both_commit(s3_url, tmp_path, monkeypatch):
    s = settings()
    a, b = make_chunks(s, "a", [10, 20], seed=1), make_chunks(s, "b", [30], seed=2)
    kva, kvb = random_kv(s, a, 1), random_kv(s, b, 2)
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "first"))
    first = Store.create_or_open(s3_url, s)
    first.put_documents(a)
    second = open_as(monkeypatch, tmp_path, "second", s3_url, write=True, expect=s)
    second.put_documents(b)
    create, raced = Objects.create, []

    def race(self, key, data):
        if key.startswith("manifests/") and not raced:  # the first writer takes the number the second is about to
            raced.append(key)
            first.append(a, kva)
        return create(self, key, data)

    monkeypatch.setattr(Objects, "create", race)
    second.append(b, kvb)
    monkeypatch.setattr(Objects, "create", create)

    manifests = [key for key, _ in Objects(store_location(s3_url)).keys("manifests/")]
    assert manifests == [f"manifests/{n:012d}.json" for n in range(1, 5)]
    assert raced == [manifests[2]]  # the second writer tried number 3, the first's segment; it committed at 4
    first.close()
    for store in (second, open_as(monkeypatch, tmp_path, "third", s3_url)):  # the loser replayed the winner's
        assert store.documents() == ["a", "b"] and store.summary()["segments"] == 2
        for chunks, kv in ((a, kva), (b, kvb)):
            got = np.concatenate([store.read_kv(c).numpy() for c in store.doc_chunks(chunks[0].doc_id)])
            assert np.array_equal(got, kv)
        store.close()


def test_a_changed_byte_in_a_segment_object_is_an_error_naming_chunk_and_segment(s3_url, tmp_path, monkeypatch):
    s = settings()
    a = make_chunks(s, "a", [10, 20], seed=1)
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    with Store.create_or_open(s3_url, s) as st:
        add_documents(st, a, random_kv(s, a, 1))
        second = st.doc_chunks("a")[1]
    objects = Objects(store_location(s3_url))
    shard = next(k for k, _ in objects.keys(f"segments/{second.segment}/c/"))
    data = bytearray(objects.read(shard))
    data[second.offset * s.row_bytes + 100] ^= 0xFF
    objects.put(shard, bytes(data))
    with Store.open(s3_url) as st:
        st.read_kv(st.doc_chunks("a")[0])  # the other chunk reads as stored
        with pytest.raises(ChunkReadError) as info:
            st.read_kv(second)
        assert info.value.chunk_id == second.chunk_id and info.value.segment == second.segment
        assert second.chunk_id in str(info.value) and second.segment in str(info.value)
        assert [r["chunk"] for r in st.check().corrupt] == [second.chunk_id]


def test_runs_are_one_object_each_replaced_by_each_save(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    Store.create_or_open(s3_url, settings()).close()
    with Store.open(s3_url) as st:
        st.save_run("one", {"queries": 1})
        st.save_run("two", {"queries": 5})
        st.save_run("one", {"queries": 2})
    with open_as(monkeypatch, tmp_path, "elsewhere", s3_url) as st:
        assert st.runs() == [{"queries": 2}, {"queries": 5}] and st.summary()["runs"] == 2
    assert sorted(k for k, _ in Objects(store_location(s3_url)).keys("runs/")) == ["runs/one.json", "runs/two.json"]


def test_other_settings_are_refused_and_compaction_is_local_only(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    Store.create_or_open(s3_url, settings()).close()
    other = settings(fingerprint="abcdef987654", model="other-model")
    with pytest.raises(StoreMismatch) as info:
        Store.create_or_open(s3_url, other)
    assert settings().fingerprint in str(info.value) and "abcdef987654" in str(info.value)
    with Store.open(s3_url, write=True) as st, pytest.raises(StoreError, match="local stores only"):
        st.compact()
