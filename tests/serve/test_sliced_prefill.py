"""Prefill in slices (lazyrag/serve/runner.py `sliced`): a long prompt fed a few tokens per step,
each slice attending to everything before it, gives the logits, the K/V and the attention probe
of the prompt fed whole, in every mode and with recomputed pages (random:tiny on the CPU, fp32)."""

import json

import pytest
import torch
from serve_stores import DOCS, place, request

from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute
from lazyrag.serve.paged import Feed, page_rows
from lazyrag.serve.runner import sliced
from lazyrag.store import Store


def test_slices_cover_every_token_in_order_and_no_step_is_over_the_limit():
    rows = page_rows([0, 1, 2], 0, 40, 0, 16)
    feeds = [Feed(rows, 0, 0, 0, list(range(7))), Feed(rows, 0, 0, 3, list(range(100, 112)))]
    steps = list(sliced(feeds, 5))
    assert all(sum(len(p.tokens) for _, p in step) <= 5 for step in steps)
    pieces = [(i, p) for step in steps for i, p in step]
    for i, f in enumerate(feeds):
        mine = [p for j, p in pieces if j == i]
        assert sum((p.tokens for p in mine), []) == f.tokens
        assert [p.first for p in mine] == [f.first + sum(len(q.tokens) for q in mine[:k]) for k in range(len(mine))]
    assert all(len({i for i, _ in step}) == len(step) for step in steps)  # one piece of a feed per step


@pytest.fixture(scope="module")
def paged_store(tmp_path_factory, tiny):
    """Chunks of three 16-token pages, so prompts span several pages."""
    tmp = tmp_path_factory.mktemp("sliced")
    corpus = tmp / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    build_index(IndexConfig(corpus=corpus, store=tmp / "s.zarr", model="random:tiny", device="cpu", dtype="fp32",
                            chunk_tokens=40, page_size=16), progress=False, loaded=tiny)
    return Store.open(tmp / "s.zarr")


def run(tiny, store, mode, recompute, prefill_tokens):
    """Prefill logits, the probe's mass and the next decode step's logits of two requests."""
    fmt = PromptFormat(tiny.tokenizer)
    reqs = [request(store, fmt, "a", ["nile", "iron"], "How long is the Nile? " * 3),
            request(store, fmt, "b", ["tokyo", "nile", "bach"], "Who moved to Tokyo, and when did he go there?")]
    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=4, recompute=recompute)
    engine.runner.prefill_tokens = prefill_tokens
    seqs = place(engine, reqs)
    mass = engine.runner.row_attention(seqs, 1)
    if recompute.needs_scores:
        for seq, m in zip(seqs, mass):
            engine.mode.assign_recompute(seq.request, seq.placement, engine.cache, m)
    prefill = engine.runner.prefill(seqs)
    for s, t in zip(seqs, prefill.argmax(-1).tolist()):
        s.generated.append(t)
    decode = engine.runner.decode(seqs)
    engine.close()
    return prefill, mass, decode


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
@pytest.mark.parametrize("recompute", [Recompute(), Recompute(0.5, "attention", layer=1)], ids=["plain", "recompute"])
def test_a_prompt_fed_in_slices_gives_the_logits_of_the_prompt_fed_whole(paged_store, tiny, mode, recompute):
    if mode == "full" and recompute.fraction:
        pytest.skip("full recomputes everything already")
    whole = run(tiny, paged_store, mode, recompute, 1 << 20)
    for size in (5, 16):  # slices inside a page, and of a page
        in_slices = run(tiny, paged_store, mode, recompute, size)
        for want, got in zip(whole, in_slices):
            want, got = (torch.cat(list(x)) if isinstance(x, list) else x for x in (want, got))
            assert want.shape == got.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_on_a_gpu_the_kernels_give_the_same_logits_in_slices(paged_store, mode):
    from lazyrag.models import load_model

    cuda = load_model("random:tiny", device="cuda", dtype="fp32")
    recompute = Recompute() if mode == "full" else Recompute(0.5, "attention", layer=1)
    whole = run(cuda, paged_store, mode, recompute, 1 << 20)
    for size in (5, 16):
        in_slices = run(cuda, paged_store, mode, recompute, size)
        for want, got in zip(whole, in_slices):
            want, got = (torch.cat(list(x)) if isinstance(x, list) else x for x in (want, got))
            torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=1e-3, atol=1e-3)


def test_the_probe_measures_a_prompt_too_long_for_its_memory_a_piece_of_its_tokens_at_a_time(paged_store, tiny,
                                                                                             monkeypatch):
    from lazyrag.serve.runner import AttentionProbe

    recompute = Recompute(0.5, "attention", layer=1)
    whole = run(tiny, paged_store, "lazy", recompute, 1 << 20)
    monkeypatch.setattr(AttentionProbe, "GROUP_BYTES", 64 << 10)  # a few of the prompt's tokens at a time
    pieces = []
    group_mass = AttentionProbe._group_mass
    monkeypatch.setattr(AttentionProbe, "_group_mass", lambda self, *a: pieces.append(a[3]) or group_mass(self, *a))
    in_pieces = run(tiny, paged_store, "lazy", recompute, 1 << 20)
    assert len(pieces) > 4 and all(len(cu) == 2 for cu in pieces)  # one feed, a piece of its tokens, at a time
    for want, got in zip(whole[1], in_pieces[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
