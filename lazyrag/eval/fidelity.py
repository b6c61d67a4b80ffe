"""How far a mode's answers are from `full` attention on the same prompt token ids.

Every measure is taken along `full`'s own greedy answer (teacher forcing): both modes see
the same prompt and the same answer prefix at each step, so a difference is the mode's,
not a divergence that an earlier different token caused.

- KL(full || mode) per answer token, in nats: how much probability the mode moves.
- top-1 agreement: the share of answer tokens where the mode's most likely token is full's.
- gold log-likelihood: mean log-probability per token of a gold answer (higher is better).
- identical answers and token F1 between the two greedy answers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from lazyrag.eval.scoring import agreement

FORCED_TOKENS = 16  # tokens of full's answer that the teacher-forced measures follow


def token_kl(full_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(full || mode) at each position of [T, vocab] logits, in float64: [T]."""
    ref = torch.log_softmax(full_logits.double(), -1)
    cur = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - cur)).sum(-1).clamp_min(0.0)


def top1_matches(full_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Whether the two argmaxes agree at each position: bool [T]."""
    return full_logits.argmax(-1) == logits.argmax(-1)


def mean_logprob(logits: torch.Tensor, targets: list[int]) -> float:
    """Mean log-probability per token of `targets` under [len(targets), vocab] logits."""
    lp = torch.log_softmax(logits.double(), -1)
    return lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).mean().item()


@dataclass
class Fidelity:
    """Fidelity of one mode to full over a set of queries (reported as `audit` in the run log)."""

    queries: int = 0
    identical: float = 0.0       # share of greedy answers equal to full's (SQuAD-normalised)
    f1_to_full: float = 0.0      # mean token F1 between the two answers
    kl_mean: float = 0.0         # mean KL(full || mode) over every forced token of every query
    top1_agreement: float = 0.0  # share of forced tokens whose argmax is full's
    tokens: int = 0              # forced tokens measured

    def to_json(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def fidelity(full_answers: list[str], answers: list[str], full_logits: list[torch.Tensor],
             logits: list[torch.Tensor]) -> Fidelity:
    """Pool the measures over queries; the logits of query i are [forced tokens, vocab] for
    both modes, teacher-forced along full's answer (an empty answer contributes no tokens)."""
    n = len(answers)
    if not (n == len(full_answers) == len(full_logits) == len(logits)):
        raise ValueError("fidelity needs one answer and one logits tensor per query in both modes")
    if n == 0:
        return Fidelity()
    kl = [token_kl(f, m) for f, m in zip(full_logits, logits) if len(f)]
    top1 = [top1_matches(f, m) for f, m in zip(full_logits, logits) if len(f)]
    tokens = sum(len(k) for k in kl)
    same = agreement(dict(enumerate(answers)), dict(enumerate(full_answers)))
    return Fidelity(
        queries=n,
        identical=same["identical"],
        f1_to_full=same["f1_to_full"],
        kl_mean=float(torch.cat(kl).mean()) if tokens else 0.0,
        top1_agreement=float(torch.cat(top1).float().mean()) if tokens else 1.0,
        tokens=tokens,
    )
