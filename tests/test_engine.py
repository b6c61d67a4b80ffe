"""The engine: lazy against transformers with a block mask, the three modes against each
other, the cache's sharing, reloads and counters."""

import json
from pathlib import Path

import pytest
import torch

from lazyrag.serve.cache import ChunkCache
from lazyrag.config import IndexConfig
from lazyrag.serve.engine import Engine, Request
from lazyrag.commands.index import build_index
from lazyrag.serve.paged import DELTA, PAGE, PagedAttention, PagePool, StepInputs, StepLayout, copy_step, pack_step
from lazyrag.models.prompt import PromptFormat
from lazyrag.store import Store

DOCS = {
    "nile": "The Nile is about 6,650 kilometres long. It flows north into the Mediterranean Sea.",
    "iron": "Iron has the symbol Fe and atomic number 26. Most of Earth's core is iron.",
    "tokyo": "Tokyo became the capital of Japan in 1868, when the emperor moved there from Kyoto.",
    "bach": "Johann Sebastian Bach was born in Eisenach in 1685 and worked in Leipzig.",
}


def make_store(tmp_path: Path, model: str, chunk_tokens: int = 16, dtype: str = "fp32") -> Store:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    build_index(IndexConfig(corpus=corpus, store=tmp_path / "s.zarr", model=model, device="cpu", dtype=dtype,
                            chunk_tokens=chunk_tokens), progress=False)
    return Store.open(tmp_path / "s.zarr")


def request(store, fmt, rid, docs, question, max_new_tokens=6):
    chunks = [c for d in docs for c in store.doc_chunks(d)]
    return Request(rid, chunks, fmt.question_ids(question), max_new_tokens)


def rotate64(x, angle_pos, inv_freq):
    """Rotate x [..., T, D] by positions [T] in float64 (rotate-half convention)."""
    ang = angle_pos.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.slow
def test_lazy_logits_equal_transformers_over_a_block_cache(tmp_path, smollm):
    """The reference is transformers' own model, cache and attention: each chunk encoded after
    the preamble (transformers' forward), its keys moved to their logical positions (float64
    rotation here), then the question run by transformers over that cache at logical positions.
    (One forward with a block mask and logical position ids would not do: a chunk's own hidden
    states depend on its distance to the preamble, which lazy fixes at index time.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    from lazyrag.models.loading import smollm2_dir

    store = make_store(tmp_path, "smollm2-135m")
    fmt = PromptFormat(smollm.tokenizer)
    engine = Engine(smollm, store, "lazy", cache_bytes=64 << 20, batch_size=4)
    reqs = [request(store, fmt, "a", ["nile", "iron", "tokyo"], "How long is the Nile?"),
            request(store, fmt, "b", ["tokyo", "nile"], "When did Tokyo become the capital?")]
    assert len(reqs[0].chunks) > 3, "documents should be split into several chunks"
    for r in reqs:
        engine._place(r)
    ours = engine._prefill(reqs)

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    inv_freq = smollm.model.inv_freq
    preamble = list(store.settings.preamble_ids)
    P = len(preamble)
    for r, logits in zip(reqs, ours):
        layers = [([], []) for _ in range(smollm.cfg.num_layers)]
        with torch.no_grad():
            past = hf(torch.tensor([preamble]), use_cache=True).past_key_values
            for l, layer in enumerate(past.layers):
                layers[l][0].append(layer.keys)
                layers[l][1].append(layer.values)
            pos = P
            for c in r.chunks:
                past = hf(torch.tensor([preamble + list(c.token_ids)]), use_cache=True).past_key_values
                shift = torch.full((c.length,), pos - P)
                for l, layer in enumerate(past.layers):
                    layers[l][0].append(rotate64(layer.keys[:, :, P:], shift, inv_freq).float())
                    layers[l][1].append(layer.values[:, :, P:])
                pos += c.length
            cache = DynamicCache()
            for l, (ks, vs) in enumerate(layers):
                cache.update(torch.cat(ks, dim=2), torch.cat(vs, dim=2), l)
            q = torch.tensor([r.question_ids])
            ref = hf(q, past_key_values=cache, position_ids=torch.arange(pos, pos + q.shape[1])[None]).logits[0, -1]
        assert (logits - ref).abs().max() / ref.abs().max() < 1e-4
        # and the reference is sharp: the same prompt under plain causal attention differs
        ids = preamble + [t for c in r.chunks for t in c.token_ids] + r.question_ids
        with torch.no_grad():
            causal = hf(torch.tensor([ids])).logits[0, -1]
        assert (causal - ref).abs().max() / ref.abs().max() > 1e-3


def run_mode(loaded, store, mode, reqs_fn, cache_bytes=64 << 20, batch_size=3):
    engine = Engine(loaded, store, mode, cache_bytes=cache_bytes, batch_size=batch_size)
    done = {}
    engine.run(reqs_fn(), lambda r: done.__setitem__(r.id, r.generated))
    engine.close()
    return done


@pytest.mark.slow
def test_modes_agree_and_full_equals_transformers_generate(tmp_path, smollm):
    from transformers import AutoModelForCausalLM

    from lazyrag.models.loading import smollm2_dir

    store = make_store(tmp_path, "smollm2-135m")
    fmt = PromptFormat(smollm.tokenizer)

    def reqs():
        return [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?"),
                request(store, fmt, "b", ["bach", "nile", "tokyo"], "Where was Bach born?"),
                request(store, fmt, "c", ["iron"], "What is the symbol of iron?"),
                request(store, fmt, "d", ["tokyo", "bach"], "When did Tokyo become the capital?")]

    lazy, block, full = (run_mode(smollm, store, m, reqs) for m in ("lazy", "block", "full"))
    assert lazy == block
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    preamble = list(store.settings.preamble_ids)
    for r in reqs():
        ids = preamble + [t for c in r.chunks for t in c.token_ids] + r.question_ids
        out = hf.generate(torch.tensor([ids]), max_new_tokens=r.max_new_tokens, do_sample=False)[0, len(ids):]
        expected = [t for t in out.tolist()]
        if expected and expected[-1] in smollm.eos_ids:
            expected = expected[:-1]
        assert full[r.id] == expected[: len(full[r.id])] and len(full[r.id]) == len(expected), r.id


def test_shared_chunk_occupies_the_pool_once(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48)
    fmt = PromptFormat(tiny.tokenizer)
    engine = Engine(tiny, store, "lazy", cache_bytes=8 << 20, batch_size=4)
    r1 = request(store, fmt, "1", ["nile", "iron"], "Q one?")
    r2 = request(store, fmt, "2", ["iron", "bach", "nile"], "Q two?")
    used0 = engine.pool.used
    engine._place(r1)
    engine._place(r2)
    distinct = {c.chunk_id: c for c in r1.chunks + r2.chunks}
    chunk_pages = sum(engine.pool.pages_for(c.padded_length) for c in distinct.values())
    own_pages = len(r1._own_pages) + len(r2._own_pages)
    assert engine.pool.used - used0 == chunk_pages + own_pages
    nile = store.doc_chunks("nile")[0]
    pages = engine.cache.resident[nile.chunk_id].pages
    deltas = {}
    for r in (r1, r2):
        rows = r._rows[: r._n_context][r._rows[: r._n_context, PAGE] == pages[0]]
        assert len(rows) == 1
        deltas[r.id] = int(rows[0, DELTA])
    assert deltas["1"] == 0 and deltas["2"] > 0  # one physical copy, two different shifts
    assert engine.cache.resident[nile.chunk_id].pins == 2


def test_evicted_chunk_reloads_bit_exactly_and_counters_follow_lru(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    a, b, c = (store.doc_chunks(d)[0] for d in ("nile", "iron", "tokyo"))
    s = store.settings
    per_chunk = max(PagePool(1, 1, 64, 1, s.page_size, torch.float32, "cpu").pages_for(x.padded_length)
                    for x in (a, b, c))
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, 2 * per_chunk, s.page_size, torch.bfloat16,
                    torch.device("cpu"))
    cache = ChunkCache(store, pool)

    def use(info):
        entry = cache.acquire(info)
        got = pool.read_tokens(entry.pages)
        cache.release(entry)
        return got

    first = use(a)
    assert torch.equal(first.view(torch.int16), store.read_kv(a).view(torch.int16))
    trace = [b, a, c, b, a]  # room for two chunks
    results = [use(x) for x in trace]
    # by hand: a miss; b miss; a hit; c miss, evicts b; b miss, evicts a; a miss, evicts c
    assert (cache.counters.lookups, cache.counters.hits, cache.counters.misses) == (6, 1, 5)
    assert cache.counters.evictions == 3
    assert cache.counters.hits + cache.counters.misses == cache.counters.lookups
    assert torch.equal(results[-1].view(torch.int16), first.view(torch.int16))  # a, reloaded after eviction
    assert cache.counters.lookup_tokens == sum(x.length for x in [a] + trace)
    cache.close()


def test_host_tier_serves_evicted_chunks_without_the_disk(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    a, b = (store.doc_chunks(d)[0] for d in ("nile", "iron"))
    s = store.settings
    pages = max(-(-x.padded_length // s.page_size) for x in (a, b))
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, pages, s.page_size, torch.bfloat16,
                    torch.device("cpu"))
    cache = ChunkCache(store, pool, host_cache_bytes=64 << 20)
    for info in (a, b, a, b):  # room for one chunk: every use is a miss after the first two reads
        entry = cache.acquire(info)
        assert torch.equal(pool.read_tokens(entry.pages).view(torch.int16), store.read_kv(info).view(torch.int16))
        cache.release(entry)
    c = cache.counters
    assert (c.misses, c.host_hits) == (4, 2)
    assert c.read_wait_s > 0  # the two disk reads
    assert c.bytes_read == sum(store.read_kv(x).numel() * 2 for x in (a, b))  # each read from disk once
    cache.close()


def test_pinned_chunks_are_never_evicted(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48)
    a, b = (store.doc_chunks(d)[0] for d in ("nile", "iron"))
    s = store.settings
    one_chunk = a.padded_length // s.page_size  # room for a, not for a and b
    pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, one_chunk, s.page_size, torch.float32,
                    torch.device("cpu"))
    cache = ChunkCache(store, pool)
    held = cache.acquire(a)
    from lazyrag.serve.paged import OutOfPages

    with pytest.raises(OutOfPages):
        cache.acquire(b)
    assert a.chunk_id in cache.resident and held.pins == 1
    cache.close()


@pytest.mark.slow
def test_continuation_logprobs_equal_transformers(tmp_path, smollm):
    """The gold log-likelihood of the quality script: teacher forcing, in full mode equal to
    transformers over the same ids; lazy gives a different (not equal) number."""
    from transformers import AutoModelForCausalLM

    from lazyrag.models.loading import smollm2_dir

    store = make_store(tmp_path, "smollm2-135m")
    fmt = PromptFormat(smollm.tokenizer)
    cont = fmt.encode("Leipzig")
    scores = {}
    for mode in ("full", "lazy"):
        engine = Engine(smollm, store, mode, cache_bytes=64 << 20, batch_size=4)
        r = request(store, fmt, "a", ["bach", "nile"], "Where did Bach work?")
        scores[mode] = engine.continuation_logprobs([r], [cont])[0]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    ids = list(store.settings.preamble_ids) + [t for c in r.chunks for t in c.token_ids] + r.question_ids + cont
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -len(cont) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None]).mean().item()
    assert abs(scores["full"] - ref) < 1e-4
    assert abs(scores["lazy"] - ref) > 1e-4


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_padded_wide_decode_step_matches_plain_step(tmp_path, tiny, mode):
    """What a CUDA graph replays, checked on the CPU: the step padded to a larger batch (rows
    that read no pages, K/V to a spare slot) and copied into a wider page table gives the
    same logits for the real requests as the plain step."""
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48)
    fmt = PromptFormat(tiny.tokenizer)
    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=4)
    reqs = [request(store, fmt, "1", ["nile", "iron"], "Q one?"), request(store, fmt, "2", ["bach"], "Q two?")]
    for r in reqs:
        engine._place(r)
    for r, t in zip(reqs, engine._prefill(reqs).argmax(-1).tolist()):
        r.generated.append(t)
    feeds = [engine._feed(r, [r.generated[-1]]) for r in reqs]
    plain = engine._forward(feeds, lazy=mode == "lazy")
    pad_slot = engine.cache.alloc(1)[0] * engine.page_size
    host, packed = pack_step(feeds, engine.page_size, batch=5, pad_slot=pad_slot)
    wide = StepLayout(5, packed.width + 7, 5)
    buf = torch.full((wide.size,), 12345, dtype=torch.int32)  # junk past every count
    copy_step(host, packed, buf, wide)
    step = StepInputs.on(buf, wide)
    assert step.decode and step.pages.count.tolist()[2:] == [0, 0, 0]
    model = tiny.model
    hidden = model(step.tokens, step.positions,
                   PagedAttention(engine.pool, step, model.inv_freq, engine.sm_scale, mode == "lazy"))
    padded = model.logits(hidden)[: len(reqs), : engine.vocab]
    torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-4)
    engine.close()


def test_step_fields_are_16_byte_aligned_whatever_the_shape():
    """Triton specialises kernels on pointer alignment: a field whose alignment followed the
    batch size or width compiled a new kernel variant in the middle of a run."""
    for batch, width, tokens in [(1, 1, 1), (3, 5, 7), (5, 162, 5), (32, 161, 40), (7, 3, 1000)]:
        layout = StepLayout(batch, width, tokens)
        buf = torch.zeros(layout.size, dtype=torch.int32)
        step = StepInputs.on(buf, layout)
        pages = step.pages
        for t in (pages.ids, pages.delta, pages.start, pages.length, pages.count, step.cu_seqlens,
                  step.tokens, step.positions, step.slots):
            assert (t.data_ptr() - buf.data_ptr()) % 16 == 0
        assert pages.ids.stride(0) % 4 == 0 and tuple(pages.ids.shape) == (batch, width)
        assert step.slots.numel() == tokens and step.cu_seqlens.numel() == batch + 1
