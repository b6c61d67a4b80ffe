"""The model over the page pool: eager steps, prefill, decode and teacher-forced scoring.

On a GPU the decode step is replayed from a CUDA graph (lazyrag/serve/cuda_graphs.py);
prefill runs eagerly, its lengths vary too much to capture.
"""

from __future__ import annotations

import torch

from lazyrag import kernels
from lazyrag.models import LoadedModel
from lazyrag.serve.cuda_graphs import DecodeGraphs
from lazyrag.serve.modes import ChunkCopy
from lazyrag.serve.paged import Feed, PagedAttention, PagePool, StepInputs
from lazyrag.serve.request import Sequence


class Runner:
    def __init__(self, loaded: LoadedModel, pool: PagePool, rotate_queries: bool):
        self.model, self.pool, self.rotate_queries = loaded.model, pool, rotate_queries
        self.device = loaded.device
        self.max_positions = loaded.cfg.max_position_embeddings
        self.sm_scale = loaded.cfg.head_dim ** -0.5
        self.vocab = len(loaded.tokenizer)
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, batch_size: int, pad_page: int) -> None:
        """Capture the decode step of each batch-size bucket; padding rows write to `pad_page`."""
        max_pages = min(self.pool.num_pages, self.pool.pages_for(self.max_positions))
        self.graphs = DecodeGraphs(self.model, self.pool, self.model.inv_freq, self.sm_scale, self.rotate_queries,
                                   batch_size, max_pages, pad_page * self.pool.page_size)

    def forward(self, feeds: list[Feed], select: torch.Tensor | None = None,
                rotate_queries: bool | None = None) -> torch.Tensor:
        """One eager step. Returns the logits of each feed's last token, or of the packed token
        indices in `select`. rotate_queries: the mode's unless given."""
        rotate = self.rotate_queries if rotate_queries is None else rotate_queries
        step = StepInputs.upload(feeds, self.pool.page_size, self.device)
        attention = PagedAttention(self.pool, step, self.model.inv_freq, self.sm_scale, rotate)
        hidden = self.model(step.tokens, step.positions, attention)
        rows = step.cu_seqlens[1:] - 1 if select is None else select.to(self.device)
        return self.model.logits(hidden[rows])[:, : self.vocab]

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed the placed sequences' prompts; the logits of each one's last token."""
        feeds = [s.feed(s.placement.prompt_ids) for s in seqs]
        logits = self.forward(feeds)
        self._advance(seqs, feeds)
        return logits

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's last generated token; the logits of the next."""
        feeds = [s.feed([s.generated[-1]]) for s in seqs]
        logits = self.graphs.run(feeds) if self.graphs else None
        if logits is None:
            logits = self.forward(feeds)
        else:
            logits = logits[:, : self.vocab]  # the graph computes the model's padded vocabulary
        self._advance(seqs, feeds)
        return logits

    @staticmethod
    def _advance(seqs: list[Sequence], feeds: list[Feed]) -> None:
        for s, f in zip(seqs, feeds):
            s.fed += len(f.tokens)

    def continuation_logprobs(self, seqs: list[Sequence], continuations: list[list[int]]) -> list[float]:
        """Mean log-probability per token of each continuation after its placed sequence's
        prompt, by teacher forcing (more sensitive than accuracy for a small model)."""
        ids = [s.placement.prompt_ids + cont for s, cont in zip(seqs, continuations)]
        starts = torch.tensor([0] + [len(t) for t in ids]).cumsum(0)
        # the logits at position j predict token j + 1: those before each continuation token
        select = torch.cat([torch.arange(s + len(t) - len(c) - 1, s + len(t) - 1)
                            for s, t, c in zip(starts.tolist(), ids, continuations)])
        logits = self.forward([s.feed(t) for s, t in zip(seqs, ids)], select=select)
        target = torch.tensor([t for c in continuations for t in c], device=logits.device)
        lp = torch.log_softmax(logits.float(), -1).gather(1, target[:, None])[:, 0].cpu()
        return [part.mean().item() for part in lp.split([len(c) for c in continuations])]

    def rotate_copy(self, copies: list[ChunkCopy]) -> None:
        """Every layer's pages of every chunk in one fused launch."""
        src = torch.tensor([p for c in copies for p in c.src], dtype=torch.int32)
        dst = torch.tensor([p for c in copies for p in c.dst], dtype=torch.int32)
        delta = torch.tensor([c.delta for c in copies for _ in c.src], dtype=torch.int32)
        layer_base = (torch.arange(self.pool.num_layers, dtype=torch.int32) * self.pool.num_pages)[:, None]
        k_pages, v_pages = self.pool.all_layers()
        kernels.rotate_copy(k_pages, v_pages, (layer_base + src).flatten().to(self.device),
                            (layer_base + dst).flatten().to(self.device),
                            delta.repeat(self.pool.num_layers).to(self.device), self.model.inv_freq)
