"""The engine over an fp8 store: the pool holds e4m3 pages with their scales, quantises the
request's own tokens as the store does, the loader moves values and scales bit for bit, lazy and
block answer alike, and a model loaded for another KV dtype is refused."""

import pytest
import torch
from serve_stores import make_store, request, step_logits

from lazyrag import kernels
from lazyrag.eval.fidelity import token_kl, top1_matches
from lazyrag.models import load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagePool
from lazyrag.store import StoreMismatch


@pytest.fixture
def fp8_store(tmp_path):
    return make_store(tmp_path, "random:tiny", chunk_tokens=32, dtype="fp8")


def test_pool_quantises_the_steps_tokens_row_by_row():
    pool = PagePool(2, 3, 64, 4, 16, kernels.FP8, torch.device("cpu"))
    assert pool.bytes_per_page == 16 * 2 * 2 * 3 * (64 + 4)  # e4m3 values and an fp32 scale per row
    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64) * 100
    slots = torch.tensor([17, 18, 19, 40, 41])  # page 1 rows 1-3, page 2 rows 8-9
    pool.write_slots(1, slots, k, v)
    k_pages, v_pages = pool.layer(1)
    k_scale, v_scale = pool.layer_scales(1)
    for x, pages, scales in ((k, k_pages, k_scale), (v, v_pages, v_scale)):
        values, scale = kernels.quantize_fp8(x)
        assert torch.equal(pages.view(-1, 3, 64)[slots].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(scales.view(-1, 3)[slots], scale)
    keys = pool.keys(1, torch.tensor([1, 2])).flatten(0, 1)[slots - 16]
    assert ((keys - k).abs() <= k.abs() / 16 + 1e-6).all()
    assert pool.layer_scales(0)[0].abs().sum() == 0  # other layers untouched


def test_loader_moves_fp8_values_and_scales_bit_exactly(fp8_store):
    s = fp8_store.settings
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 32, s.page_size, kernels.FP8, torch.device("cpu"))
    cache = ChunkCache(pool, ChunkLoader(fp8_store, pool))
    for doc in ("nile", "bach"):
        info = fp8_store.doc_chunks(doc)[0]
        entry = cache.acquire(info)
        assert torch.equal(pool.read_tokens(entry.pages), fp8_store.read_kv(info))
        cache.release(entry)
    assert pool.scales.abs().sum() > 0
    cache.close()


def requests(loaded, store):
    fmt = PromptFormat(loaded.tokenizer)
    return [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?"),
            request(store, fmt, "b", ["bach", "nile", "tokyo"], "Where was Bach born?"),
            request(store, fmt, "c", ["iron"], "What is the symbol of iron?"),
            request(store, fmt, "d", ["tokyo", "bach"], "When did Tokyo become the capital?")]


def test_block_reads_what_lazy_reads_up_to_the_requantised_keys(fp8_store, tiny_fp8):
    """Block's private copies hold the keys rotated and quantised again: its logits stay within
    e4m3's rounding of lazy's, far closer than the gap from an fp32 store."""
    reqs = requests(tiny_fp8, fp8_store)
    lazy, block = (step_logits(tiny_fp8, fp8_store, mode, reqs) for mode in ("lazy", "block"))
    for got, want in zip(block, lazy):
        assert (got - want).abs().max() < 2e-3 * want.abs().max()


@pytest.mark.slow
def test_block_follows_lazy_on_an_fp8_store(tmp_path):
    """On a real model: teacher-forced along lazy's greedy answers, block's requantised keys keep
    lazy's next token almost everywhere (they are rounded to e4m3 twice, so not bit for bit)."""
    smollm_fp8 = load_model("smollm2-135m", device="cpu", dtype="fp8")
    store = make_store(tmp_path, "smollm2-135m", dtype="fp8")
    engines = {mode: Engine(smollm_fp8, store, mode, cache_bytes=64 << 20, batch_size=4) for mode in ("lazy", "block")}
    answers = {}
    engines["lazy"].run(requests(smollm_fp8, store), lambda seq: answers.__setitem__(seq.id, seq.generated))
    forced = [answers[r.id] for r in requests(smollm_fp8, store)]
    lazy, block = (torch.cat(engines[m].teacher_forced_logits(requests(smollm_fp8, store), forced)) for m in engines)
    for engine in engines.values():
        engine.close()
    assert len({tuple(a) for a in forced}) == len(forced)  # answers that follow their prompts
    assert top1_matches(lazy, block).float().mean() >= 0.85
    assert token_kl(lazy, block).mean() < 0.02


def test_a_model_loaded_for_another_kv_dtype_is_refused(tmp_path, fp8_store, tiny, tiny_fp8):
    assert tiny_fp8.kv_dtype == kernels.FP8 and tiny_fp8.dtype == torch.float32  # computes as auto does
    with pytest.raises(StoreMismatch, match="KV is float8_e4m3fn but the model was loaded for float32"):
        Engine(tiny, fp8_store, "lazy", cache_bytes=8 << 20, batch_size=2)
    (tmp_path / "fp32").mkdir()
    fp32_store = make_store(tmp_path / "fp32", "random:tiny", chunk_tokens=32)
    with pytest.raises(StoreMismatch, match="KV is float32 but the model was loaded for float8_e4m3fn"):
        Engine(tiny_fp8, fp32_store, "lazy", cache_bytes=8 << 20, batch_size=2)
