"""Chunk loads from a real store: bit-exact after eviction and reload, and the host tier
serving evicted chunks without the disk."""

import torch
from serve_stores import make_store

from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagePool


def cache_for(store, num_pages, host_cache_bytes=0):
    s = store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, num_pages, s.page_size, torch.bfloat16,
                    torch.device("cpu"))
    return ChunkCache(pool, ChunkLoader(store, pool, host_cache_bytes)), pool


def test_evicted_chunk_reloads_bit_exactly_and_counters_follow_lru(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    a, b, c = (store.doc_chunks(d)[0] for d in ("nile", "iron", "tokyo"))
    per_chunk = max(-(-x.padded_length // store.settings.page_size) for x in (a, b, c))
    cache, pool = cache_for(store, 2 * per_chunk)  # room for two chunks

    def use(info):
        entry = cache.acquire(info)
        got = pool.read_tokens(entry.pages)
        cache.release(entry)
        return got

    first = use(a)
    assert torch.equal(first.view(torch.int16), store.read_kv(a).view(torch.int16))
    trace = [b, a, c, b, a]
    results = [use(x) for x in trace]
    # by hand: a miss; b miss; a hit; c miss, evicts b; b miss, evicts a; a miss, evicts c
    assert (cache.counters.lookups, cache.counters.hits, cache.counters.misses) == (6, 1, 5)
    assert cache.counters.evictions == 3
    assert torch.equal(results[-1].view(torch.int16), first.view(torch.int16))  # a, reloaded after eviction
    assert cache.counters.lookup_tokens == sum(x.length for x in [a] + trace)
    cache.close()


def test_host_tier_serves_evicted_chunks_without_the_disk(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    a, b = (store.doc_chunks(d)[0] for d in ("nile", "iron"))
    pages = max(-(-x.padded_length // store.settings.page_size) for x in (a, b))
    cache, pool = cache_for(store, pages, host_cache_bytes=64 << 20)  # room for one chunk
    for info in (a, b, a, b):  # every use is a miss; only the first two read the disk
        entry = cache.acquire(info)
        assert torch.equal(pool.read_tokens(entry.pages).view(torch.int16), store.read_kv(info).view(torch.int16))
        cache.release(entry)
    c = cache.counters
    assert (c.misses, c.host_hits) == (4, 2)
    assert c.read_wait_s > 0  # the two disk reads
    assert c.bytes_read == sum(store.read_kv(x).numel() * 2 for x in (a, b))  # each read from disk once
    assert c.bytes_to_gpu == 2 * c.bytes_read
    cache.close()


def test_prefetched_chunks_load_bit_exactly(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    chunks = list(store.iter_chunks())
    cache, pool = cache_for(store, 64)
    cache.prefetch(chunks[:2])
    for info in chunks[:3]:  # two read ahead, one on demand
        entry = cache.acquire(info)
        assert torch.equal(pool.read_tokens(entry.pages).view(torch.int16), store.read_kv(info).view(torch.int16))
    assert cache.counters.bytes_read == sum(store.read_kv(x).numel() * 2 for x in chunks[:3])
    cache.close()


def test_a_chunk_the_host_tier_keeps_is_loaded_ahead_into_free_pages_without_a_read(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    a, b = (store.doc_chunks(d)[0] for d in ("nile", "iron"))
    pages = max(-(-x.padded_length // store.settings.page_size) for x in (a, b))
    cache, pool = cache_for(store, pages, host_cache_bytes=64 << 20)  # room for one chunk
    for info in (a, b):  # a is evicted by b and kept by the host tier
        cache.release(cache.acquire(info))
    cache.prefetch([a])
    assert not cache.is_resident(a.chunk_id)  # no free page: nothing is evicted for the look-ahead
    cache.evict(b.chunk_id)
    cache.prefetch([a])
    assert cache.is_resident(a.chunk_id) and cache.counters.host_hits == 1
    entry = cache.acquire(a)
    assert torch.equal(pool.read_tokens(entry.pages).view(torch.int16), store.read_kv(a).view(torch.int16))
    assert cache.counters.bytes_read == sum(store.read_kv(x).numel() * 2 for x in (a, b))  # a read once
    cache.release(entry)
    cache.close()
