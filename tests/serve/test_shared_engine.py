"""Chunk-major attention in the engine: lazy mode reads the pages its requests share once per
step for all of them, with the same logits and the same greedy answers as reading them per
request, over an fp32 store and over an fp8 one."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from serve_stores import make_store, place, request

from lazyrag import kernels
from lazyrag.kernels import PlanLayout
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine
from lazyrag.serve.paged import Feed, PagedAttention, StepInputs, StepLayout, copy_step, pack_step, page_rows
from lazyrag.serve.recompute import Recompute
from lazyrag.serve.runner import prompt_feeds
from lazyrag.serve.sharing import ChunkMajor, cut_feeds, graph_layout


@pytest.fixture(scope="module", params=["fp32", "fp8"])
def stored(request, tmp_path_factory):
    """(model, store): random:tiny and a store of its KV, in fp32 or in fp8 (e4m3 pages with their scales)."""
    loaded = request.getfixturevalue("tiny" if request.param == "fp32" else "tiny_fp8")
    return loaded, make_store(tmp_path_factory.mktemp("shared"), "random:tiny", chunk_tokens=24, dtype=request.param)


def requests(store, loaded):
    """Chunks shared at different offsets, one read twice by one request, one read by one request."""
    fmt = PromptFormat(loaded.tokenizer)
    return [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?"),
            request(store, fmt, "b", ["iron", "nile", "bach"], "Who was born in Eisenach?"),
            request(store, fmt, "c", ["tokyo"], "When?"),
            request(store, fmt, "d", ["iron", "iron"], "Which symbol?")]


@pytest.fixture
def shared_calls(monkeypatch):
    """How often the engine ran the chunk-major kernels."""
    calls = {"prefill": 0, "decode": 0}
    for step in calls:
        kernel = getattr(kernels, f"shared_{step}")

        def counted(*args, _kernel=kernel, _step=step, **kw):
            calls[_step] += 1
            return _kernel(*args, **kw)
        monkeypatch.setattr(kernels, f"shared_{step}", counted)
    return calls


@pytest.mark.parametrize("options", [dict(), dict(ape=(0.8, 1.5))], ids=["plain", "ape"])
def test_lazy_answers_are_the_same_with_and_without_chunk_major(stored, shared_calls, options):
    loaded, store = stored
    answers = {}
    for shared in (True, False):
        engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, stop_at_eos=False,
                        shared_attention=shared, **options)
        got = answers[shared] = {}
        engine.run(requests(store, loaded), lambda seq, got=got: got.__setitem__(seq.id, seq.generated))
        engine.close()
        if shared:
            assert shared_calls["prefill"] and shared_calls["decode"]
            calls = dict(shared_calls)
    assert shared_calls == calls  # none without it
    assert answers[True] == answers[False] and len(answers[True]) == 4


def test_teacher_forced_logits_are_the_same_with_and_without_chunk_major(stored, shared_calls):
    loaded, store = stored
    reqs = requests(store, loaded)
    continuations = [[5, 9, 11], [7], [3, 3], [12, 40]]
    logits = [Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, shared_attention=shared,
                     recompute=Recompute(0.3)).teacher_forced_logits(reqs, continuations) for shared in (True, False)]
    assert shared_calls["prefill"]
    # within fp32 rounding, not bit-equal: which requests share a step (so the shapes of the
    # model's matmuls) depends on when their chunk reads finish
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_teacher_forced_logits_keep_request_order_when_admitted_out_of_order(stored, monkeypatch):
    """The scheduler may admit a request ahead of one still reading: each request still gets its
    own continuation's logits, in the order asked."""
    from lazyrag.serve import engine as engine_module

    class Reversed(engine_module.Scheduler):
        def _admit(self, now):
            if not getattr(self, "turned", False):
                self.waiting.reverse()  # the last request first, as if the others' chunks were still being read
                self.turned = True
            return super()._admit(now)

    loaded, store = stored
    reqs = requests(store, loaded)
    continuations = [[5, 9, 11], [7], [3, 3], [12, 40]]
    expected = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=2).teacher_forced_logits(reqs, continuations)
    monkeypatch.setattr(engine_module, "Scheduler", Reversed)
    got = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=2).teacher_forced_logits(reqs, continuations)
    assert [g.shape[0] for g in got] == [3, 1, 2, 2]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunk_major_kernels_in_the_engine_interp(stored, shared_calls):
    """The Triton kernels (under the interpreter) in a lazy run: prefill and decode steps of two
    requests that share both their chunks give the reference path's answers."""
    loaded, store = stored
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton is compiled, and the GPU tests cover the engine")
    fmt = PromptFormat(loaded.tokenizer)
    reqs = [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?", max_new_tokens=2),
            request(store, fmt, "b", ["iron", "nile"], "Who?", max_new_tokens=2)]
    answers = []
    for backend, shared in (("reference", False), ("triton", True)):
        with kernels.cpu_backend(backend):
            engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, stop_at_eos=False,
                            shared_attention=shared)
            got = {}
            engine.run(reqs, lambda seq, got=got: got.__setitem__(seq.id, seq.generated))
            answers.append(got)
    assert shared_calls["prefill"] and shared_calls["decode"]
    assert answers[0] == answers[1]


@pytest.mark.parametrize("fits", [True, False])
def test_decode_graph_step_matches_the_plain_step(stored, fits):
    """What a CUDA graph replays with chunk-major attention, checked on the CPU: the remainder
    feeds padded into a wider table, with the batch's plan in a static plan of fixed capacity
    (or, where it does not fit, the whole feeds with the static plan emptied), give the plain
    step's logits."""
    loaded, store = stored
    engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, shared_attention=False)
    seqs = place(engine, requests(store, loaded)[:3])
    for seq, token in zip(seqs, engine.runner.prefill(seqs).argmax(-1).tolist()):
        seq.generated.append(token)
    feeds = [seq.feed([seq.generated[-1]]) for seq in seqs]
    plain = engine.runner.forward(feeds)
    chunk_major = ChunkMajor(4, 2, 64, torch.device("cpu"))
    width = max(len(f.rows) for f in feeds) + 7
    layout = graph_layout(5, width) if fits else PlanLayout(works=1, uses=1, items=1, pages=1, tokens=5, rows=1)
    static = chunk_major.static_plan(layout)
    static.buffer.fill_(7)  # the previous batch's plan
    packed_feeds = chunk_major.graph_feeds(feeds, static)
    assert (packed_feeds is feeds) != fits and (int(static.head[0]) > 0) == fits
    host, packed = pack_step(packed_feeds, engine.pool.page_size, batch=5,
                             pad_slot=engine.cache.alloc(1)[0] * engine.pool.page_size)
    wide = StepLayout(5, width, 5)
    buf = torch.full((wide.size,), 12345, dtype=torch.int32)
    copy_step(host, packed, buf, wide)
    step = StepInputs.on(buf, wide)
    step.shared = static
    model = loaded.model
    hidden = model(step.tokens, step.positions, PagedAttention(engine.pool, step, model.inv_freq,
                                                                engine.runner.sm_scale, True))
    torch.testing.assert_close(model.logits(hidden)[:3, : engine.runner.vocab], plain, rtol=1e-5, atol=1e-5)
    engine.close()


def test_recompute_gives_the_same_answers_with_and_without_chunk_major(stored):
    """A recomputed page's feed reads per request beside the chunk-major prompt feeds of the same
    step: the step's grouping leaves those feeds out and must still point each shared use at its
    own request."""
    loaded, store = stored
    answers = {}
    for shared in (True, False):
        engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, stop_at_eos=False,
                        shared_attention=shared, recompute=Recompute(0.5))
        got = answers[shared] = {}
        engine.run(requests(store, loaded), lambda seq, got=got: got.__setitem__(seq.id, seq.generated))
        engine.close()
    assert answers[True] == answers[False]


def test_whole_chunks_of_a_shared_prefix_are_read_chunk_major_with_the_same_answers(stored):
    """Pages recomputed for a whole chunk of a shared prefix are read by every request after the
    same context: labelled as a stored chunk's are, they are read once per step for all of them."""
    loaded, store = stored
    fmt = PromptFormat(loaded.tokenizer)
    reqs = [replace(request(store, fmt, r, ["nile", "iron", "bach"], q), shared_prefix=2)
            for r, q in (("a", "How long is the Nile?"), ("b", "Who was born in Eisenach?"), ("c", "Which symbol?"))]
    placed = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=Recompute(0.3, "head"))
    labelled = []
    for s in place(placed, reqs):  # placed only: the first recomputes the prefix's second chunk, the others read it
        p = s.placement
        labelled.append(set(p.shared[p.n_preamble + p.chunk_rows[0]: p.n_preamble + sum(p.chunk_rows[:2])].tolist()))
    placed.close()
    answers = {}
    for shared in (True, False):
        engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, stop_at_eos=False,
                        shared_attention=shared, recompute=Recompute(0.3, "head"))
        got = answers[shared] = {}
        engine.run(reqs, lambda seq, got=got: got.__setitem__(seq.id, seq.generated))
        engine.close()
    assert len(set.union(*labelled)) == 1 and 0 not in labelled[0]  # one label, the same in every request
    assert answers[True] == answers[False] and len(answers[True]) == 3


def test_feeds_without_shared_rows_stay_whole_and_out_of_the_grouping(stored):
    loaded, store = stored
    engine = Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=Recompute(0.5))
    seqs = place(engine, requests(store, loaded)[:2])
    feeds = [f for s in seqs for f in prompt_feeds(s, s.placement.prompt_ids)]
    prompts = [b for b, f in enumerate(feeds) if f.shared is not None]
    assert len(prompts) == 2 and len(feeds) > 2  # the rest are recomputed pages
    cut = cut_feeds(feeds)
    assert sorted(set(cut.shared.use_request.tolist())) == prompts  # the prompts' places in the step
    for b, (f, r) in enumerate(zip(feeds, cut.rest)):
        if b not in prompts:
            assert r is f
        else:
            assert r.shared is None and len(r.rows) < len(f.rows)


def test_a_shared_row_that_does_not_precede_the_feeds_tokens_is_refused():
    """Chunk-major kernels apply no causal mask to shared rows: a labelled row must be a context
    row whose last key sits before the feed's first token."""
    chunk = page_rows([3, 4], 0, 20, 5, 16)  # keys at 5..24
    own = page_rows([9], 0, 4, 25, 16)

    def feed(rows, n_context, shared, own_start=25, first=0):
        return Feed(rows, n_context, own_start, first, [1, 2], shared=np.array(shared, np.int32))

    good = feed(np.concatenate([chunk, own]), 2, [7, 7, 0])
    assert cut_feeds([good]).shared.groups == 1
    with pytest.raises(ValueError, match="context rows before"):  # an own row labelled
        cut_feeds([good, feed(np.concatenate([chunk, own]), 2, [7, 7, 8])])
    with pytest.raises(ValueError, match="context rows before"):  # its keys reach the feed's first token
        cut_feeds([good, feed(np.concatenate([chunk, own]), 2, [7, 7, 0], own_start=20)])
