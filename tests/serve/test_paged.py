"""Step packing over the paged pool: what a CUDA graph replays, checked on the CPU, and the
alignment of every packed field; page rows and the pool's free list."""

import numpy as np
import pytest
import torch
from serve_stores import make_store, place, request

from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine
from lazyrag.serve.paged import (DELTA, LENGTH, PAGE, START, Feed, OutOfPages, PagedAttention, PagePool, StepInputs,
                                 StepLayout, copy_step, pack_step, page_rows)


def test_page_rows_cover_a_run_of_tokens_page_by_page():
    rows = page_rows([7, 3, 9], start=5, tokens=10, delta=-2, page_size=4)
    assert rows[:, PAGE].tolist() == [7, 3, 9]
    assert rows[:, START].tolist() == [5, 9, 13]
    assert rows[:, LENGTH].tolist() == [4, 4, 2]
    assert rows[:, DELTA].tolist() == [-2, -2, -2]
    assert page_rows([1, 2], 0, 0, 0, 4).shape == (0, 4)


def test_pool_hands_out_free_pages_and_takes_them_back():
    pool = PagePool(2, 1, 4, 3, 4, torch.float32, torch.device("cpu"))
    assert pool.alloc(2) == [0, 1] and (pool.used, pool.num_free, pool.peak_used) == (2, 1, 2)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free of 3"):
        pool.alloc(2)
    pool.release([0, 1])
    assert (pool.used, pool.peak_used) == (0, 2) and pool.alloc(1) == [0]
    kv = torch.arange(2 * 4 * 2 * 2 * 1 * 4, dtype=torch.float32).view(8, 2, 2, 1, 4)  # [tokens, layers, k/v, ...]
    pool.write_tokens([2, 0], kv)
    assert torch.equal(pool.read_tokens([2, 0]), kv)


@pytest.mark.parametrize("mode,ape", [("lazy", (1.0, 1.0)), ("block", (1.0, 1.0)), ("full", (1.0, 1.0)),
                                      ("lazy", (0.8, 1.6)), ("block", (1.3, 0.7))])
def test_padded_wide_decode_step_matches_plain_step(tmp_path, tiny, mode, ape):
    """What a CUDA graph replays, checked on the CPU: the step padded to a larger batch (rows
    that read no pages, K/V to a spare slot) and copied into a wider page table gives the
    same logits for the real requests as the plain step, APE's rows included."""
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48)
    fmt = PromptFormat(tiny.tokenizer)
    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=4, ape=ape)
    page_size = engine.pool.page_size
    reqs = place(engine, [request(store, fmt, "1", ["nile", "iron"], "Q one?"),
                          request(store, fmt, "2", ["bach"], "Q two?")])
    for r, t in zip(reqs, engine.runner.prefill(reqs).argmax(-1).tolist()):
        r.generated.append(t)
    feeds = [r.feed([r.generated[-1]]) for r in reqs]
    plain = engine.runner.forward(feeds)
    pad_slot = engine.cache.alloc(1)[0] * page_size
    host, packed = pack_step(feeds, page_size, batch=5, pad_slot=pad_slot)
    wide = StepLayout(5, packed.width + 7, 5)
    buf = torch.full((wide.size,), 12345, dtype=torch.int32)  # junk past every count
    copy_step(host, packed, buf, wide)
    step = StepInputs.on(buf, wide)
    assert step.decode and step.pages.count.tolist()[2:] == [0, 0, 0]
    ape_rows = list(zip(step.pages.ape_lo.tolist(), step.pages.ape_hi.tolist()))
    assert ape_rows == [f.ape_rows for f in feeds] + [(0, 0)] * 3
    model = tiny.model
    hidden = model(step.tokens, step.positions,
                   PagedAttention(engine.pool, step, model.inv_freq, engine.runner.sm_scale,
                                  engine.mode.rotate_queries, ape))
    padded = model.logits(hidden)[: len(reqs), : engine.runner.vocab]
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
        for t in (pages.ids, pages.delta, pages.start, pages.length, pages.count, pages.ape_lo, pages.ape_hi,
                  step.cu_seqlens, step.tokens, step.positions, step.key_positions, step.slots):
            assert (t.data_ptr() - buf.data_ptr()) % 16 == 0
        assert pages.ids.stride(0) % 4 == 0 and tuple(pages.ids.shape) == (batch, width)
        assert step.slots.numel() == tokens and step.cu_seqlens.numel() == batch + 1


def _pack_one_by_one(feeds, page_size, B, pad_slot):
    """pack_step's fields, written feed by feed: the reference for its whole-array packing."""
    counts = [f.n_context + -(-(f.first + len(f.tokens)) // page_size) for f in feeds]
    T = sum(len(f.tokens) for f in feeds) + (B - len(feeds))
    table = np.zeros((4, B, max(counts)), np.int64)
    tokens, positions, key_positions = np.zeros(T, np.int64), np.zeros(T, np.int64), np.zeros(T, np.int64)
    slots = np.full(T, pad_slot, np.int64)
    cu = np.arange(B + 1) + (T - B)
    cu[0] = t = 0
    for b, (f, n) in enumerate(zip(feeds, counts)):
        table[:, b, :n] = f.rows[:n].T
        for j, tok in enumerate(f.tokens):
            own = f.first + j
            row = f.rows[f.n_context + own // page_size]
            tokens[t], positions[t] = tok, f.own_start + own
            key_positions[t] = positions[t] - row[DELTA]
            slots[t] = row[PAGE] * page_size + own % page_size
            t += 1
        cu[b + 1] = t
    return table, counts, cu, tokens, positions, key_positions, slots


@pytest.mark.parametrize("seed", range(4))
def test_packed_step_matches_packing_feed_by_feed(seed):
    rng = np.random.default_rng(seed)
    page_size, feeds = 4, []
    for _ in range(rng.integers(1, 7)):
        n_context = int(rng.integers(0, 5))
        first, k = int(rng.integers(0, 6)), int(rng.integers(1, 9))
        own_pages = -(-(first + k) // page_size) + int(rng.integers(0, 2))
        rows = rng.integers(0, 50, size=(n_context + own_pages, 4)).astype(np.int32)
        feeds.append(Feed(rows, n_context, int(rng.integers(0, 99)), first, rng.integers(0, 300, k).tolist(),
                          ape_rows=(1, 2)))
    B = len(feeds) + int(rng.integers(0, 3))
    host, layout = pack_step(feeds, page_size, batch=B, pad_slot=77)
    v = layout.views(host.numpy())
    table, counts, cu, tokens, positions, key_positions, slots = _pack_one_by_one(feeds, page_size, B, 77)
    assert np.array_equal(v.table, table)
    assert v.count.tolist() == counts + [0] * (B - len(feeds))
    assert v.ape_lo.tolist()[: len(feeds)] == [1] * len(feeds)
    for got, want in zip((v.cu, v.tokens, v.positions, v.key_positions, v.slots),
                         (cu, tokens, positions, key_positions, slots)):
        assert np.array_equal(got, want)
