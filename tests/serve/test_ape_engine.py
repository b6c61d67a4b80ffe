"""APE's attention temperature and scale through the engine: off by default, the same in lazy
and block (block's chunk pages are private copies, still chunk pages), refused in full; each
request's step carries its chunk rows as its APE rows."""

import pytest
import torch
from serve_stores import make_store, place, request, step_logits

from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine

APE = (0.8, 1.6)


@pytest.fixture
def setup(tmp_path, tiny):
    store = make_store(tmp_path, "random:tiny", chunk_tokens=32)
    fmt = PromptFormat(tiny.tokenizer)

    def reqs():
        return [request(store, fmt, "1", ["nile", "iron"], "Q one?"),
                request(store, fmt, "2", ["bach", "tokyo", "nile"], "Q two?")]

    return tiny, store, reqs


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_unit_temperature_and_scale_are_bit_identical_to_no_ape(setup, mode):
    loaded, store, reqs = setup
    plain = step_logits(loaded, store, mode, reqs())
    unit = step_logits(loaded, store, mode, reqs(), ape=(1.0, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(plain, unit))


def test_lazy_and_block_agree_under_ape_and_differ_from_plain(setup):
    loaded, store, reqs = setup
    lazy = step_logits(loaded, store, "lazy", reqs(), ape=APE)
    block = step_logits(loaded, store, "block", reqs(), ape=APE)
    plain = step_logits(loaded, store, "lazy", reqs())
    for got, want, off in zip(lazy, block, plain):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert (got - off).abs().max() > 1e-2 * off.abs().max()


def test_full_and_bad_values_are_refused(setup):
    loaded, store, _ = setup
    with pytest.raises(ValueError, match="lazy and block only"):
        Engine(loaded, store, "full", cache_bytes=8 << 20, batch_size=2, ape=APE)
    for bad in ((0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="positive finite"):
            Engine(loaded, store, "lazy", cache_bytes=8 << 20, batch_size=2, ape=bad)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_a_sequence_feeds_its_chunk_rows_as_its_ape_rows(setup, mode):
    loaded, store, reqs = setup
    engine = Engine(loaded, store, mode, cache_bytes=8 << 20, batch_size=4)
    for seq in place(engine, reqs()):
        lo, hi = seq.feed(seq.placement.prompt_ids).ape_rows
        preamble_pages = engine.pool.pages_for(len(store.settings.preamble_ids))
        chunk_pages = sum(engine.pool.pages_for(c.length) for c in seq.chunks)
        assert (lo, hi) == (preamble_pages, preamble_pages + chunk_pages) == (seq.placement.n_preamble,
                                                                             seq.placement.n_context)
    engine.close()
