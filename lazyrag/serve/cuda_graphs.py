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
"""

from __future__ import annotations

import torch

from lazyrag import kernels
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
