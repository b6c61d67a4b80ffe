"""Choosing each next token from the logits: greedy, or temperature with top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


class Sampler:
    def __init__(self, sampling: Sampling, device: torch.device):
        self.sampling = sampling
        self.generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id per row of logits [batch, vocab]."""
        t = self.sampling.temperature
        if t <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / t, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.sampling.top_p  # keep the smallest set reaching top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
