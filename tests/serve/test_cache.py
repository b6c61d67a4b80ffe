"""The chunk cache's policy without a model or a store: exact page ids, LRU eviction order,
pins, counters. Page size 4: a chunk of 5-8 tokens takes 2 pages."""

import pytest
from serve_fakes import chunk, make_cache

from lazyrag.serve.loader import LoadReport
from lazyrag.serve.paged import OutOfPages

A, B, C = chunk("a", 6), chunk("b", 8), chunk("c", 5)  # 2 pages each


def use(cache, info):
    entry = cache.acquire(info)
    cache.release(entry)
    return entry.pages


def test_pages_go_out_lowest_first_and_freed_pages_come_back_first():
    cache, _ = make_cache(8)
    assert cache.alloc(3) == [0, 1, 2]
    assert cache.alloc(2) == [3, 4]
    cache.free([0, 1, 2])
    assert cache.alloc(2) == [0, 1]
    assert cache.alloc(2) == [2, 5]
    assert cache.available_pages() == 2
    with pytest.raises(OutOfPages, match="pool holds 8"):
        cache.alloc(9)


def test_a_miss_loads_into_new_pages_and_a_hit_reuses_them():
    cache, loader = make_cache(8)
    first = cache.acquire(A)
    again = cache.acquire(A)
    assert first is again and first.pages == [0, 1] and first.pins == 2
    assert loader.loads == [("a", [0, 1])]  # loaded once
    c = cache.counters
    assert (c.lookups, c.hits, c.misses) == (2, 1, 1)
    assert (c.lookup_tokens, c.hit_tokens, c.miss_tokens) == (12, 6, 6)
    assert (c.bytes_read, c.bytes_to_gpu, c.peak_pages, c.pool_pages) == (10, 10, 2, 8)


def test_eviction_takes_the_least_recently_used_chunk():
    cache, loader = make_cache(4)  # room for two chunks
    assert use(cache, A) == [0, 1]
    assert use(cache, B) == [2, 3]
    use(cache, A)                   # a is now more recent than b
    assert use(cache, C) == [2, 3]  # b evicted: c takes its pages
    assert [cache.is_resident(x.chunk_id) for x in (A, B, C)] == [True, False, True]
    assert use(cache, B) == [0, 1]  # a is the oldest now
    assert [cache.is_resident(x.chunk_id) for x in (A, B, C)] == [False, True, True]
    assert cache.counters.evictions == 2
    assert [cid for cid, _ in loader.loads] == ["a", "b", "c", "b"]


def test_pinned_chunks_are_never_evicted():
    cache, _ = make_cache(4)
    held_a, held_b = cache.acquire(A), cache.acquire(B)
    with pytest.raises(OutOfPages, match="all chunks pinned"):
        cache.acquire(C)
    assert cache.is_resident("a") and cache.is_resident("b") and held_a.pins == 1
    with pytest.raises(OutOfPages):
        cache.alloc(1)
    cache.release(held_b)
    assert cache.acquire(C).pages == held_b.pages  # the unpinned one goes
    assert not cache.is_resident("b") and cache.is_resident("a")


def test_available_pages_count_free_pages_and_unpinned_chunks_not_kept():
    cache, _ = make_cache(8)
    held = cache.acquire(A)
    use(cache, B)
    assert cache.available_pages() == 4 + 2  # free, plus b's
    assert cache.available_pages(keep={"b"}) == 4
    cache.release(held)
    assert cache.available_pages() == 8
    assert cache.available_pages(keep={"a", "b"}) == 4


def test_a_failed_load_gives_its_pages_back():
    cache, loader = make_cache(4)
    loader.failing.add("a")
    with pytest.raises(OSError):
        cache.acquire(A)
    assert not cache.is_resident("a") and cache.available_pages() == 4
    assert cache.acquire(B).pages == [0, 1]


def test_counters_add_up_the_loader_reports_and_reset_keeps_the_chunks():
    cache, loader = make_cache(8)
    loader.report = LoadReport(host_hit=True, read_wait_s=0.5, bytes_read=0, bytes_to_gpu=32)
    use(cache, A)
    use(cache, B)
    c = cache.counters
    assert (c.host_hits, c.read_wait_s, c.bytes_read, c.bytes_to_gpu) == (2, 1.0, 0, 64)
    assert c.to_json()["hit_ratio"] == 0.0
    cache.reset_counters()
    use(cache, A)
    c = cache.counters
    assert (c.lookups, c.hits, c.misses, c.bytes_to_gpu) == (1, 1, 0, 0)
    assert c.to_json()["hit_ratio"] == 1.0


def test_prefetch_asks_the_loader_only_for_chunks_not_in_the_pool():
    cache, loader = make_cache(8)
    use(cache, A)
    cache.prefetch([A, B, C])
    assert loader.prefetched == ["b", "c"]
    cache.close()
    assert loader.closed


def holds(wanted):
    """Rates a cached selection as the `head` policy does: usable where it holds every page wanted."""
    return lambda selection: 0.0 if set(wanted) <= set(selection) else None


def test_the_cached_choice_found_is_the_one_the_caller_rates_highest():
    cache, _ = make_cache(8)
    wide = cache.keep_recomputed("ctx", (0, 2), cache.alloc(2), 32)
    empty = cache.keep_recomputed("ctx", (), [], 0)
    for entry in (wide, empty):
        cache.release(entry)
    assert cache.find_recomputed("ctx", holds((1,))) is None
    assert cache.find_recomputed("other", holds(())) is None
    assert cache.find_recomputed("ctx", holds((2,))) is wide and wide.pins == 1
    assert cache.find_recomputed("ctx", holds(())) is wide  # a tie goes to the last used
    assert cache.find_recomputed("ctx", lambda selection: -len(selection)) is empty
    assert cache.find_recomputed("ctx", holds(())) is empty  # now the last used
    assert cache.counters.reused_tokens == 64
    one = cache.keep_recomputed("ctx", (1,), cache.alloc(1), 16)
    assert cache.find_recomputed("ctx", holds((1,))) is one and one.pins == 2
    assert cache.find_recomputed("ctx", lambda selection: float(len(selection))) is wide  # the most pages
    for entry in (wide, wide, wide, empty, empty, one, one):
        cache.release(entry)
    cache.evict(wide.key)
    assert cache.find_recomputed("ctx", holds((2,))) is None and cache.find_recomputed("ctx", holds((1,))) is one


def test_a_chunk_read_ahead_is_loaded_into_free_pages_and_its_first_use_is_a_miss():
    cache, loader = make_cache(6)
    loader.done = [A, B]
    cache.prefetch([A, B])
    assert loader.loads == [("a", [0, 1]), ("b", [2, 3])]  # before any request asks
    assert cache.is_resident("a") and not cache.is_loading("a")
    assert loader.ordered_after == []  # compute waits for a copy only once it reads the chunk
    entry = cache.acquire(A)
    assert entry.pages == [0, 1] and loader.ordered_after == ["copy of a"]
    cache.release(entry)
    use(cache, A)
    c = cache.counters
    assert (c.lookups, c.hits, c.misses, c.bytes_read) == (2, 1, 1, 20)  # b's read is counted too
    assert loader.ordered_after == ["copy of a"]  # ordered once: later compute is on the same stream


def test_loading_ahead_takes_free_pages_only_and_a_never_used_chunk_is_settled_before_eviction():
    cache, loader = make_cache(4)
    use(cache, A)  # pages 0-1, unpinned
    loader.done = [B, C]
    cache.prefetch([B, C])
    assert loader.loads == [("a", [0, 1]), ("b", [2, 3])]  # c would need a's pages: it waits for its request
    assert cache.is_resident("a")
    cache.evict("b")  # loaded ahead, never used
    assert loader.settled == ["copy of b"]
    cache.evict("a")  # used: compute was ordered after its copy already
    assert loader.settled == ["copy of b"]


def test_a_read_ahead_that_fails_to_load_is_left_to_its_request():
    cache, loader = make_cache(6)
    loader.done, loader.failing = [A, B], {"a"}
    cache.prefetch([A, B])
    assert not cache.is_resident("a") and cache.is_resident("b")
    assert cache.pool.num_free == 4  # a's pages came back
    with pytest.raises(OSError, match="cannot read a"):
        cache.acquire(A)
