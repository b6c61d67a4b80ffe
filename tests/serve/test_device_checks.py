"""A chunk read checked where it lands (on the GPU; here on the CPU pool through the same path):
the reader process is asked for no crc32c, the device's crc32c is compared with the catalog's in
the working memory made with the loader, a corrupt chunk fails its load as on the host, and a
device whose crc32c of known bytes is wrong or fails falls back to the host."""

import time

import pytest
import torch
from serve_stores import make_store
from test_chunk_read_errors import corrupt

from lazyrag.serve import loader as loader_module
from lazyrag.serve.loader import ChunkLoader, DeviceCopies
from lazyrag.serve.paged import PagePool
from lazyrag.store import ChunkReadError


def pool_for(store, num_pages=32):
    s = store.settings
    return PagePool(s.num_layers, s.num_kv_heads, s.head_dim, num_pages, s.page_size, torch.bfloat16,
                    torch.device("cpu"))


@pytest.fixture
def watched(monkeypatch):
    """Counts the device checks and records whether each process read asked for a crc32c."""
    seen = {"checks": 0, "process_crc": []}
    real_check = loader_module.device_crc32c

    def check(data, scratch=None):
        seen["checks"] += 1
        return real_check(data, scratch)

    monkeypatch.setattr(loader_module, "device_crc32c", check)
    return seen


def load_all(store, loader, pool, chunks, ahead: bool):
    if ahead:
        loader.prefetch(chunks)
    out = []
    for info in chunks:
        pages = pool.alloc(pool.pages_for(info.padded_length))
        report = loader.load(info, pages)
        assert report.read_ahead == ahead
        out.append(pool.read_tokens(pages)[: info.padded_length])
    return out


@pytest.mark.parametrize("ahead", [False, True])
def test_checked_on_the_device_loads_what_the_host_path_loads(tmp_path, tiny, watched, ahead):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [store.doc_chunks(d)[0] for d in ("nile", "iron", "tokyo")]
    pool = pool_for(store)
    loader = ChunkLoader(store, pool, check_on_device=True)
    real_read = loader.process.read
    loader.process.read = lambda *a, **k: watched["process_crc"].append(k.get("checksum", True)) or real_read(*a, **k)
    got = load_all(store, loader, pool, chunks, ahead)
    assert watched["checks"] == 3 and watched["process_crc"] and not any(watched["process_crc"])
    for info, kv in zip(chunks, got):
        assert torch.equal(kv.view(torch.int16), store.read_kv(info).view(torch.int16))
    loader.close()
    store.close()


def test_a_corrupt_chunk_fails_its_load_and_only_it(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    bad, good = store.doc_chunks("nile")[0], store.doc_chunks("iron")[0]
    corrupt(tmp_path / "s.zarr", bad)
    pool = pool_for(store)
    loader = ChunkLoader(store, pool, check_on_device=True)
    loader.prefetch([bad, good])
    with pytest.raises(ChunkReadError, match=f"{bad.chunk_id}.*checksum does not match") as err:
        loader.load(bad, pool.alloc(pool.pages_for(bad.padded_length)))
    assert err.value.corrupt
    with pytest.raises(ChunkReadError, match=bad.chunk_id):  # read again on demand: the same error
        loader.load(bad, pool.alloc(pool.pages_for(bad.padded_length)))
    pages = pool.alloc(pool.pages_for(good.padded_length))
    loader.load(good, pages)
    assert torch.equal(pool.read_tokens(pages)[: good.padded_length].view(torch.int16),
                       store.read_kv(good).view(torch.int16))
    copies = loader.device_copies
    assert len(copies.free) == copies.count  # neither the failed copy nor the loaded one holds a buffer
    loader.close()
    store.close()


def test_the_device_checks_work_in_memory_made_with_the_loader(tmp_path, tiny, monkeypatch):
    from lazyrag import kernels

    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [store.doc_chunks(d)[0] for d in ("nile", "iron", "tokyo")]
    pool = pool_for(store)
    loader = ChunkLoader(store, pool, check_on_device=True)
    copies = loader.device_copies
    real, outs = kernels.bit_rows, []
    monkeypatch.setattr(kernels, "bit_rows", lambda *a, out=None: outs.append(out) or real(*a, out=out))
    load_all(store, loader, pool, chunks, ahead=True)
    start = copies.scratch.data_ptr()
    end = start + copies.scratch.numel() * copies.scratch.element_size()
    assert outs and all(o is not None and start <= o.data_ptr() < end for o in outs)  # every level, none allocated
    assert all((o.data_ptr() - start) % 64 == 0 for o in outs)  # in every buffer's memory, each level aligned
    assert any(o.data_ptr() - start >= 4 * copies.words for o in outs)  # not only the first buffer's
    odd = DeviceCopies(1000, 3, torch.device("cpu"))  # buffers and their levels aligned, whatever a chunk's size
    assert all(odd.buffer(i, 1000).data_ptr() % 64 == 0 and odd.scratch[i * odd.words:].data_ptr() % 64 == 0
               for i in range(3))
    landed = {word & 0xFFFFFFFF for word in copies.results.tolist()}
    assert {c.checksum for c in chunks} <= landed  # each result came back through the loader's host words
    loader.close()
    store.close()


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_a_device_that_gets_known_bytes_wrong_leaves_the_checks_to_the_host(tmp_path, tiny, monkeypatch, fault):
    from lazyrag.serve import device_checksums

    real = device_checksums.device_crc32c

    def broken(data, scratch=None):
        if fault == "raises":
            raise RuntimeError("injected: no kernel for this device")
        return real(data, scratch) ^ 1

    monkeypatch.setattr(device_checksums, "device_crc32c", broken)
    monkeypatch.setattr(loader_module, "device_crc32c", broken)
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [store.doc_chunks(d)[0] for d in ("nile", "iron")]
    pool = pool_for(store)
    warned = []
    loader = ChunkLoader(store, pool, check_on_device=True, warn=warned.append)
    assert not loader.check_on_device
    assert len(warned) == 1 and "checked on the host" in warned[0]
    assert ("injected" if fault == "raises" else "known bytes") in warned[0]
    for info, kv in zip(chunks, load_all(store, loader, pool, chunks, ahead=True)):  # sound chunks load
        assert torch.equal(kv.view(torch.int16), store.read_kv(info).view(torch.int16))
    loader.close()
    store.close()


def test_copies_on_the_device_stay_within_its_room_and_the_rest_are_checked_on_the_host(tmp_path, tiny, watched):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    a, b, c, d = (store.doc_chunks(x)[0] for x in ("nile", "iron", "tokyo", "bach"))
    pool = pool_for(store)
    loader = ChunkLoader(store, pool, check_on_device=True)
    assert loader.device_copies.count == store.num_chunks  # at most one per stored chunk, within the room
    loader.device_copies = DeviceCopies(loader.device_copies.nbytes, 1, torch.device("cpu"))  # one chunk's copy
    loader.prefetch([a, b, c])
    while any(loader.reading(x.chunk_id) for x in (a, b, c)):
        time.sleep(0.01)
    assert watched["checks"] == 1 and not loader.device_copies.free
    got = load_all(store, loader, pool, [a, b, c], ahead=True)  # the reads already made, loaded
    for info, kv in zip((a, b, c), got):
        assert torch.equal(kv.view(torch.int16), store.read_kv(info).view(torch.int16))
    assert len(loader.device_copies.free) == 1
    load_all(store, loader, pool, [d], ahead=True)
    assert watched["checks"] == 2  # the room is free again
    loader.close()
    store.close()


def test_a_read_asked_for_no_crc32c_is_refused_by_a_check_that_wants_one(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    info = store.doc_chunks("nile")[0]
    with pytest.raises(ChunkReadError, match="read none"):
        store.read_kv(info, into_out=lambda file, offset, nbytes: None)
    store.close()


@pytest.mark.gpu
def test_on_a_gpu_reads_are_checked_there_by_default_and_corrupt_ones_fail(tmp_path, tiny, watched):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [store.doc_chunks(d)[0] for d in ("nile", "iron", "tokyo")]
    bad = store.doc_chunks("bach")[0]
    corrupt(tmp_path / "s.zarr", bad)
    s = store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 32, s.page_size, torch.bfloat16, torch.device("cuda"))
    loader = ChunkLoader(store, pool)
    assert loader.check_on_device
    got = load_all(store, loader, pool, chunks, ahead=True)
    torch.cuda.synchronize()
    assert watched["checks"] == 3
    for info, kv in zip(chunks, got):
        assert torch.equal(kv.cpu().view(torch.int16), store.read_kv(info).view(torch.int16))
    loader.prefetch([bad])
    with pytest.raises(ChunkReadError, match="checksum does not match"):
        loader.load(bad, pool.alloc(pool.pages_for(bad.padded_length)))
    loader.close()
    store.close()


@pytest.mark.gpu
def test_on_a_gpu_reads_and_their_checks_make_no_device_segment(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [c for d in ("nile", "iron", "tokyo", "bach") for c in store.doc_chunks(d)]
    s = store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 64, s.page_size, torch.bfloat16, torch.device("cuda"))
    loader = ChunkLoader(store, pool, read_threads=4)
    assert loader.check_on_device and loader.device_copies.count >= len(chunks)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    loader.prefetch(chunks)  # each read copied to the GPU and checked there, on its reader thread's stream
    while any(loader.reading(c.chunk_id) for c in chunks):
        time.sleep(0.01)
    assert all(loader.pending[c.chunk_id].on_device is not None for c in chunks)
    assert torch.cuda.memory_stats().get("segment.all.allocated", 0) == before
    loader.close()
    store.close()


@pytest.mark.parametrize("mode,kv", [("lazy", "fp32"), ("block", "fp32"), ("lazy", "fp8")])
def test_the_engine_answers_the_same_with_reads_checked_on_the_device(request, tmp_path, monkeypatch, watched, mode,
                                                                     kv):
    from functools import partial

    from serve_stores import request as make_request

    from lazyrag.models.prompt import PromptFormat
    from lazyrag.serve import Engine
    from lazyrag.serve import engine as engine_module

    tiny = request.getfixturevalue("tiny_fp8" if kv == "fp8" else "tiny")
    store = make_store(tmp_path, "random:tiny", dtype=kv)
    fmt = PromptFormat(tiny.tokenizer)

    def answers() -> dict:
        reqs = [make_request(store, fmt, "a", ["nile", "iron"], "How long?", 4),
                make_request(store, fmt, "b", ["bach", "nile", "tokyo"], "Where?", 4),
                make_request(store, fmt, "c", ["iron"], "Which symbol?", 4)]
        engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=2)
        out = {}
        engine.run(reqs, lambda s: out.setdefault(s.id, list(s.generated)))
        engine.close()
        return out

    on_the_host = answers()
    assert watched["checks"] == 0
    monkeypatch.setattr(engine_module, "ChunkLoader", partial(ChunkLoader, check_on_device=True))
    assert answers() == on_the_host and watched["checks"] > 0
    store.close()


class _Copy:
    """Stands in for a copy's CUDA event, which the CPU pool has none of."""

    def synchronize(self):
        pass


@pytest.mark.parametrize("on_device", [False, True])
def test_a_buffer_loaded_from_its_device_copy_comes_back_with_no_copy_to_wait_for(tmp_path, tiny, monkeypatch,
                                                                                  on_device):
    store = make_store(tmp_path, "random:tiny", dtype="bf16")
    chunks = [store.doc_chunks(d)[0] for d in ("nile", "iron")]
    pool = pool_for(store)
    loader = ChunkLoader(store, pool, check_on_device=on_device)
    real_to_pool, copies = loader._to_pool, []

    def to_pool(kv, pages):
        real_to_pool(kv, pages)
        copies.append(_Copy())
        return copies[-1]

    monkeypatch.setattr(loader, "_to_pool", to_pool)
    given = []
    real_give = loader.staging.give
    monkeypatch.setattr(loader.staging, "give", lambda buf, copied=None: given.append(copied) or real_give(buf, copied))
    load_all(store, loader, pool, chunks, ahead=True)
    # from the host, the pages' copy reads the buffer, so it comes back with that copy to wait for
    assert given == ([None, None] if on_device else copies)
    loader.close()
    store.close()
