"""Selective recompute: which of a request's shared chunk pages it recomputes privately.

A chunk's stored KV was computed with the chunk attending only to the preamble and itself; in
a prompt it follows other chunks, and `full` attention would have let it see them. Recomputing
a page for one request (every layer, attending to everything before it in that prompt) gives
that page the KV `full` would have, in a request-private page; the shared page stays as it is
for everyone else. The first chunk needs none: it already follows only the preamble.

Policies rank the candidate pages (every page of every chunk after the first):
  head       page 0 of each chunk, then page 1, and so on: a chunk's first tokens are the ones
             that lack an attention sink and context most (EPIC, MEPIC).
  attention  pages ranked by the attention the question's tokens pay them at one layer, in a
             first lazy pass (InfoFlow-style): recompute where the question looks.
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from lazyrag.kernels.reference import rope


class Policy(str, Enum):
    HEAD = "head"
    ATTENTION = "attention"


def pages_to_recompute(fraction: float, chunk_pages: list[int]) -> int:
    """ceil(fraction x the pages of the chunks after the first)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the recompute fraction must be in [0, 1], got {fraction}")
    return math.ceil(fraction * sum(chunk_pages[1:]) - 1e-9)


def head_order(chunk_pages: list[int]) -> list[tuple[int, int]]:
    """(chunk, page) candidates in `head` order: page 0 of chunks 1.., then page 1, ..."""
    longest = max(chunk_pages[1:], default=0)
    return [(c, p) for p in range(longest) for c in range(1, len(chunk_pages)) if p < chunk_pages[c]]


def choose(policy: Policy, fraction: float, chunk_pages: list[int],
           page_scores: list[torch.Tensor] | None = None) -> list[tuple[int, int]]:
    """The (chunk, page) pairs to recompute, in prompt order (a page attends to those before it).

    page_scores[c][p]: the attention mass of page p of chunk c (policy `attention` only)."""
    n = pages_to_recompute(fraction, chunk_pages)
    candidates = head_order(chunk_pages)
    if policy is Policy.ATTENTION:
        if page_scores is None:
            raise ValueError("the attention policy needs the question's attention per page")
        # ties (and pages the question never sees) keep head order: sort is stable
        candidates.sort(key=lambda cp: -float(page_scores[cp[0]][cp[1]]))
    return sorted(candidates[:n])


def page_attention_mass(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_delta: torch.Tensor,
                        key_pos: torch.Tensor, key_page: torch.Tensor, num_pages: int, sm_scale: float,
                        inv_freq: torch.Tensor) -> torch.Tensor:
    """Attention mass each page receives from a request's question tokens at one layer.

    q [L, H, D]: un-rotated queries at logical positions q_pos [L]. keys [N, Hkv, D] as stored
    (rotated at their stored positions), key_delta [N] = logical - stored position, key_pos [N]
    logical positions, key_page [N] the page index of each key, or -1 for a key whose mass is
    not reported (the preamble, the question itself). Returns [num_pages]: the softmax weight
    of each page, summed over heads and question tokens (fp32)."""
    G = q.shape[1] // keys.shape[1]
    k = rope(keys.float(), key_delta, inv_freq).repeat_interleave(G, 1)  # keys at logical positions
    scores = torch.einsum("lhd,nhd->hln", rope(q.float(), q_pos, inv_freq), k) * sm_scale
    scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, -1).sum((0, 1))
    mass = torch.zeros(num_pages + 1, dtype=probs.dtype, device=probs.device)
    mass.index_add_(0, key_page.long() + 1, probs)
    return mass[1:]
