"""The engine on a CUDA GPU with the Triton kernels (bf16): index, then the three modes,
CUDA graphs against eager steps, staged chunk loads. Run on a GPU machine with `pytest -m gpu`."""

import json

import pytest
import torch
from serve_stores import place

from lazyrag import kernels
from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.models import load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Request
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.paged import PagedAttention, PagePool, StepInputs, pack_step
from lazyrag.store import Store

pytestmark = pytest.mark.gpu

TEXT = ("The quick brown fox jumps over the lazy dog. " * 12 + "\n\n") * 3


@pytest.fixture(scope="module", params=["random:smollm2-135m", "random:qwen3-0.6b"])
def setup(request, tmp_path_factory):
    model = request.param
    tmp = tmp_path_factory.mktemp("gpu")
    corpus = tmp / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i}. " + TEXT[i * 7:]}) + "\n"
                              for i in range(6)))
    build_index(IndexConfig(corpus=corpus, store=tmp / "s.zarr", model=model, device="cuda", dtype="bf16",
                            chunk_tokens=200), progress=False)
    return load_model(model, "cuda", "bf16"), Store.open(tmp / "s.zarr")


def requests(store, fmt):
    docs = [["d0", "d3", "d1"], ["d1", "d0"], ["d5", "d2", "d4", "d0"]]
    return [Request(f"r{i}", [c for d in ds for c in store.doc_chunks(d)], fmt.question_ids(f"Question {i}?"), 8)
            for i, ds in enumerate(docs)]


def prefill_logits(loaded, store, mode):
    # no CUDA graphs: a test swaps in the reference kernels, which sync and cannot be captured
    engine = Engine(loaded, store, mode, cache_bytes=4 << 30, batch_size=8, cuda_graphs=False)
    reqs = place(engine, requests(store, PromptFormat(loaded.tokenizer)))
    logits = engine.runner.prefill(reqs).float()
    engine.close()
    return logits


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_triton_engine_matches_reference_kernels(setup, monkeypatch):
    loaded, store = setup
    triton_logits = prefill_logits(loaded, store, "lazy")
    for name in ("lazy_prefill", "lazy_decode", "rotate_copy"):
        monkeypatch.setattr(kernels, name, getattr(kernels.reference, name))
    reference_logits = prefill_logits(loaded, store, "lazy")
    assert rel(triton_logits, reference_logits) < 2e-2


def test_lazy_block_full_agree_on_gpu(setup):
    loaded, store = setup
    lazy, block = prefill_logits(loaded, store, "lazy"), prefill_logits(loaded, store, "block")
    assert rel(lazy, block) < 2e-2
    full = prefill_logits(loaded, store, "full")
    assert rel(lazy, full) > rel(lazy, block)  # full sees across chunks; lazy and block do not


def test_generation_runs_in_every_mode(setup):
    loaded, store = setup
    for mode in ("lazy", "block", "full"):
        engine = Engine(loaded, store, mode, cache_bytes=4 << 30, batch_size=2, stop_at_eos=False)
        done = []
        engine.run(requests(store, PromptFormat(loaded.tokenizer)), done.append)
        engine.close()
        assert sorted(r.id for r in done) == ["r0", "r1", "r2"]
        assert all(len(r.generated) == 8 and r.ttft_ms > 0 for r in done)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_prefill_graphs_match_eager_layers(setup, mode):
    """A prefill step's layers replayed from the graphs of its length's bucket, attention between
    them: close to the eager step (other matmul shapes, so bf16 rounds a little differently),
    exactly the same when replayed again after a longer step of the same bucket has left its
    rows in the static buffers, and eager past the largest bucket."""
    from lazyrag.serve.runner import prompt_feeds

    loaded, store = setup
    engine = Engine(loaded, store, mode, cache_bytes=4 << 30, batch_size=8, stop_at_eos=False)
    runner = engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None
    reqs = place(engine, requests(store, PromptFormat(loaded.tokenizer)))
    short = prompt_feeds(reqs[0], reqs[0].placement.prompt_ids)
    both = [f for s in reqs[:2] for f in prompt_feeds(s, s.placement.prompt_ids)]
    assert len(short[-1].tokens) < sum(len(f.tokens) for f in both) <= graphs.buckets[0]  # one bucket
    first = runner.forward(short).float().clone()
    runner.forward(both)
    assert torch.equal(runner.forward(short).float(), first)
    runner.prefill_graphs = None
    eager = runner.forward(short).float()
    runner.prefill_graphs = graphs
    assert rel(first, eager) < 3e-2
    assert graphs.bucket(graphs.buckets[-1]) == graphs.buckets[-1] and graphs.bucket(graphs.buckets[-1] + 1) is None
    engine.close()


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_cuda_graph_decode_matches_eager(setup, mode):
    loaded, store = setup
    engine = Engine(loaded, store, mode, cache_bytes=4 << 30, batch_size=8, stop_at_eos=False)
    runner = engine.runner
    assert runner.graphs is not None
    reqs = place(engine, requests(store, PromptFormat(loaded.tokenizer)))  # 3 requests: the graph pads them to 4
    for r, t in zip(reqs, runner.prefill(reqs).argmax(-1).tolist()):
        r.generated.append(t)
    model = loaded.model
    for _ in range(3):
        feeds = [r.feed([r.generated[-1]]) for r in reqs]
        replayed = runner.graphs.run(feeds)[:, : runner.vocab].float().clone()
        # the same step with the token ids on the device (sampled, not read back): the same numbers
        ids = torch.tensor([r.generated[-1] for r in reqs], device=loaded.device)
        on_device = runner.graphs.run([r.feed([0]) for r in reqs], ids)[:, : runner.vocab].float()
        assert torch.equal(on_device, replayed)
        # the same padded batch run eagerly: the same matmul shapes and attention kernels (in lazy,
        # the graph's own chunk-major plan and the feeds it packs), so close to bit-exact
        plan = runner.graphs._plans[4] if runner.chunk_major else None
        host, packed = pack_step(feeds if plan is None else runner.chunk_major.graph_feeds(feeds, plan),
                                 engine.pool.page_size, batch=4, pad_slot=runner.graphs.pad_slot)
        step = StepInputs.on(host.to(loaded.device), packed)
        step.shared = plan
        attention = PagedAttention(engine.pool, step, model.inv_freq, runner.sm_scale, engine.mode.rotate_queries)
        padded = model.logits(model(step.tokens, step.positions, attention))[:3, : runner.vocab].float()
        assert rel(replayed, padded) < 2e-3
        # the plain step: other matmul shapes, so bf16 rounding differs a little
        eager = runner.forward(feeds).float()
        assert rel(replayed, eager) < 3e-2
        assert torch.equal(runner.forward([r.feed([0]) for r in reqs], tokens=ids).float(), eager)
        for r, t in zip(reqs, eager.argmax(-1).tolist()):
            r.generated.append(t)
            r.fed += 1
    runner.graphs.max_pages = 1  # a step wider than the graphs' table runs eagerly
    assert runner.graphs.run([r.feed([r.generated[-1]]) for r in reqs]) is None
    engine.close()


def test_staged_chunk_loads_are_bit_exact(setup):
    """Chunk reads go through recycled pinned buffers: load, evict and reload every chunk three
    times (some prefetched, some read on demand) and compare the pool with the store."""
    loaded, store = setup
    cfg = loaded.cfg
    pool = PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, store.settings.page_size,
                    loaded.dtype, loaded.device)
    loader = ChunkLoader(store, pool)
    cache = ChunkCache(pool, loader)
    assert loader.staging.nbytes == store.max_padded_length() * loader.row_bytes  # the longest chunk fits
    chunks = list(store.iter_chunks())
    for _ in range(3):
        cache.prefetch(chunks[: len(chunks) // 2])
        for info in chunks:
            entry = cache.acquire(info)
            assert torch.equal(pool.read_tokens(entry.pages).cpu(), store.read_kv(info)), info.chunk_id
            cache.release(entry)
            cache.evict(info.chunk_id)
    cache.close()


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_cold_runs_with_chunks_loaded_ahead_answer_as_warm_ones_do(setup, mode):
    """Cold: chunks are read ahead and copied into the pool before their requests run (batch 1,
    so the later requests' chunks arrive while the first decodes); warm: all resident. Same
    greedy answers, CUDA graphs on."""
    loaded, store = setup
    fmt = PromptFormat(loaded.tokenizer)
    engine = Engine(loaded, store, mode, cache_bytes=4 << 30, batch_size=1)

    def answers():
        out = {}
        engine.run(requests(store, fmt), lambda seq: out.__setitem__(seq.id, list(seq.generated)))
        return out

    cold = answers()
    counters = engine.cache.counters
    assert counters.read_ahead > 0 and counters.misses > 0
    engine.cache.reset_counters()
    warm = answers()
    assert engine.cache.counters.misses == 0
    assert warm == cold
    engine.close()


def test_recomputed_pages_reused_on_the_gpu_equal_recomputing_them(setup):
    """The default path (attention-ranked recompute, pages reused): a request that asks an earlier
    one's question over its documents reads every recomputed page from the cache, and those pages
    hold exactly what a fresh engine recomputing them for it writes (Triton kernels, bf16)."""
    from lazyrag.serve import Recompute
    from lazyrag.serve.cache import Recomputed

    loaded, store = setup
    first, *_ = requests(store, PromptFormat(loaded.tokenizer))
    again = Request("again", first.chunks, first.question_ids, first.max_new_tokens)
    recompute = Recompute(0.3, "attention")

    def run(reqs):
        engine = Engine(loaded, store, "lazy", cache_bytes=4 << 30, batch_size=1, recompute=recompute)
        engine.run(reqs, lambda seq: None)
        return engine, {e.key: e for e in engine.cache._resident.values() if isinstance(e, Recomputed)}

    both, kept = run([first, again])
    counters = both.cache.counters
    assert counters.recomputed_tokens > 0 and counters.reused_tokens == counters.recomputed_tokens
    alone, fresh = run([again])
    assert kept.keys() == fresh.keys() and any(e.pages for e in fresh.values())
    for key, entry in fresh.items():
        assert torch.equal(both.pool.kv[:, :, kept[key].pages], alone.pool.kv[:, :, entry.pages])
    both.close()
    alone.close()
