"""Decode steps replayed from CUDA graphs.

A decode step launches about 30 kernels per layer, a thousand per step for an 8B model,
and at batch 32 Python took longer to launch them than the GPU took to run them (the
GPU was busy at most 40% of a run: docs/benchmarks.md). So the step of each batch-size
bucket is captured once, when the engine starts, and replayed: one launch per step.

Everything a step varies lives in one static int32 buffer laid out by `StepLayout`,
which the host refreshes before each replay. Its page table has a fixed width,
`max_pages`: the kernels read each request's page count when they run and split its
pages evenly over their programs, so one graph serves requests of any length up to that
width (wider steps run eagerly). A batch is padded up to its bucket with one-token rows
that read no pages and write their K/V to a page kept for the purpose. In lazy mode with
chunk-major attention each graph also has a static plan of fixed capacity
(lazyrag/serve/sharing.py), rewritten only when the batch changes; its kernel's programs past
the plan's work exit at once.

Prefill steps vary in length and in their attention's launch plan, so they are graphed in
pieces (`PrefillGraphs`): for each bucket of step lengths, the work between one layer's attention
and the next (residual, norms, MLP, projections, the keys' rotation, writing K and V into the
pool) is one graph, and attention runs eagerly between replays. Launched op by op, an 8B
model's prefill step cost the host about 65 ms whatever its length, longer than the GPU took
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from lazyrag import kernels
from lazyrag.kernels.rope import RopeTable, rope_table
from lazyrag.serve.paged import Feed, PagedAttention, PagePool, StepInputs, StepLayout, copy_step, pack_step
from lazyrag.serve.sharing import ChunkMajor, graph_layout


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16, ending at max_batch: a batch pads to at most 2x (small) or +15."""
    steps = [1, 2, 4, 8, *range(16, max_batch, 16)]
    return [b for b in steps if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model, pool: PagePool, inv_freq: torch.Tensor, sm_scale: float, lazy: bool,
                 max_batch: int, max_pages: int, pad_slot: int, ape: tuple[float, float] = (1.0, 1.0),
                 chunk_major: ChunkMajor | None = None):
        self.pool, self.max_pages, self.pad_slot, self.ape = pool, max_pages, pad_slot, ape
        self.chunk_major = chunk_major
        self._plans: dict[int, kernels.SharedPlan] = {}
        self.device = pool.kv.device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, StepLayout, torch.Tensor]] = {}
        mempool = torch.cuda.graph_pool_handle()
        # largest first: the smaller graphs then fit in the memory the largest one left free
        for bs in reversed(batch_buckets(max_batch)):
            self._graphs[bs] = self._capture(model, inv_freq, sm_scale, lazy, bs, mempool)

    def _capture(self, model, inv_freq, sm_scale, lazy, bs, mempool):
        layout = StepLayout(bs, self.max_pages, bs)
        buf = torch.zeros(layout.size, dtype=torch.int32, device=self.device)
        views = layout.views(buf)
        views.cu.copy_(torch.arange(bs + 1, dtype=torch.int32))
        views.slots.fill_(self.pad_slot)  # every count is 0: a padding step, safe to run
        step = StepInputs.on(buf, layout)
        if self.chunk_major:
            step.shared = self._plans[bs] = self.chunk_major.static_plan(graph_layout(bs, self.max_pages))

        def forward():
            return model.logits(model(step.tokens, step.positions, PagedAttention(self.pool, step, inv_freq,
                                                                                   sm_scale, lazy, self.ape)))

        # run once outside the capture: Triton compiles, cuBLAS picks its kernels
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call made meanwhile by another thread (a chunk reader, a finaliser)
        # must not invalidate this capture; in the default global mode one did, now and then
        with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
            logits = forward()
        return graph, buf, layout, logits

    def run(self, feeds: list[Feed], tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of each feed's token, or None where no graph fits (the caller runs eagerly).
        tokens: the feeds' token ids on the device, in place of their own. The logits live in the
        graph's output: the next replay overwrites them."""
        bs = min((b for b in self._graphs if b >= len(feeds)), default=None)
        if bs is None:
            return None
        if self.chunk_major:
            feeds = self.chunk_major.graph_feeds(feeds, self._plans[bs])
        host, packed = pack_step(feeds, self.pool.page_size, batch=bs, pad_slot=self.pad_slot, pin=True)
        if packed.width > self.max_pages:
            return None
        graph, buf, layout, logits = self._graphs[bs]
        copy_step(host.to(self.device, non_blocking=True), packed, buf, layout)
        if tokens is not None:
            layout.views(buf).tokens[: len(tokens)].copy_(tokens)
        graph.replay()
        return logits[: len(feeds)]


def prefill_buckets(most: int) -> list[int]:
    """Step lengths a prefill graph is captured for: 256, then every 512 up to `most`. A step pads
    to the next (at most 2x for short steps, a quarter past 2,048)."""
    return [b for b in (256, *range(512, most, 512)) if b < most] + [most]


class PrefillGraphs:
    """The layers of steps of up to `most` tokens replayed from CUDA graphs, one bucket of
    lengths at a time, attention run eagerly between them (see the module docstring).

    Every bucket works in one set of static buffers of the largest bucket's length (tokens, key
    positions, K/V slots, the residual stream x, q and the attention output o): a bucket's
    graphs read and write their first rows. Graph i takes x and o of layer i - 1 (graph 0: the
    tokens' embeddings) to x and q of layer i, and writes layer i's K and V into the pool; the
    last one takes x to the final norm. Rows past a step's tokens hold what earlier steps left
    there (finite, and no real row reads them: rows are independent outside attention, which
    sees only the step's own rows), except their slots: those are reset to `pad_slot`, a page
    kept for the purpose, so that their K and V land nowhere that is read."""

    def __init__(self, model, pool: PagePool, most: int, pad_slot: int):
        cfg, dev = model.cfg, model.inv_freq.device
        dtype = model.embed.weight.dtype
        self.model, self.pool, self.pad_slot, self.buckets = model, pool, pad_slot, prefill_buckets(most)
        n = self.buckets[-1]
        self.tokens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.key_positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self.slots = torch.full((n,), pad_slot, dtype=torch.int32, device=dev)
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.o = torch.zeros_like(self.q)
        self.keys_at = RopeTable(torch.zeros(n, 1, cfg.head_dim, device=dev), torch.zeros(n, 1, cfg.head_dim, device=dev))
        mempool = torch.cuda.graph_pool_handle()
        # largest first: the smaller buckets' graphs fit in the memory the largest one's left free
        self._graphs = {b: self._capture(b, mempool) for b in reversed(self.buckets)}

    def _piece(self, i: int, t: int) -> None:
        """Graph i's work on the first t rows."""
        m, layers = self.model, self.model.layers
        if i == 0:
            x = m.embed(self.tokens[:t])
            table = rope_table(self.key_positions[:t], m.inv_freq)
            self.keys_at.cos[:t].copy_(table.cos)
            self.keys_at.sin[:t].copy_(table.sin)
        else:
            x = layers[i - 1].after_attention(self.x[:t], self.o[:t])
        if i == len(layers):
            self.x[:t].copy_(m.norm(x))
            return
        q, k, v = layers[i].attention_inputs(x, RopeTable(self.keys_at.cos[:t], self.keys_at.sin[:t]), m.rope_scale)
        self.pool.write_slots(i, self.slots[:t], k, v)
        self.x[:t].copy_(x)
        self.q[:t].copy_(q)

    def _capture(self, t: int, mempool) -> list[torch.cuda.CUDAGraph]:
        device = self.x.device
        side = torch.cuda.Stream(device)  # run once outside the capture: cuBLAS picks its kernels
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in range(len(self.model.layers) + 1):
                self._piece(i, t)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs = []
        for i in range(len(self.model.layers) + 1):
            graph = torch.cuda.CUDAGraph()
            # thread_local: a reader thread's CUDA calls meanwhile must not invalidate the capture
            with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                self._piece(i, t)
            graphs.append(graph)
        return graphs

    def bucket(self, tokens: int) -> int | None:
        """The captured length a step of this many tokens pads to; None past the largest."""
        return next((b for b in self.buckets if b >= tokens), None)

    def run(self, step: StepInputs, attention: PagedAttention) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of a step of T tokens (a view of the static
        buffer: the next step overwrites it), or None past the largest bucket (the caller runs
        the step eagerly)."""
        t = len(step.tokens)
        bucket = self.bucket(t)
        if bucket is None:
            return None
        self.tokens[:t].copy_(step.tokens)
        self.key_positions[:t].copy_(step.key_positions)
        self.slots[:t].copy_(step.slots)
        self.slots[t:bucket].fill_(self.pad_slot)
        graphs = self._graphs[bucket]
        q, o = self.q[:t], self.o[:t]
        graphs[0].replay()
        for i, graph in enumerate(graphs[1:]):
            o.copy_(attention.attend(i, q))
            graph.replay()
        return self.x[:t]
