"""Choosing each next token from the logits: greedy, or temperature with top-p.

Sampling is seeded per request: a row's token is the Gumbel-max of its logits, with noise
hashed from (seed, request id, step, token id). So a request's answer depends only on its
logits, never on which batch, engine or machine it ran in, and `answer --data-parallel N`
samples the same answers for every N.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # spreads consecutive counters (token ids) over the 32 bits


class Sampler:
    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def sample(self, logits: torch.Tensor, request_ids: list[str], steps: list[int]) -> torch.Tensor:
        """One token id per row of logits [batch, vocab]; row i belongs to request `request_ids[i]`
        and picks its answer's token number `steps[i]` (0 for the first)."""
        t = self.sampling.temperature
        if t <= 0:
            return logits.argmax(-1)
        scores = logits.float() / t
        if self.sampling.top_p < 1.0:
            scores = _nucleus(scores, self.sampling.top_p)
        ids_steps = torch.tensor([[self.request_key(r) for r in request_ids], steps], dtype=torch.int64,
                                 device=logits.device)
        keys = _mix32(ids_steps[0] ^ _mix32(ids_steps[1]))
        return (scores + gumbel_noise(keys, scores.shape[-1])).argmax(-1)

    def request_key(self, request_id: str) -> int:
        """A request's 32-bit key: a stable hash (not Python's salted one) of the seed and its id."""
        digest = hashlib.blake2b(f"{self.sampling.seed}\0{request_id}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The scores with tokens outside the smallest set whose probability reaches top_p set to -inf."""
    probs = torch.softmax(scores, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p > top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [rows, vocab], float32, a pure function of each row's key and the
    token id: a counter hash in int64 integer ops, on the keys' device."""
    counters = torch.arange(vocab, dtype=torch.int64, device=keys.device) * _GOLDEN32
    bits = _mix32(_mix32((keys[:, None] + counters[None, :]) & _MASK32))
    u = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits, strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (lowbias32) of int64 values in [0, 2^32). Products keep
    their low 32 bits, which wrapping int64 multiplication leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)

