"""The look-ahead: reads start in the order the chunks will be needed, the bytes read ahead stay
within the budget, each load starts the next wanted read, a finished read no one needs any more
gives its bytes back, the host tier is not read again, and answers do not depend on how reads queue
or on page pressure."""

from __future__ import annotations

import threading
import time

import torch
from serve_stores import make_store

from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagePool


class HeldReads:
    """A store whose chunk reads wait until released, one chunk at a time."""

    def __init__(self, store):
        self.store, self.settings = store, store.settings
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.whole: list[bool] = []
        self.by_process: dict[str, bool] = {}

    def max_padded_length(self) -> int:
        return self.store.max_padded_length()

    def release(self, *infos) -> None:
        for info in infos:
            self._gate(info.chunk_id).set()

    def read_kv(self, info, out=None, whole=False, into_out=None, verify=True):
        self._gate(info.chunk_id).wait(timeout=30)
        self.whole.append(whole)
        self.by_process[info.chunk_id] = into_out is not None
        return self.store.read_kv(info, out=out, whole=whole, into_out=into_out, verify=verify)

    def _gate(self, chunk_id: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(chunk_id, threading.Event())


def pool_for(store, num_pages=32):
    s = store.settings
    return PagePool(s.num_layers, s.num_kv_heads, s.head_dim, num_pages, s.page_size, torch.float32,
                    torch.device("cpu"))


def test_reads_ahead_start_in_need_order_within_the_budget(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny")
    c0, c1, c2, c3, c4, c5, c6 = list(store.iter_chunks())[:7]
    assert len({c.padded_length for c in (c0, c1, c2, c3, c4, c5, c6)}) == 1
    held = HeldReads(store)
    pool = pool_for(store)
    chunk_bytes = c0.padded_length * ChunkLoader(store, pool).row_bytes
    loader = ChunkLoader(held, pool, staging_bytes=2 * chunk_bytes)  # two chunks ahead at most

    def reading():
        return [c.chunk_id for c in (c0, c1, c2, c3, c4, c5, c6) if loader.reading(c.chunk_id)]

    def queued():
        return [c.chunk_id for c in (c0, c1, c2, c3, c4, c5, c6) if loader.queued(c.chunk_id)]

    loader.prefetch([c0, c1, c2, c3])
    assert reading() == [c0.chunk_id, c1.chunk_id] and queued() == [c2.chunk_id, c3.chunk_id]
    loader.prefetch([c3, c1, c2])  # the coming requests changed: c3 is needed first now
    assert reading() == [c0.chunk_id, c1.chunk_id]  # started reads go on; nothing past the budget
    held.release(c0)
    report = loader.load(c0, pool.alloc(1))
    assert report.read_ahead and report.bytes_read == chunk_bytes
    assert reading() == [c1.chunk_id, c3.chunk_id]  # c0's load made room: the first wanted, c3, started
    assert queued() == [c2.chunk_id]
    held.release(c1, c2, c3, c4)
    assert loader.load(c3, pool.alloc(1)).read_ahead
    report = loader.load(c4, pool.alloc(1))  # never asked for: read on demand
    assert not report.read_ahead and report.bytes_read == chunk_bytes
    while loader.reading(c1.chunk_id) or loader.reading(c2.chunk_id):  # read ahead, never loaded
        time.sleep(0.01)
    assert not queued()  # nothing is read ahead of c4, c5 or c6, and no read is under way
    loader.prefetch([c5, c6])  # no coming request needs c1 or c2 any more: their bytes come back
    assert reading() == [c5.chunk_id, c6.chunk_id]
    held.release(c5, c6)
    loader.close()
    assert held.whole and all(held.whole)  # each chunk in one piece
    # in the reader process, into a staging buffer; c4's, with both buffers taken, here into pageable memory
    # (c5's and c6's reads may not have started before the close)
    assert held.by_process == {cid: cid != c4.chunk_id for cid in held.by_process}
    assert {c0.chunk_id, c1.chunk_id, c2.chunk_id, c3.chunk_id, c4.chunk_id} <= held.by_process.keys()
    store.close()


def test_the_host_tier_is_not_read_ahead_and_its_hits_are_counted(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny")
    a, b, c = list(store.iter_chunks())[:3]
    pool = pool_for(store, num_pages=1)  # room for one chunk (one page each)
    cache = ChunkCache(pool, ChunkLoader(store, pool, host_cache_bytes=64 << 20))
    for info in (a, b):  # a is evicted by b and kept by the host tier
        cache.release(cache.acquire(info))
    cache.prefetch([a, c])
    assert not cache.is_loading(a.chunk_id)
    cache.release(cache.acquire(a))
    cache.release(cache.acquire(c))
    counters = cache.counters
    assert (counters.misses, counters.host_hits, counters.read_ahead) == (4, 1, 1)  # c was read ahead
    assert counters.bytes_read == 3 * store.read_kv(a).numel() * 4  # a, b and c from the disk once each
    cache.close()
    store.close()


def test_answers_are_the_same_with_reads_queued_behind_one_another_and_the_pool_under_pressure(
        tmp_path, tiny, monkeypatch):
    """One chunk read ahead at a time, so the others wait their turn (and the oldest request waits
    for its chunk with nothing running), and a pool that holds only the largest request: every
    request finishes with the answer it has with room for everything."""
    import functools

    from serve_stores import request

    from lazyrag.models.prompt import PromptFormat
    from lazyrag.serve import Engine, engine as engine_module

    store = make_store(tmp_path, "random:tiny")
    fmt = PromptFormat(tiny.tokenizer)
    docs = [["nile", "iron"], ["bach"], ["iron", "tokyo"], ["nile"], ["tokyo", "bach", "nile"], ["iron"],
            ["bach", "iron"], ["tokyo"]]

    def reqs():
        return [request(store, fmt, str(i), d, f"Question {i}?", 3) for i, d in enumerate(docs)]

    def answers(cache_bytes, **loader_kw):
        monkeypatch.setattr(engine_module, "ChunkLoader", functools.partial(ChunkLoader, **loader_kw))
        engine = Engine(tiny, store, "lazy", cache_bytes=cache_bytes, batch_size=3, stop_at_eos=False)
        done = {}
        engine.run(reqs(), lambda seq: done.__setitem__(seq.id, list(seq.generated)))
        counters = engine.cache.counters
        engine.close()
        return done, counters

    roomy, _ = answers(64 << 20)
    chunk = max(c.padded_length for r in reqs() for c in r.chunks) * store.settings.row_bytes
    pool = pool_for(store)
    largest = max(sum(pool.pages_for(c.padded_length) for c in r.chunks) for r in reqs())
    tight, counters = answers((largest + 8) * pool.bytes_per_page, staging_bytes=chunk)
    assert sorted(tight) == [str(i) for i in range(len(docs))] and tight == roomy
    assert counters.evictions > 0 and counters.read_ahead > 0
    store.close()
