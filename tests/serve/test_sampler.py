"""The sampler: greedy is argmax; sampling is seeded per request, so a request's tokens depend on
its logits, the seed, its id and the step, never on the other rows of its batch."""

import zlib

import pytest
import torch

from lazyrag.serve.sampler import Sampler, Sampling

VOCAB = 50


def logits_for(request_id: str, step: int) -> torch.Tensor:
    """The same logits for a request's step wherever it runs."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{request_id}/{step}".encode()))
    return torch.randn(VOCAB, generator=g)


def sample_batch(sampler, batch: list[tuple[str, int]]) -> list[int]:
    logits = torch.stack([logits_for(r, s) for r, s in batch])
    return sampler.sample(logits, [r for r, _ in batch], [s for _, s in batch]).tolist()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_request_samples_the_same_tokens_alone_and_inside_any_batch(top_p):
    sampler = Sampler(Sampling(temperature=1.0, top_p=top_p, seed=3))
    steps = range(12)
    alone = [sample_batch(sampler, [("q7", s)])[0] for s in steps]
    with_others = [sample_batch(sampler, [("a", s), ("q7", s), ("b", s + 5)])[1] for s in steps]
    other_place = [sample_batch(sampler, [("q7", s), ("z", 0), ("y", 1), ("x", 2)])[0] for s in steps]
    assert alone == with_others == other_place
    assert len(set(alone)) > 1  # the steps draw different noise


def test_the_seed_and_the_request_id_change_the_draws():
    base = [sample_batch(Sampler(Sampling(temperature=1.0, seed=0)), [("q", s)])[0] for s in range(20)]
    other_seed = [sample_batch(Sampler(Sampling(temperature=1.0, seed=1)), [("q", s)])[0] for s in range(20)]
    assert base != other_seed
    # two requests with the same logits at the same step draw independently
    logits = logits_for("q", 0).expand(200, VOCAB)
    ids = [f"r{i}" for i in range(200)]
    assert len(set(Sampler(Sampling(temperature=1.0)).sample(logits, ids, [0] * 200).tolist())) > 5


def test_greedy_is_the_argmax_whatever_the_seed():
    logits = torch.randn(6, VOCAB)
    for seed in (0, 9):
        got = Sampler(Sampling(temperature=0.0, seed=seed)).sample(logits, list("abcdef"), [0] * 6)
        assert got.tolist() == logits.argmax(-1).tolist()


def test_draws_follow_the_softmax_at_the_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    t = 0.5
    logits = (probs.log() * t).expand(6000, 3)  # softmax(logits / t) == probs
    ids = [f"q{i}" for i in range(6000)]
    tokens = Sampler(Sampling(temperature=t, seed=5)).sample(logits, ids, [0] * 6000)
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_p_keeps_only_the_smallest_set_reaching_it():
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0]).log_softmax(-1).expand(2000, 4)  # p ~ .70 .26 .03 .01
    ids = [f"q{i}" for i in range(2000)]
    tokens = Sampler(Sampling(temperature=1.0, top_p=0.9)).sample(logits, ids, [0] * 2000)
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.gpu
def test_the_gpu_draws_the_same_tokens_as_the_cpu():
    sampler = Sampler(Sampling(temperature=0.7, top_p=0.95, seed=11))
    logits = torch.randn(64, 32000)
    ids, steps = [f"q{i}" for i in range(64)], list(range(64))
    assert sampler.sample(logits, ids, steps).tolist() == sampler.sample(logits.cuda(), ids, steps).tolist()
