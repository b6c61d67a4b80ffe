"""The model over the page pool: eager steps, prefill, decode and teacher-forced scoring.

On a GPU the decode step is replayed from a CUDA graph, and every other step of up to
PREFILL_GRAPH_TOKENS tokens replays its layers from graphs with attention run between them
(lazyrag/serve/cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import torch

from lazyrag import kernels
from lazyrag.models import LoadedModel
from lazyrag.serve import faults
from lazyrag.serve.cuda_graphs import DecodeGraphs, PrefillGraphs
from lazyrag.serve.modes import ChunkCopy
from lazyrag.serve.paged import DELTA, LENGTH, PAGE, START, Feed, PagedAttention, PagePool, StepInputs
from lazyrag.serve.request import Sequence
from lazyrag.serve.sharing import ChunkMajor


def recompute_feed(rows: np.ndarray, row: int, tokens: list[int]) -> Feed:
    """Compute a chunk page's tokens into the page `rows[row]` names, attending to the rows
    before it: at their logical positions (start + delta), keys rotated at the stored ones.
    It reads its pages per request, never chunk-major: a page's 64 queries would each write a
    partial row per chunk run, and on the H200 paper workload that cost more than the shared
    reads saved (lazy with recompute 16.1 req/s chunk-major, 21.9 per request)."""
    return Feed(rows[: row + 1], row, int(rows[row, START] + rows[row, DELTA]), 0, tokens)


def prompt_feeds(seq: Sequence, tokens: list[int]) -> list[Feed]:
    """A placed sequence's prefill: its recomputed chunk pages, then `tokens`. They go in one
    step: every layer writes the step's K/V before it attends, so a recomputed page sees the
    pages recomputed before it, and the prompt sees them all."""
    p = seq.placement
    return [recompute_feed(p.rows, row, chunk) for row, chunk in p.recompute] + [seq.feed(tokens)]


# Most tokens one prefill step feeds, so that a step's working memory (activations, and on the
# CPU the reference attention's scores against every key) is bounded whatever the prompt's
# length: a longer prompt is fed in slices, each attending to everything before it. The CPU's is
# small (its scores are [heads, slice, keys] fp32); a GPU's fits any batch of usual prompts whole.
PREFILL_TOKENS = {"cpu": 512, "cuda": 16384}
# Longest step whose layers replay from graphs (0: none). Longer steps keep the GPU busy for
# longer than the host takes to launch them.
PREFILL_GRAPH_TOKENS = 4096


def sliced(feeds: list[Feed], most: int) -> Iterator[list[tuple[int, Feed]]]:
    """The feeds cut into steps of at most `most` tokens, in order: each step lists (index of the
    feed, the piece of it). A feed is cut only between steps, so everything a piece attends to
    is in the pool or in its own step, whose every layer writes its K/V before attending."""
    step, room = [], most
    for i, f in enumerate(feeds):
        if not f.tokens:
            continue  # nothing to feed (and no last token to take logits of)
        if len(f.tokens) <= room:  # whole: no copy (a prefill with recompute has thousands of feeds)
            step.append((i, f))
            room -= len(f.tokens)
            if room == 0:
                yield step
                step, room = [], most
            continue
        at = 0
        while at < len(f.tokens):
            n = min(room, len(f.tokens) - at)
            step.append((i, dataclasses.replace(f, first=f.first + at, tokens=f.tokens[at: at + n])))
            at, room = at + n, room - n
            if room == 0:
                yield step
                step, room = [], most
    if step:
        yield step


class AttentionProbe:
    """Attention that measures, at one layer, the weight each feed's tokens give each of its page
    rows (in plain PyTorch, from the pool), then stops the forward pass. Feeds are measured a
    group at a time, padded to the group's longest, in a few large operations: one small
    operation per feed left the GPU waiting on the host's launches."""

    class Done(Exception):
        pass

    GROUP_BYTES = 2 << 30  # fp32 working memory of one group (keys, scores)

    def __init__(self, attention: PagedAttention, feeds: list[Feed], layer: int):
        self.attention, self.feeds, self.layer = attention, feeds, layer
        self.mass: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.attention(layer, q, k, v)  # writes this step's K/V into the pool
        if layer < self.layer:
            return out
        ps = self.attention.pool.page_size
        counts = [f.rows_read(ps) for f in self.feeds]
        cu = np.cumsum([0] + [len(f.tokens) for f in self.feeds])  # from the host: no wait on the GPU
        width, most = max(counts, default=1), int(np.diff(cu).max(initial=1))
        size = max(1, self.GROUP_BYTES // self._bytes(width, most, q, k))
        if size == 1 and self._bytes(width, most, q, k) > self.GROUP_BYTES:
            self._mass_in_pieces(layer, q, k, counts, cu)
            raise self.Done
        for lo in range(0, len(self.feeds), size):
            hi = min(lo + size, len(self.feeds))
            mass = self._group_mass(layer, q, counts[lo:hi], cu[lo: hi + 1], self.feeds[lo:hi], width, most)
            self.mass += [m[:n] for m, n in zip(mass, counts[lo:hi])]  # on the device: one transfer for all
        raise self.Done

    def _bytes(self, rows: int, tokens: int, q: torch.Tensor, k: torch.Tensor) -> int:
        """fp32 working memory of one feed's mass: its keys, and scores and weights per token."""
        return rows * self.attention.pool.page_size * 4 * (3 * k.shape[1] * k.shape[2] + 2 * q.shape[1] * tokens)

    def _mass_in_pieces(self, layer: int, q: torch.Tensor, k: torch.Tensor, counts: list[int], cu: np.ndarray) -> None:
        """A feed at a time, its tokens a piece at a time: a long prompt's scores over all its
        rows would not fit at once, and the mass is a sum over tokens."""
        for i, (feed, rows) in enumerate(zip(self.feeds, counts)):
            per_token = self._bytes(rows, 1, q, k) - self._bytes(rows, 0, q, k)
            piece = max(1, (self.GROUP_BYTES - self._bytes(rows, 0, q, k)) // per_token)
            mass = torch.zeros(rows, device=q.device)
            for lo in range(int(cu[i]), int(cu[i + 1]), piece):
                hi = min(lo + piece, int(cu[i + 1]))
                mass += self._group_mass(layer, q, [rows], np.array([lo, hi]), [feed], rows, hi - lo)[0]
            self.mass.append(mass)

    def _group_mass(self, layer: int, q: torch.Tensor, counts: list[int], cu: np.ndarray, feeds: list[Feed],
                    width: int, most: int) -> torch.Tensor:
        """[feeds, width] attention mass per page row of each feed (rows past its count: 0)."""
        at, dev = self.attention, q.device
        ps, n = at.pool.page_size, len(feeds)
        rows = np.zeros((n, width, 4), np.int32)  # padding rows: page 0, no valid tokens
        for i, (f, c) in enumerate(zip(feeds, counts)):
            rows[i, :c] = f.rows[:c]
        token = cu[:-1, None] + np.arange(most)  # each feed's tokens in the step, -1 past its own
        token[token >= cu[1:, None]] = -1
        packed = torch.from_numpy(np.concatenate([rows.reshape(-1), token.reshape(-1)]).astype(np.int64))
        if q.is_cuda:
            packed = packed.pin_memory()
        packed = packed.to(dev, non_blocking=True)
        rows_d, token_d = packed[: rows.size].view(n, width, 4), packed[rows.size:].view(n, most)
        j = torch.arange(ps, device=dev)
        keys = at.pool.keys(layer, rows_d[..., PAGE].flatten())  # [n * width, ps, Hkv, D] fp32
        delta = rows_d[..., DELTA, None].expand(-1, -1, ps).flatten()
        keys = kernels.rope(keys.flatten(0, 1), delta, at.inv_freq)  # moved to their logical positions
        kv_heads, dim = keys.shape[1], keys.shape[2]
        keys = keys.view(n, width * ps, kv_heads, dim)
        key_pos = (rows_d[..., START, None] + rows_d[..., DELTA, None] + j).view(n, -1)
        key_ok = (j < rows_d[..., LENGTH, None]).view(n, -1)
        real = token_d >= 0
        t = token_d.clamp(min=0)
        qpos = at.step.positions[t]
        qb = kernels.rope(q[t.flatten()].float(), qpos.flatten(), at.inv_freq)
        qb = qb.view(n, most, kv_heads, q.shape[1] // kv_heads, dim)  # a KV head's query heads together
        scores = torch.einsum("btkgd,bnkd->bkgtn", qb, keys) * at.sm_scale
        hidden = ~key_ok[:, None, :] | (key_pos[:, None, :] > qpos[:, :, None])  # [n, most, keys]
        weights = torch.softmax(scores.masked_fill(hidden[:, None, None], float("-inf")), -1)
        weights = weights * real[:, None, None, :, None]  # a padding token's row is all masked: NaN -> 0
        return weights.nan_to_num_(0.0).sum((1, 2, 3)).view(n, width, ps).sum(-1)


class Runner:
    """ape: APE's (temperature, scale) on the attention from each request's own tokens to its
    chunk pages (Feed.ape_rows); (1, 1) is off. chunk_major: lazy steps read each chunk page once
    for every request using it (lazyrag/serve/sharing.py); None: per request."""

    def __init__(self, loaded: LoadedModel, pool: PagePool, rotate_queries: bool,
                 ape: tuple[float, float] = (1.0, 1.0), chunk_major: ChunkMajor | None = None):
        self.model, self.pool, self.rotate_queries, self.ape = loaded.model, pool, rotate_queries, ape
        self.device = loaded.device
        self.max_positions = loaded.cfg.max_position_embeddings
        self.sm_scale = loaded.cfg.head_dim ** -0.5
        self.vocab = len(loaded.tokenizer)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.chunk_major = chunk_major
        self.prefill_tokens = PREFILL_TOKENS["cuda" if self.device.type == "cuda" else "cpu"]

    def capture_graphs(self, batch_size: int, pad_page: int) -> None:
        """Capture the decode step of each batch-size bucket; padding rows write to `pad_page`."""
        max_pages = min(self.pool.num_pages, self.pool.pages_for(self.max_positions))
        self.graphs = DecodeGraphs(self.model, self.pool, self.model.inv_freq, self.sm_scale, self.rotate_queries,
                                   batch_size, max_pages, pad_page * self.pool.page_size, self.ape, self.chunk_major)
        if PREFILL_GRAPH_TOKENS:
            self.prefill_graphs = PrefillGraphs(self.model, self.pool, min(PREFILL_GRAPH_TOKENS, self.prefill_tokens),
                                                pad_page * self.pool.page_size)

    def forward(self, feeds: list[Feed], select: torch.Tensor | None = None,
                rotate_queries: bool | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One eager step. Returns the logits of each feed's last token, or of the packed token
        indices in `select`. rotate_queries: the mode's unless given. tokens: the step's token
        ids on the device, in place of the feeds' own."""
        rotate = self.rotate_queries if rotate_queries is None else rotate_queries
        if rotate and self.chunk_major:
            step = self.chunk_major.upload(feeds, self.pool.page_size)
        else:
            step = StepInputs.upload(feeds, self.pool.page_size, self.device)
        if tokens is not None:
            step.tokens[: len(tokens)].copy_(tokens)
        attention = PagedAttention(self.pool, step, self.model.inv_freq, self.sm_scale, rotate, self.ape)
        hidden = None
        if self.prefill_graphs is not None:
            hidden = self.prefill_graphs.run(step, attention)
        if hidden is None:
            hidden = self.model(step.tokens, step.positions, attention, key_positions=step.key_positions)
        if select is not None and self.device.type == "cuda":  # a pageable copy would wait for the GPU
            select = select.pin_memory()
        rows = step.cu_seqlens[1:] - 1 if select is None else select.to(self.device, non_blocking=True)
        return self.model.logits(hidden[rows])[:, : self.vocab]

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed the placed sequences' prompts (recomputed pages first); the logits of each one's
        last token."""
        faults.injected([s.id for s in seqs], "prefill")  # the test hook: a no-op unless its variable is set
        feeds, last = [], []
        for s in seqs:
            feeds += prompt_feeds(s, s.placement.prompt_ids)
            last.append(len(feeds) - 1)  # the prompt's feed: its last token predicts the answer's first
        logits = self.sliced_forward(feeds, last)
        for s in seqs:
            s.fed += len(s.placement.prompt_ids)
        return logits

    def sliced_forward(self, feeds: list[Feed], wanted: list[int]) -> torch.Tensor:
        """The feeds in steps of at most prefill_tokens tokens (`sliced`); the logits of the last
        token of each feed in `wanted` (ascending), in that order."""
        wanted_set, out = set(wanted), []
        for step in sliced(feeds, self.prefill_tokens):
            ends = np.cumsum([len(piece.tokens) for _, piece in step]) - 1
            select = [int(end) for (i, piece), end in zip(step, ends)
                      if i in wanted_set and piece.first + len(piece.tokens) == feeds[i].first + len(feeds[i].tokens)]
            logits = self.forward([piece for _, piece in step], select=torch.tensor(select, dtype=torch.long))
            if select:
                out.append(logits)
        return torch.cat(out)

    def decode(self, seqs: list[Sequence], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Feed each sequence's last generated token, or the ids `tokens` (on the device, one a
        sequence: sampled, not yet read back); the logits of the next."""
        faults.injected([s.id for s in seqs], "decode")  # the test hook: a no-op unless its variable is set
        feeds = [s.feed([s.generated[-1] if tokens is None else 0]) for s in seqs]
        logits = self.graphs.run(feeds, tokens) if self.graphs else None
        if logits is None:
            logits = self.forward(feeds, tokens=tokens)
        else:
            logits = logits[:, : self.vocab]  # the graph computes the model's padded vocabulary
        self._advance(seqs, feeds)
        return logits

    @staticmethod
    def _advance(seqs: list[Sequence], feeds: list[Feed]) -> None:
        for s, f in zip(seqs, feeds):
            s.fed += len(f.tokens)

    def teacher_forced_logits(self, seqs: list[Sequence], continuations: list[list[int]]) -> list[torch.Tensor]:
        """Per placed sequence, the float32 CPU logits [len(continuation), vocab] that predict
        each continuation token after its prompt and the continuation tokens before it."""
        feeds, select = [], []
        for s, cont in zip(seqs, continuations):
            feeds += prompt_feeds(s, s.placement.prompt_ids + cont)
            end = sum(len(f.tokens) for f in feeds)
            # the logits at position j predict token j + 1: those before each continuation token
            select.append(torch.arange(end - len(cont) - 1, end - 1))
        logits = self.forward(feeds, select=torch.cat(select))
        return list(logits.float().cpu().split([len(c) for c in continuations]))

    def row_attention(self, seqs: list[Sequence], layer: int) -> list[torch.Tensor]:
        """Per placed sequence, the attention its prompt's tokens pay each of its page rows at
        `layer` (softmax weight summed over heads and tokens; fp32 [rows]). Runs the prompt
        through layers 0..layer only; its K/V there are written again by the real prefill."""
        feeds = [s.feed(s.placement.prompt_ids) for s in seqs]
        mass = [torch.zeros(f.rows_read(self.pool.page_size), device=self.device) for f in feeds]
        for step in sliced(feeds, self.prefill_tokens):  # the mass is a sum over tokens: slices add up
            for (i, _), m in zip(step, self._probe([piece for _, piece in step], layer)):
                mass[i][: len(m)] += m
        return list(torch.cat(mass).cpu().split([len(m) for m in mass])) if mass else []

    def _probe(self, feeds: list[Feed], layer: int) -> list[torch.Tensor]:
        """One step of the feeds through layers 0..layer; each feed's attention mass per row read."""
        step = StepInputs.upload(feeds, self.pool.page_size, self.device)
        probe = AttentionProbe(PagedAttention(self.pool, step, self.model.inv_freq, self.sm_scale,
                                              self.rotate_queries, self.ape), feeds, layer)
        try:
            self.model(step.tokens, step.positions, probe, key_positions=step.key_positions)
        except AttentionProbe.Done:
            pass
        return probe.mass

    def rotate_copy(self, copies: list[ChunkCopy]) -> None:
        """Every layer's pages of every chunk in one fused launch (fp8 keys requantised in the same pool)."""
        src = torch.tensor([p for c in copies for p in c.src], dtype=torch.int32)
        dst = torch.tensor([p for c in copies for p in c.dst], dtype=torch.int32)
        delta = torch.tensor([c.delta for c in copies for _ in c.src], dtype=torch.int32)
        layer_base = (torch.arange(self.pool.num_layers, dtype=torch.int32) * self.pool.num_pages)[:, None]
        k_pages, v_pages = self.pool.all_layers()
        k_scale, v_scale = self.pool.all_layer_scales()
        kernels.rotate_copy(k_pages, v_pages, (layer_base + src).flatten().to(self.device),
                            (layer_base + dst).flatten().to(self.device),
                            delta.repeat(self.pool.num_layers).to(self.device), self.model.inv_freq,
                            k_scale=k_scale, v_scale=v_scale)
