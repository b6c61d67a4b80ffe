"""The pinned host tier on a CUDA GPU: it keeps the staging buffers chunks were read into and
hands staging one back when it evicts; every load, from the disk or the tier, is bit-exact.
Run on a GPU machine with `pytest -m gpu`."""

import json

import pytest
import torch

from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagePool
from lazyrag.store import Store

pytestmark = pytest.mark.gpu


def test_host_tier_hits_and_evictions_load_bit_exactly(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i} says {i * 7} things. " * 9}) + "\n"
                              for i in range(4)))
    build_index(IndexConfig(corpus=corpus, store=tmp_path / "s.zarr", model="random:smollm2-135m", device="cuda",
                            dtype="bf16", chunk_tokens=64), progress=False)
    store = Store.open(tmp_path / "s.zarr")
    s = store.settings
    a, b, c = (store.doc_chunks(f"d{i}")[0] for i in range(3))
    chunk_pages = max(-(-x.padded_length // s.page_size) for x in (a, b, c))
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, chunk_pages, s.page_size, torch.bfloat16,
                    torch.device("cuda"))  # room for one chunk
    buffer_bytes = store.max_padded_length() * s.row_bytes
    cache = ChunkCache(pool, ChunkLoader(store, pool, host_cache_bytes=2 * buffer_bytes))  # two buffers
    for info in (a, b, a, b, c, a, c):
        cache.prefetch([info])
        entry = cache.acquire(info)
        assert torch.equal(pool.read_tokens(entry.pages).cpu(), store.read_kv(info)), info.chunk_id
        cache.release(entry)
    # a, b from the disk; a, b from the tier; c from the disk (the tier lets a go); a from the disk
    # (b goes); c from the tier
    counters = cache.counters
    assert (counters.misses, counters.host_hits) == (7, 3)
    assert counters.bytes_read == sum(x.padded_length for x in (a, b, c, a)) * s.row_bytes
    cache.close()
    store.close()
