"""Chunk-major steps in lazy mode: a step's feeds cut into the runs of stored pages (chunks, the
preamble), read once per step for every request using them by the chunk-major kernels, and each
request's remainder (its own tokens, its private pages), read per request.

The cut and the kernels' launch plan are built on the host when the batch changes: a decode
batch keeps them from step to step (a placement's rows do not change once it has run), and a
CUDA graph's static plan takes them in one copy. A step whose plan exceeds a graph's capacity
runs unshared in the same graph (an empty plan: the per-request path over the whole tables).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from lazyrag import kernels
from lazyrag.serve.paged import DELTA, LENGTH, START, Feed, StepInputs


@dataclass
class SharedFeeds:
    """A batch's feeds cut in two: `rest`, each feed with the rows its request reads alone, and
    `shared`, the runs of stored pages they read, grouped by page sequence (kernels.group_shared)."""

    rest: list[Feed]
    shared: kernels.SharedPages
    plan: kernels.SharedPlan | None = None  # an eager decode step's, kept for the batch

    def feeds(self, feeds: list[Feed]) -> list[Feed]:
        """The remainder feeds of this step's tokens (same batch, same order)."""
        return [replace(r, first=f.first, tokens=f.tokens) for r, f in zip(self.rest, feeds)]


def cut_feeds(feeds: list[Feed]) -> SharedFeeds | None:
    """The shared runs of the feeds' labelled rows (Feed.shared) and each feed's remainder;
    None where no feed has labelled rows. Labelled rows must be context rows whose keys
    all precede the feed's tokens: the chunk-major kernels apply no causal mask to them.
    Feeds without labelled rows (a recomputed page's) are their own remainder, and are left
    out of the grouping: a step with recompute has some ten of them for each labelled feed."""
    labelled = [b for b, f in enumerate(feeds) if f.shared is not None and f.shared.any()]
    if not labelled:
        return None
    counts = np.array([len(feeds[b].rows) for b in labelled])
    B, width = len(labelled), int(counts.max())
    rows = np.concatenate([feeds[b].rows for b in labelled])  # whole arrays: a decode batch has 128 feeds
    runs = np.concatenate([feeds[b].shared for b in labelled]).astype(np.int32, copy=False)
    of = np.repeat(np.arange(B), counts)  # each row's feed and entry
    entry = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    _check_precedes([feeds[b] for b in labelled], of, entry, rows, runs)
    planes = np.zeros((4, B, width), np.int32)
    planes[LENGTH] = 1
    planes[:, of, entry] = rows.T
    table_runs = np.zeros((B, width), np.int32)
    table_runs[of, entry] = runs
    ape = np.array([feeds[b].ape_rows for b in labelled], np.int32).reshape(B, 2)
    table = kernels.PageTable(*(torch.from_numpy(p) for p in planes),
                              torch.from_numpy(counts.astype(np.int32)),
                              torch.from_numpy(ape[:, 0].copy()), torch.from_numpy(ape[:, 1].copy()))
    shared, rest = kernels.group_shared(table, torch.from_numpy(table_runs))
    if shared.groups == 0:
        return None
    shared.use_request = torch.as_tensor(np.asarray(labelled, np.int32)[shared.use_request.numpy()])  # step order
    rest_rows = torch.stack([rest.ids, rest.delta, rest.start, rest.length], -1).numpy()  # [B, width, 4]
    kept, ape_lo, ape_hi = (t.numpy().tolist() for t in (rest.count, rest.ape_lo, rest.ape_hi))
    out = list(feeds)
    for i, b in enumerate(labelled):
        f, n = feeds[b], kept[i]
        out[b] = replace(f, rows=rest_rows[i, :n].copy(), shared=None, n_context=f.n_context - (len(f.rows) - n),
                         ape_rows=(ape_lo[i], ape_hi[i]))
    return SharedFeeds(out, shared)


def _check_precedes(feeds: list[Feed], of: np.ndarray, entry: np.ndarray, rows: np.ndarray,
                    runs: np.ndarray) -> None:
    """Every labelled row must be a context row whose keys precede its feed's tokens. rows, runs:
    the feeds' rows and labels back to back; of, entry: each row's feed and index in it."""
    n_context = np.array([f.n_context for f in feeds])[of]
    first_token = np.array([f.own_start + f.first for f in feeds])[of]
    last_key = rows[:, START] + rows[:, DELTA] + rows[:, LENGTH] - 1
    if ((runs > 0) & ((entry >= n_context) | (last_key >= first_token))).any():
        raise ValueError("shared page rows must be context rows before the feed's own tokens")


_NOTHING = object()  # what a new static plan holds: not even "nothing shared"


def graph_layout(batch: int, max_pages: int) -> kernels.PlanLayout:
    """A decode graph's plan capacities for `batch` requests of up to `max_pages` rows: room for
    16 runs of stored pages a request, each page of every request's table, 64 programs and 32
    partial rows a request (the paper's workload, 32 requests over 5 chunks of 32 pages, needs
    about 18 rows; a lone request's 5 chunks, split to fill the GPU, up to 64 programs)."""
    return kernels.PlanLayout(works=64 * batch, uses=16 * batch, items=16 * batch, pages=batch * max_pages,
                              tokens=batch, rows=32 * batch)


class ChunkMajor:
    """Chunk-major attention for a lazy engine's steps (see the module docstring)."""

    def __init__(self, num_heads: int, kv_heads: int, head_dim: int, device: torch.device):
        self.num_heads, self.kv_heads, self.head_dim, self.device = num_heads, kv_heads, head_dim, device
        self._batch: list[np.ndarray] = []  # the last batch's rows: kept alive, so identity is its key
        self._tokens: list[int] = []
        self._cut: SharedFeeds | None = None
        self._held: dict[int, tuple[object, bool]] = {}  # static plan -> the cut it holds, whether it fits

    def cut(self, feeds: list[Feed]) -> SharedFeeds | None:
        """cut_feeds, kept while the batch's rows and token counts stay the same (decode)."""
        tokens = [len(f.tokens) for f in feeds]
        if tokens != self._tokens or len(feeds) != len(self._batch) or \
                any(f.rows is not r for f, r in zip(feeds, self._batch)):
            self._batch, self._tokens, self._cut = [f.rows for f in feeds], tokens, cut_feeds(feeds)
        return self._cut

    def plan(self, cut: SharedFeeds, feeds: list[Feed], layout: kernels.PlanLayout | None = None):
        """The host plan of a cut for this step's tokens (pinned on a GPU)."""
        cu = torch.tensor(np.concatenate([[0], np.cumsum([len(f.tokens) for f in feeds])]), dtype=torch.int32)
        return kernels.plan_shared(cut.shared, cu, self.num_heads, self.kv_heads, self.head_dim,
                                   decode=all(len(f.tokens) == 1 for f in feeds), device=self.device, layout=layout,
                                   pin=self.device.type == "cuda")

    def upload(self, feeds: list[Feed], page_size: int) -> StepInputs:
        """An eager step on the device: the remainder feeds and the plan, or the feeds as they are
        where nothing is shared."""
        cut = self.cut(feeds)
        if cut is None:
            return StepInputs.upload(feeds, page_size, self.device)
        step = StepInputs.upload(cut.feeds(feeds), page_size, self.device)
        if cut.plan is None or cut.plan.decode != step.decode:
            cut.plan = self.plan(cut, feeds).to(self.device, non_blocking=True)
        step.shared = cut.plan
        return step

    def static_plan(self, layout: kernels.PlanLayout) -> kernels.SharedPlan:
        """A CUDA graph's plan buffer: empty until a batch's plan is copied in."""
        plan = kernels.empty_plan(layout, decode=True, group=self.num_heads // self.kv_heads, device=self.device)
        self._held[id(plan)] = (_NOTHING, False)
        return plan

    def graph_feeds(self, feeds: list[Feed], static: kernels.SharedPlan) -> list[Feed]:
        """The feeds a decode graph packs, its static plan holding their batch's launch: the
        remainder feeds, or the feeds as they are when nothing is shared or the plan does not fit."""
        cut = self.cut(feeds)
        held, fits = self._held[id(static)]
        if held is not cut:
            fits = False
            if cut is not None:
                host = self.plan(cut, feeds, layout=static.layout)
                fits = host is not None
                if fits:
                    static.copy_(host)
            if not fits:
                static.buffer.zero_()  # no work, no partial rows
            self._held[id(static)] = (cut, fits)
        return cut.feeds(feeds) if fits else feeds
