"""Selective recompute: which pages are chosen (no model), and what recomputing them does to a
request's page table, the shared pages and the logits (random:tiny on the CPU, fp32)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from serve_stores import DOCS, place, request

from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Request
from lazyrag.serve.cache import Recomputed
from lazyrag.serve.paged import PAGE
from lazyrag.serve.recompute import DEFAULT_LAYER, Coverage, Policy, Recompute, choose, head_order, pages_to_recompute
from lazyrag.serve.runner import AttentionProbe, prompt_feeds
from lazyrag.store import Store


def test_page_count_is_a_fraction_of_the_pages_after_the_first_chunk():
    assert pages_to_recompute(0.0, [3, 2, 2]) == 0
    assert pages_to_recompute(0.1, [3, 2, 2]) == 1   # ceil(0.4)
    assert pages_to_recompute(0.5, [3, 2, 2]) == 2
    assert pages_to_recompute(1.0, [3, 2, 2]) == 4
    assert pages_to_recompute(1.0, [5]) == 0         # one chunk: nothing to recompute
    with pytest.raises(ValueError):
        pages_to_recompute(1.5, [1, 1])


def test_head_policy_takes_page_zero_of_every_later_chunk_first():
    assert head_order([2, 3, 1, 2]) == [(1, 0), (2, 0), (3, 0), (1, 1), (3, 1), (1, 2)]
    assert choose(Recompute(0.5), [2, 3, 1, 2]) == [(1, 0), (2, 0), (3, 0)]
    assert choose(Recompute(1.0), [2, 3, 1, 2]) == [(1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1)]


def test_attention_policy_ranks_pages_by_the_mass_the_question_pays_them():
    scores = [torch.tensor([9.0, 9.0]), torch.tensor([0.1, 0.7, 0.2]), torch.tensor([0.5])]
    assert choose(Recompute(0.5, Policy.ATTENTION), [2, 3, 1], scores) == [(1, 1), (2, 0)]
    with pytest.raises(ValueError):
        choose(Recompute(0.5, Policy.ATTENTION), [2, 3, 1])
    with pytest.raises(ValueError):
        Recompute(0.5, "nearest")


def test_a_cached_choice_counts_by_the_attention_its_pages_hold_for_this_question():
    scores = [torch.tensor([0.0, 0.0]), torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.05, 0.4, 0.1])]
    cover = Coverage([(), (1,), (1,)], scores)  # its own choice: chunk 1 page 1, chunk 2 page 1
    value = cover.value(1)
    assert value((1,)) == pytest.approx(0.6) and value((0, 1)) == pytest.approx(0.7)
    assert value((0, 2)) is None  # 0.4 < 0.6: less than its own choice there
    cover.took(1, (1, 2))  # it reads pages 1 and 2 of chunk 1: 0.3 more than its own choice
    assert cover.surplus == pytest.approx(0.3)
    assert cover.value(2)((2,)) == pytest.approx(0.1)  # 0.1 + 0.3 >= 0.4
    assert cover.value(2)((0,)) is None                # 0.05 + 0.3 < 0.4
    assert cover.to_compute(2) == (1,)  # the surplus (0.3) does not pay for page 1 (0.4)
    cover.took(1, (0, 1, 2))
    assert cover.to_compute(2) == ()    # now it does (0.4 <= 0.4)


def test_the_surplus_pays_for_the_least_attended_pages_ahead_first():
    scores = [torch.tensor([0.0]), torch.tensor([0.2, 0.5]), torch.tensor([0.1, 0.9])]
    cover = Coverage([(), (0, 1), (0, 1)], scores)
    cover.surplus = 0.35
    assert cover.to_compute(1) == (1,)     # chunk 2's 0.1 goes first, then chunk 1's 0.2 (0.3 <= 0.35)
    cover.took(1, (1,))
    assert cover.surplus == pytest.approx(0.15) and cover.to_compute(2) == (1,)


def test_without_attention_a_cached_choice_must_hold_the_own_one():
    cover = Coverage([(), (0, 2)], None)
    assert cover.value(1)((0, 1, 2)) == 0.0 and cover.value(1)((0, 1)) is None
    cover.took(1, (0, 1, 2))
    assert cover.to_compute(1) == (0, 2)


@pytest.fixture(scope="module")
def paged_store(tmp_path_factory, tiny):
    """Chunks of three 16-token pages, so a prompt has several pages per chunk."""
    tmp = tmp_path_factory.mktemp("recompute")
    corpus = tmp / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    build_index(IndexConfig(corpus=corpus, store=tmp / "s.zarr", model="random:tiny", device="cpu", dtype="fp32",
                            chunk_tokens=40, page_size=16), progress=False, loaded=tiny)
    return Store.open(tmp / "s.zarr")


def requests(store, tiny):
    fmt = PromptFormat(tiny.tokenizer)
    return [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile?"),
            request(store, fmt, "b", ["tokyo", "nile", "bach"], "Who moved to Tokyo?")]


def prefill_logits(tiny, store, mode, reqs, recompute=Recompute()):
    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    seqs = place(engine, reqs)
    if recompute.needs_scores:
        for seq, mass in zip(seqs, engine.runner.row_attention(seqs, recompute.layer)):
            engine.mode.assign_recompute(seq.request, seq.placement, engine.cache, mass)
    return engine, seqs, engine.runner.prefill(seqs)


@pytest.mark.parametrize("mode", ["lazy", "block"])
@pytest.mark.parametrize("policy", ["head", "attention"])
def test_recomputing_every_page_reproduces_full(paged_store, tiny, mode, policy):
    reqs = requests(paged_store, tiny)
    assert all(len(c.token_ids) > 16 for c in reqs[0].chunks[:2]), "chunks should span several pages"
    _, _, full = prefill_logits(tiny, paged_store, "full", reqs)
    _, _, plain = prefill_logits(tiny, paged_store, mode, reqs)
    _, _, every = prefill_logits(tiny, paged_store, mode, reqs, Recompute(1.0, policy, layer=1))
    assert (plain - full).abs().max() > 1e-3, "the test needs a gap between plain lazy and full"
    torch.testing.assert_close(every, full, atol=2e-5, rtol=1e-5)


def test_private_pages_replace_exactly_the_chosen_shared_pages(paged_store, tiny):
    reqs = requests(paged_store, tiny)
    plain_engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4)
    plain = place(plain_engine, reqs)
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=Recompute(0.5))
    seqs = place(engine, reqs)
    for s, p in zip(seqs, plain):
        rows, n = s.placement.rows, s.placement.n_context
        shared = [page for entry in s.placement.pins for page in entry.pages[: -(-entry.info.length // 16)]]
        first = n - len(shared)  # the preamble's rows come first
        chosen = [row for row, _ in s.placement.recompute]
        assert chosen == [first + i for i, (c, q) in enumerate(
            (c, q) for c, e in enumerate(s.placement.pins) for q in range(-(-e.info.length // 16)))
            if (c, q) in choose(Recompute(0.5), [-(-e.info.length // 16) for e in s.placement.pins])]
        recomputed = [page for e in s.placement.recomputed for page in e.pages]  # kept in the cache for reuse
        assert s.placement.private_pages == []
        for i, page in enumerate(shared):
            if first + i in chosen:
                assert rows[first + i, PAGE] != page and rows[first + i, PAGE] in recomputed
            else:
                assert rows[first + i, PAGE] == page
        assert sorted(rows[chosen, PAGE].tolist()) == sorted(recomputed)
        # start, delta and length of every context row are those of the plain placement
        assert (rows[:n, 1:] == p.placement.rows[: p.placement.n_context, 1:]).all()
    shared = sorted({page for s in seqs for e in s.placement.pins for page in e.pages})
    before = engine.pool.kv[:, :, shared].clone()
    engine.runner.prefill(seqs)
    assert torch.equal(engine.pool.kv[:, :, shared], before), "recompute wrote into shared pages"
    # a one-chunk request (nothing to recompute) reads the same shared pages bit-exactly
    fmt = PromptFormat(tiny.tokenizer)
    one = [Request("c", paged_store.doc_chunks("nile")[:1], fmt.question_ids("How long is the Nile?"), 4)]
    got = engine.runner.prefill(place(engine, one))
    want = plain_engine.runner.prefill(place(plain_engine, one))
    assert torch.equal(got, want)


def test_recomputed_pages_read_per_request_and_the_prompt_chunk_major(paged_store, tiny):
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=Recompute(0.5))
    for s in place(engine, requests(paged_store, tiny)):
        *recomputed, prompt = prompt_feeds(s, s.placement.prompt_ids)
        assert len(recomputed) == len(s.placement.recompute) > 0
        assert all(f.shared is None for f in recomputed)
        assert prompt.shared is not None and prompt.shared.any()


@pytest.mark.parametrize("reuse", [False, True])
def test_private_pages_are_freed_with_the_request(paged_store, tiny, reuse):
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4,
                    recompute=Recompute(0.3, reuse=reuse))
    free = engine.pool.num_free
    done = []
    engine.run(requests(paged_store, tiny), done.append)
    assert len(done) == 2
    resident = sum(-(-c.padded_length // 16) for c in {c.chunk_id: c for r in done for c in r.chunks}.values())
    recomputed = engine.cache.counters.recomputed_tokens
    assert recomputed > 0
    entries = [e for e in engine.cache._resident.values() if isinstance(e, Recomputed)]
    assert all(e.pins == 0 for e in entries) and sum(e.tokens for e in entries) == (recomputed if reuse else 0)
    kept = sum(len(e.pages) for e in entries)  # recomputed pages stay cached for reuse, unpinned
    assert engine.pool.num_free == free - resident - kept
    assert engine.cache.available_pages() == engine.pool.num_free + resident + kept


def test_attention_policy_recomputes_the_pages_the_question_attends_to_most(paged_store, tiny):
    recompute = Recompute(0.4, Policy.ATTENTION, layer=1)
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    seqs = place(engine, requests(paged_store, tiny))
    masses = engine.runner.row_attention(seqs, recompute.layer)
    for seq, mass in zip(seqs, masses):
        p = seq.placement
        # every head of every prompt token spreads a weight of 1 over the rows it sees
        heads = tiny.cfg.num_heads * len(p.prompt_ids)
        assert mass.sum().item() == pytest.approx(heads, rel=1e-5)
        assert p.recompute == [] and len(p.spare) == engine.mode.recomputed_pages(seq.request)
        engine.mode.assign_recompute(seq.request, seq.placement, engine.cache, mass)
        later = list(range(p.n_preamble + p.chunk_rows[0], p.n_context))  # rows of the chunks after the first
        top = sorted(later, key=lambda r: -mass[r].item())[: len(p.recompute)]
        assert sorted(row for row, _ in p.recompute) == sorted(top)
        assert p.spare == []


def test_ranking_layer_defaults_to_an_early_layer_that_the_model_has():
    assert Recompute(0.1, Policy.ATTENTION).ranking_layer(30) == DEFAULT_LAYER
    assert Recompute(0.1, Policy.ATTENTION).ranking_layer(2) == 1  # a shallower model: its last layer
    assert Recompute(0.1, Policy.ATTENTION, layer=5).ranking_layer(30) == 5
    with pytest.raises(ValueError, match="past the model's last layer"):
        Recompute(0.1, Policy.ATTENTION, layer=5).ranking_layer(4)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_page_ranking_is_the_same_measured_in_groups_or_feed_by_feed(paged_store, tiny, mode, monkeypatch):
    """The probe pads each group of feeds to its longest (rows and tokens): requests of different
    lengths measured together must get what each gets alone."""
    fmt = PromptFormat(tiny.tokenizer)
    reqs = requests(paged_store, tiny) + [request(paged_store, fmt, "c", ["bach"], "When?")]
    engine = Engine(tiny, paged_store, mode, cache_bytes=8 << 20, batch_size=4)
    seqs = place(engine, reqs)
    together = engine.runner.row_attention(seqs, 1)
    monkeypatch.setattr(AttentionProbe, "GROUP_BYTES", 1)  # one feed a group
    alone = engine.runner.row_attention(seqs, 1)
    own_pages = [-(-len(s.placement.prompt_ids) // 16) for s in seqs]
    assert [len(m) for m in together] == [s.placement.n_context + n for s, n in zip(seqs, own_pages)]
    for a, b, s in zip(together, alone, seqs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert a.sum().item() == pytest.approx(tiny.cfg.num_heads * len(s.placement.prompt_ids), rel=1e-5)


def recomputed_entries(engine) -> dict[str, Recomputed]:
    return {e.key: e for e in engine.cache._resident.values() if isinstance(e, Recomputed)}


def run_alone(engine, reqs):
    """Each request prefilled in a step of its own, in order; the logits of each."""
    out = []
    for r in reqs:
        (seq,) = place(engine, [r])
        out.append(engine._prefill([seq]))
        seq.placement.release(engine.cache)
    return out


def same_context(store, tiny, docs=("tokyo", "nile", "bach"), other=("tokyo", "nile", "iron")):
    fmt = PromptFormat(tiny.tokenizer)
    return [request(store, fmt, "a", list(docs), "Who moved to Tokyo?"),
            request(store, fmt, "b", list(docs), "How long is the Nile?"),
            request(store, fmt, "c", list(other), "What is iron's symbol?")]


@pytest.mark.parametrize("policy", ["head", "attention"])
def test_a_reused_page_equals_a_freshly_recomputed_one_bit_for_bit(paged_store, tiny, policy):
    recompute = Recompute(0.4, policy, layer=1)
    a, b, _ = same_context(paged_store, tiny)
    # for `attention`, b's own ranking may differ from a's: b asks a's question, so it chooses as a did
    b = Request(b.id, b.chunks, a.question_ids, b.max_new_tokens) if policy == "attention" else b
    first = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    _, reused = run_alone(first, [a, b])
    c = first.cache.counters
    assert c.recomputed_tokens > 0 and c.reused_tokens == c.recomputed_tokens  # b computed nothing itself
    fresh_engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    run_alone(fresh_engine, [b])
    kept, fresh = recomputed_entries(first), recomputed_entries(fresh_engine)
    assert kept.keys() == fresh.keys() and any(e.pages for e in fresh.values())
    for key, entry in fresh.items():
        assert kept[key].selection == entry.selection
        assert torch.equal(first.pool.kv[:, :, kept[key].pages], fresh_engine.pool.kv[:, :, entry.pages])
    (alone,) = run_alone(Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4,
                                recompute=recompute), [b])
    assert torch.equal(reused, alone)  # same choice, same pages: the same bits as when b recomputes


def recomputed_rows(p):
    """The context rows of a placement that point at recomputed pages, not at the stored chunk's."""
    stored = {page for entry in p.pins for page in entry.pages}
    return [row for row in range(p.n_preamble, p.n_context) if int(p.rows[row, PAGE]) not in stored]


def own_choice(paged_store, tiny, recompute, req):
    """The rows `req` recomputes when nothing is reused (its own choice), and the attention its
    question pays each of its rows (None for `head`)."""
    alone = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4,
                   recompute=Recompute(recompute.fraction, recompute.policy, recompute.layer, reuse=False))
    (seq,) = place(alone, [req])
    mass = alone.runner.row_attention([seq], alone.ranking_layer)[0] if recompute.needs_scores else None
    alone._choose_recompute([seq])
    return sorted(row for row, _ in seq.placement.recompute), mass


@pytest.mark.parametrize("policy", ["head", "attention"])
def test_what_a_request_reads_recomputed_covers_its_own_choice_whatever_it_reuses(paged_store, tiny, policy):
    recompute = Recompute(0.4, policy, layer=1)
    a, b, c = same_context(paged_store, tiny)  # c shares a's first two documents, then another
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    run_alone(engine, [a, b])
    for req in (b, c):
        (seq,) = place(engine, [req])
        engine._choose_recompute([seq])
        p = seq.placement
        own, mass = own_choice(paged_store, tiny, recompute, req)
        private = recomputed_rows(p)
        computed = sorted(row for row, _ in p.recompute)
        assert set(computed) <= set(own)  # it computes nothing beyond its own choice
        reused = [e for e in p.recomputed if e not in p.created]
        assert len(private) == len(computed) + sum(len(e.selection) for e in reused)
        if mass is None:
            assert set(own) <= set(private)  # reused or computed: never a shared page where it chose one
        else:  # at every chunk, what it reads recomputed so far holds what its own choice holds
            ends = np.cumsum([p.n_preamble] + p.chunk_rows)
            for end in ends[1:]:
                held = sum(mass[r].item() for r in private if r < end)
                assert held >= sum(mass[r].item() for r in own if r < end) - 1e-6
        engine._prefill([seq])
        seq.placement.release(engine.cache)


@pytest.mark.parametrize("policy", ["head", "attention"])
def test_a_prompt_whose_every_chunk_is_in_its_shared_prefix_reproduces_full(paged_store, tiny, policy):
    reqs = [replace(r, shared_prefix=len(r.chunks)) for r in requests(paged_store, tiny)]
    _, _, full = prefill_logits(tiny, paged_store, "full", reqs)
    _, _, lazy = prefill_logits(tiny, paged_store, "lazy", reqs, Recompute(0.2, policy, layer=1))
    torch.testing.assert_close(lazy, full, atol=2e-5, rtol=1e-5)


def test_a_shared_prefix_is_recomputed_whole_once_and_read_by_the_prompts_after(paged_store, tiny):
    recompute = Recompute(0.2, Policy.ATTENTION, layer=1)
    a, b, c = (replace(r, shared_prefix=2) for r in same_context(paged_store, tiny))
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    run_alone(engine, [a])
    whole = [e for e in recomputed_entries(engine).values() if len(e.selection) == len(e.pages) > 0]
    for req in (b, c):
        (seq,) = place(engine, [req])
        engine._choose_recompute([seq])
        p = seq.placement
        second = p.n_preamble + p.chunk_rows[0]
        assert p.recomputed[0] in whole and p.recomputed[0].selection == tuple(range(p.chunk_rows[1]))
        assert all(row >= second + p.chunk_rows[1] for row, _ in p.recompute)  # its own choice after the prefix
        own, mass = own_choice(paged_store, tiny, recompute, req)
        assert sum(mass[r].item() for r in recomputed_rows(p)) >= sum(mass[r].item() for r in own) - 1e-6
        engine._prefill([seq])
        seq.placement.release(engine.cache)


def test_a_context_whose_earlier_chunk_was_evicted_is_found_again(paged_store, tiny):
    recompute = Recompute(0.4, "head")
    a, b, _ = same_context(paged_store, tiny)
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    run_alone(engine, [a])
    (leading, *later) = (e for e in recomputed_entries(engine).values())
    engine.cache.evict(leading.key)  # the pages of its second chunk go; those after it stay
    (seq,) = place(engine, [b])
    p = seq.placement
    assert later and all(e in p.recomputed for e in later)  # read again, not recomputed twice
    assert [e.selection for e in p.created] == [leading.selection]


def test_requests_of_one_step_share_what_the_first_recomputes(paged_store, tiny):
    recompute = Recompute(0.4, "head")
    a, b, _ = same_context(paged_store, tiny)
    together = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    seqs = place(together, [a, b])
    assert seqs[0].placement.recompute and not seqs[1].placement.recompute
    logits = together._prefill(seqs)
    apart = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4,
                   recompute=Recompute(0.4, "head", reuse=False))
    want = apart.runner.prefill(place(apart, [a, b]))
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert together.cache.counters.reused_tokens == together.cache.counters.recomputed_tokens > 0


def test_pages_a_failed_step_was_to_recompute_are_never_reused(paged_store, tiny, monkeypatch):
    recompute = Recompute(0.4, "head")
    a, b, _ = same_context(paged_store, tiny)
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    (seq,) = place(engine, [a])
    assert seq.placement.created
    free = engine.cache.available_pages()

    def boom(*args, **kw):
        raise RuntimeError("step failed")

    monkeypatch.setattr(engine.runner, "prefill", boom)
    with pytest.raises(RuntimeError):
        engine._prefill([seq])
    seq.placement.release(engine.cache)
    assert recomputed_entries(engine) == {}
    assert engine.cache.available_pages() >= free
    monkeypatch.undo()
    (again,) = place(engine, [b])
    assert again.placement.recompute  # computed afresh, not read from pages that hold nothing




def test_a_request_takes_another_questions_choice_where_its_attention_is_covered(paged_store, tiny):
    """After a whole shared chunk (more than its own choice there), b reads a's choice in a later
    chunk though it would have picked another page, and computes nothing: what it reads holds
    at least its own choice's attention."""
    recompute = Recompute(0.4, Policy.ATTENTION, layer=1)
    a, b, _ = (replace(r, shared_prefix=2) for r in same_context(paged_store, tiny))
    engine = Engine(tiny, paged_store, "lazy", cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    run_alone(engine, [a])
    (seq,) = place(engine, [b])
    engine._choose_recompute([seq])
    p = seq.placement
    own, mass = own_choice(paged_store, tiny, recompute, b)
    private = recomputed_rows(p)
    assert p.recompute == [] and not set(own) <= set(private)
    assert sum(mass[r].item() for r in private) >= sum(mass[r].item() for r in own)
    c = engine.cache.counters
    assert c.reused_tokens > 0
