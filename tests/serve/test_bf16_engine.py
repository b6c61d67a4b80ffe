"""The CPU default, a bf16 store: the model computes in fp32, the pool holds bf16 pages (the step's
own K/V cast as they are written), chunks are read back bit for bit, and the logits stay within
bf16's rounding of an fp32 store's."""

import pytest
import torch
from serve_stores import make_store, request, step_logits

from lazyrag.eval.fidelity import token_kl, top1_matches
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagePool
from lazyrag.store import StoreMismatch


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The same documents indexed with --kv-dtype auto (bf16) and fp32."""
    return {dtype: make_store(tmp_path_factory.mktemp(dtype), "random:tiny", chunk_tokens=32, dtype=dtype)
            for dtype in ("auto", "fp32")}


def test_auto_on_the_cpu_stores_bf16_and_computes_in_fp32(tiny_bf16, stores):
    assert tiny_bf16.kv_dtype == torch.bfloat16 and tiny_bf16.dtype == torch.float32
    assert next(tiny_bf16.model.parameters()).dtype == torch.float32
    assert stores["auto"].settings.kv_dtype == "bfloat16"
    assert stores["auto"].settings.row_bytes * 2 == stores["fp32"].settings.row_bytes


def test_pool_casts_the_steps_fp32_kv_to_its_bf16_pages():
    pool = PagePool(2, 3, 64, 4, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.bytes_per_page == 16 * 2 * 2 * 3 * 64 * 2
    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    slots = torch.tensor([17, 18, 19, 40, 41])
    pool.write_slots(1, slots, k, v)
    k_pages, v_pages = pool.layer(1)
    assert torch.equal(k_pages.view(-1, 3, 64)[slots], k.to(torch.bfloat16))
    assert torch.equal(v_pages.view(-1, 3, 64)[slots], v.to(torch.bfloat16))
    keys = pool.keys(1, torch.tensor([1, 2])).flatten(0, 1)[slots - 16]
    assert keys.dtype == torch.float32 and torch.equal(keys, k.to(torch.bfloat16).float())


def test_loader_moves_bf16_chunks_bit_exactly(stores):
    store = stores["auto"]
    s = store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 32, s.page_size, torch.bfloat16, torch.device("cpu"))
    cache = ChunkCache(pool, ChunkLoader(store, pool))
    for doc in ("nile", "bach"):
        info = store.doc_chunks(doc)[0]
        entry = cache.acquire(info)
        got = pool.read_tokens(entry.pages)
        assert got.dtype == torch.bfloat16 and torch.equal(got, store.read_kv(info))
        cache.release(entry)
    cache.close()


def requests(loaded, store):
    fmt = PromptFormat(loaded.tokenizer)
    return [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?"),
            request(store, fmt, "b", ["bach", "nile", "tokyo"], "Where was Bach born?"),
            request(store, fmt, "c", ["iron"], "What is the symbol of iron?")]


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_a_bf16_store_gives_logits_close_to_an_fp32_stores(stores, tiny, tiny_bf16, mode):
    """bf16 keeps 8 bits of mantissa (relative rounding 2**-9): the logits move by about that share of
    their range, the next-token distributions barely (KL), and the greedy token not at all."""
    want = step_logits(tiny, stores["fp32"], mode, requests(tiny, stores["fp32"]))
    got = step_logits(tiny_bf16, stores["auto"], mode, requests(tiny_bf16, stores["auto"]))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert not torch.equal(g, w)  # the KV really was rounded
        assert (g - w).abs().max() < 1e-2 * w.abs().max()  # 2e-3 measured
        assert token_kl(w, g).max() < 1e-5  # 7e-8 measured (random weights: flat distributions)
        assert top1_matches(w, g).all()


def test_an_fp32_store_and_a_bf16_model_refuse_each_other(stores, tiny, tiny_bf16):
    with pytest.raises(StoreMismatch, match="KV is bfloat16 but the model was loaded for float32"):
        Engine(tiny, stores["auto"], "lazy", cache_bytes=8 << 20, batch_size=2)
    with pytest.raises(StoreMismatch, match="KV is float32 but the model was loaded for bfloat16"):
        Engine(tiny_bf16, stores["fp32"], "lazy", cache_bytes=8 << 20, batch_size=2)
