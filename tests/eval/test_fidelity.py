import math

import pytest
import torch

from lazyrag.eval.fidelity import fidelity, mean_logprob, token_kl, top1_matches


def test_kl_is_zero_on_identical_logits_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 11, generator=g)
    assert torch.allclose(token_kl(a, a), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    b = a + torch.randn(5, 11, generator=g)
    kl = token_kl(a, b)
    assert (kl > 0).all()
    # against the textbook sum p log(p / q) on one row
    p, q = torch.softmax(a[2].double(), -1), torch.softmax(b[2].double(), -1)
    assert kl[2].item() == pytest.approx((p * (p / q).log()).sum().item(), rel=1e-9)
    # a shift of every logit of one row by a constant changes nothing
    assert torch.allclose(token_kl(a, a + 3.0), torch.zeros(5, dtype=torch.float64), atol=1e-9)


def test_top1_and_mean_logprob():
    full = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    mode = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0]])
    assert top1_matches(full, mode).tolist() == [False, True]
    lp = mean_logprob(full, [1, 0])
    expected = (torch.log_softmax(full.double(), -1)[0, 1] + torch.log_softmax(full.double(), -1)[1, 0]) / 2
    assert lp == pytest.approx(expected.item())


def test_fidelity_pools_tokens_over_queries():
    g = torch.Generator().manual_seed(1)
    f1, f2 = torch.randn(3, 7, generator=g), torch.randn(1, 7, generator=g)
    m1, m2 = f1.clone(), f2 + 5 * torch.randn(1, 7, generator=g)
    res = fidelity(["Paris", "blue whale"], ["Paris.", "a whale"], [f1, f2], [m1, m2])
    assert res.queries == 2 and res.tokens == 4
    assert res.identical == 0.5  # "Paris." normalises to "paris"
    expected_kl = torch.cat([token_kl(f1, m1), token_kl(f2, m2)]).mean().item()
    assert res.kl_mean == pytest.approx(expected_kl)
    assert res.top1_agreement == pytest.approx((3 + int(f2.argmax() == m2.argmax())) / 4)
    assert 0 < res.f1_to_full < 1
    assert set(res.to_json()) == {"queries", "identical", "f1_to_full", "kl_mean", "top1_agreement", "tokens"}


def test_fidelity_rejects_mismatched_lengths_and_handles_empty():
    with pytest.raises(ValueError):
        fidelity(["a"], [], [torch.zeros(1, 2)], [])
    assert fidelity([], [], [], []).queries == 0
    assert math.isclose(fidelity(["x"], ["x"], [torch.zeros(0, 3)], [torch.zeros(0, 3)]).top1_agreement, 1.0)
