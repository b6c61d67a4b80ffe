"""The launch plan of the chunk-major kernels: which programs read which shared pages for which
query rows, and where each writes its partial result. Built on the host from the grouping
(shared_pages.py) and a step's query layout, packed into one int32 buffer so that it reaches
the GPU in one copy, or into a CUDA graph's static buffer of fixed capacity. Plain PyTorch and
NumPy: the reference path needs no Triton.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from . import tuning
from .pages import PageTable
from .shared_pages import SharedPages

ALIGN = 4  # int32s: every field starts 16-byte aligned (Triton specialises on pointer alignment)
WORK, USE, ITEM, PAGE = 5, 5, 3, 3  # int32s per work item, use, row item and page


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PlanLayout:
    """Capacities of a plan: work items (programs along the grid's first axis), uses, row items,
    pages, query tokens, and partial rows (the scratch the kernel writes, not in the buffer)."""

    works: int
    uses: int
    items: int
    pages: int
    tokens: int
    rows: int

    @property
    def sizes(self) -> tuple[int, ...]:
        return ALIGN, WORK * self.works, USE * self.uses, ITEM * self.items, PAGE * self.pages, self.tokens + 1

    @property
    def size(self) -> int:
        return sum(_aligned(n) for n in self.sizes)

    def fits(self, other: "PlanLayout") -> bool:
        return all(a <= b for a, b in zip(
            (other.works, other.uses, other.items, other.pages, other.tokens, other.rows),
            (self.works, self.uses, self.items, self.pages, self.tokens, self.rows)))


@dataclass
class SharedPlan:
    """A chunk-major launch over one int32 buffer (PlanLayout):

    head [4]:        work items and uses in use
    work [works, 5]: row items lo..hi-1, pages lo..hi-1, split index: one program per KV head
                     (grouped) or query head
    use [uses, 5]:   request, delta, APE (0/1), its pages lo..hi-1
    item [items, 3]: query token, use, first partial row (a use's row items: its request's
                     tokens; split s of the use's group writes row first + s)
    page [pages, 3]: physical page, stored start, valid length
    part_ptr [tokens + 1]: token t's partial rows are part_ptr[t]..part_ptr[t+1]-1

    grouped: a row item is one token's GQA group of query heads (one program per KV head, which
    reads each page once for the whole group); otherwise one query head (one program per query
    head). Decode plans are always grouped. group: the GQA group size; block_m: rows per program.
    """

    buffer: Tensor
    layout: PlanLayout
    decode: bool
    group: int
    block_m: int
    grouped: bool = True

    @property
    def per_item(self) -> int:
        """Query heads per row item."""
        return self.group if self.grouped else 1

    def _field(self, i: int) -> Tensor:
        at = sum(_aligned(n) for n in self.layout.sizes[:i])
        return self.buffer[at: at + self.layout.sizes[i]]

    # views of the buffer, made once: every layer's launch reads them (copy_ writes the same buffer)
    @cached_property
    def head(self) -> Tensor:
        return self._field(0)

    @cached_property
    def work(self) -> Tensor:
        return self._field(1).view(-1, WORK)

    @cached_property
    def use(self) -> Tensor:
        return self._field(2).view(-1, USE)

    @cached_property
    def item(self) -> Tensor:
        return self._field(3).view(-1, ITEM)

    @cached_property
    def page(self) -> Tensor:
        return self._field(4).view(-1, PAGE)

    @cached_property
    def part_ptr(self) -> Tensor:
        return self._field(5)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def to(self, device, non_blocking: bool = False) -> "SharedPlan":
        return SharedPlan(self.buffer.to(device, non_blocking=non_blocking), self.layout, self.decode, self.group,
                          self.block_m, self.grouped)

    def copy_(self, src: "SharedPlan") -> None:
        """Take src's launch into this plan's buffer (same layout: a CUDA graph's static plan)."""
        if src.layout != self.layout or (src.decode, src.group, src.block_m, src.grouped) != (
                self.decode, self.group, self.block_m, self.grouped):
            raise ValueError("a plan copies only into a plan of its own layout and launch shape")
        self.buffer.copy_(src.buffer, non_blocking=True)


def empty_plan(layout: PlanLayout, *, decode: bool, group: int, block_m: int = 64,
               device: torch.device | str = "cpu") -> SharedPlan:
    """A plan with nothing shared (no work, no partial rows) of the given capacities."""
    return SharedPlan(torch.zeros(layout.size, dtype=torch.int32, device=device), layout, decode, group,
                      _block(block_m, group, True))


def plan_shared(shared: SharedPages, cu_seqlens: Tensor, num_heads: int, kv_heads: int, head_dim: int, *,
                decode: bool, device: torch.device | str = "cpu", block_m: int = 64,
                num_splits: int | None = None, grouped: bool = True, layout: PlanLayout | None = None,
                pin: bool = False) -> SharedPlan | None:
    """The launch of the chunk-major kernel over `shared` for a step whose request b owns query
    tokens cu_seqlens[b]..cu_seqlens[b+1]-1 (decode: one each). Built on the host (pinned if
    `pin`); `device` is where it will run (its size picks the split). Each group's row items
    (its uses times their tokens) are tiled block_m rows at a time; where that leaves the GPU
    partly idle, each group's pages are split across programs too (the split rule of
    tuning.split_count, long groups into more parts). `layout`: the capacities to lay the plan
    out in (a CUDA graph's); None where it does not fit, even unsplit. grouped: one program per KV
    head for all its query heads (decode always; in prefill faster than a program per
    query head on the paper's workload, docs/benchmarks.md)."""
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of kv_heads {kv_heads}")
    group = num_heads // kv_heads
    grouped = grouped or decode
    block_m = _block(block_m, group, grouped)
    s = {k: v.astype(np.int64) for k, v in shared.numpy().items()}
    cu = cu_seqlens.cpu().numpy().astype(np.int64)
    if decode and (np.diff(cu) > 1).any():
        raise ValueError("a decode plan takes one query token per request")
    per_item = group if grouped else 1
    per_tile = block_m // per_item
    n_pages = np.diff(s["page_ptr"])
    use_group = np.repeat(np.arange(shared.groups), np.diff(s["use_ptr"]))
    req = s["use_request"]
    n_tok = cu[req + 1] - cu[req]
    items_per_group = np.bincount(use_group, weights=n_tok, minlength=shared.groups).astype(np.int64)
    tiles = -(-items_per_group // per_tile)
    if num_splits is None:
        dev = torch.device(device)
        # tiles of block_m rows take registers like the prefill kernel's, in decode too
        slots = tuning.prefill(head_dim, tuning.capability(dev)).programs_per_sm * tuning.num_sms(dev)
        num_splits = tuning.split_count(int(tiles.sum()) * (kv_heads if grouped else num_heads),
                                        int(n_pages.max(initial=0)), slots)
    plan = _build(s, cu, use_group, n_tok, items_per_group, tiles, n_pages, per_tile, num_splits, layout, pin)
    while plan is None and num_splits > 1:  # a graph's capacities: fewer splits, down to none
        num_splits //= 2
        plan = _build(s, cu, use_group, n_tok, items_per_group, tiles, n_pages, per_tile, num_splits, layout, pin)
    if plan is None:
        return None
    buffer, lay = plan
    return SharedPlan(buffer, lay, decode, group, block_m, grouped)


def _block(block_m: int, group: int, grouped: bool) -> int:
    """Rows per program: a power of two of at least 16 (the smallest dot) and, grouped, of one GQA group."""
    block = max(16, block_m, 1 << (group - 1).bit_length() if grouped else 1)
    if block & (block - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    return block


def _build(s, cu, use_group, n_tok, items_per_group, tiles, n_pages, per_tile, num_splits, layout, pin):
    G, U, T = len(n_pages), len(use_group), int(cu[-1])
    chunk = -(-int(n_pages.max(initial=1)) // num_splits)
    splits = -(-n_pages // chunk)  # per group: long groups in more parts, each at most `chunk` pages
    # partial rows: each token has one per (use of its request, split of the use's group), by slot
    use_splits = splits[use_group]
    by_slot = np.lexsort((s["use_slot"], s["use_request"]))
    offset = np.zeros(U, np.int64)
    run = np.cumsum(use_splits[by_slot]) - use_splits[by_slot]
    req_sorted = s["use_request"][by_slot]
    first_of_req = np.searchsorted(req_sorted, req_sorted)
    offset[by_slot] = run - run[first_of_req]
    B = len(cu) - 1
    rows_per_token = np.bincount(s["use_request"], weights=use_splits, minlength=B).astype(np.int64)
    token_req = np.repeat(np.arange(B), np.diff(cu))
    part_ptr = np.concatenate([[0], np.cumsum(rows_per_token[token_req])])
    # row items: each use's tokens, by group then use
    item_use = np.repeat(np.arange(U), n_tok)
    first_item = np.cumsum(n_tok) - n_tok
    item_token = cu[s["use_request"]][item_use] + np.arange(len(item_use)) - first_item[item_use]
    item_row = part_ptr[item_token] + offset[item_use]
    # work: per group, split, then tile (tiles of one split read the same pages back to back)
    item_ptr = np.concatenate([[0], np.cumsum(items_per_group)])
    w_group = np.repeat(np.arange(G), splits * tiles)
    w_index = np.arange(len(w_group)) - np.repeat(np.cumsum(splits * tiles) - splits * tiles, splits * tiles)
    w_split, w_tile = w_index // tiles[w_group], w_index % tiles[w_group]
    w_item_lo = item_ptr[w_group] + w_tile * per_tile
    w_page_lo = s["page_ptr"][w_group] + w_split * chunk
    work = np.stack([w_item_lo, np.minimum(w_item_lo + per_tile, item_ptr[w_group + 1]), w_page_lo,
                     np.minimum(w_page_lo + chunk, s["page_ptr"][w_group + 1]), w_split], axis=1)
    use_lo = s["page_ptr"][use_group] + s["use_first"]
    use = np.stack([s["use_request"], s["use_delta"], s["use_ape"], use_lo, use_lo + s["use_pages"]], axis=1)
    item = np.stack([item_token, item_use, item_row], axis=1)
    page = np.stack([s["page_ids"], s["page_start"], s["page_length"]], axis=1)
    need = PlanLayout(len(work), U, len(item), len(page), T, int(part_ptr[-1]))
    if layout is None:
        layout = need
    elif not layout.fits(need):
        return None
    buffer = torch.zeros(layout.size, dtype=torch.int32, pin_memory=pin)
    host = buffer.numpy()
    at = 0
    part = np.full(layout.tokens + 1, part_ptr[-1], np.int64)  # tokens past T: no partial rows
    part[: T + 1] = part_ptr
    for size, values in zip(layout.sizes, ([len(work), U, 0, 0], work, use, item, page, part)):
        flat = np.asarray(values, np.int64).reshape(-1)
        host[at: at + len(flat)] = flat
        at += _aligned(size)
    return buffer, layout


def full_table(rest: PageTable, plan: SharedPlan) -> PageTable:
    """Each request's whole page table again, from its remainder and the plan's uses, entries in
    logical order (the order the remainder and the shared runs were cut from, for page tables
    in logical order): what the chunk-major kernels compute attention over."""
    use = plan.use.cpu().numpy().astype(np.int64)[: int(plan.head[1])]
    page = plan.page.cpu().numpy().astype(np.int64)
    B, W = rest.ids.shape
    planes = [t.cpu().numpy().astype(np.int64) for t in (rest.ids, rest.delta, rest.start, rest.length)]
    rb, re = np.nonzero(np.arange(W)[None, :] < rest.count.cpu().numpy()[:, None])
    lo, hi = ((rest.ape_lo.cpu().numpy(), rest.ape_hi.cpu().numpy()) if rest.has_ape else
              (np.zeros(B, np.int64), np.zeros(B, np.int64)))
    n = use[:, 4] - use[:, 3]
    su = np.repeat(np.arange(len(use)), n)  # each shared entry's use
    sp = use[su, 3] + np.arange(len(su)) - np.repeat(np.cumsum(n) - n, n)  # and page
    req = np.concatenate([rb, use[su, 0]])
    ids, delta, start, length = (np.concatenate([x[rb, re], y]) for x, y in
                                 zip(planes, (page[sp, 0], use[su, 1], page[sp, 1], page[sp, 2])))
    ape = np.concatenate([(re >= lo[rb]) & (re < hi[rb]), use[su, 2] != 0])
    order = np.lexsort((delta + start, req))  # stable: by request, then logical position
    req, ids, delta, start, length, ape = (x[order] for x in (req, ids, delta, start, length, ape))
    count = np.bincount(req, minlength=B)
    pos = np.arange(len(req)) - (np.cumsum(count) - count)[req]
    out = np.zeros((4, B, max(1, int(count.max(initial=0)))), np.int64)
    out[3] = 1
    for plane, x in zip(out, (ids, delta, start, length)):
        plane[req, pos] = x
    extra = ()
    if rest.has_ape:
        ape_lo, ape_hi = np.zeros(B, np.int64), np.zeros(B, np.int64)
        if ape.any():
            np.maximum.at(ape_hi, req[ape], pos[ape] + 1)
            ape_lo[:] = ape_hi
            np.minimum.at(ape_lo, req[ape], pos[ape])
            if (ape_hi - ape_lo != np.bincount(req[ape], minlength=B)).any():
                raise ValueError("the APE entries of a request's table are not one run")
        extra = tuple(torch.as_tensor(x, dtype=torch.int32) for x in (ape_lo, ape_hi))
    return PageTable(*(torch.as_tensor(x, dtype=torch.int32) for x in out), torch.as_tensor(count, dtype=torch.int32),
                     *extra).to(rest.ids.device)


def check_plan(plan: SharedPlan, q: Tensor, k_pages: Tensor, decode: bool) -> None:
    """A plan's rules beside the attention arguments' (checks.check_attention)."""
    if plan.decode != decode:
        raise ValueError(f"this plan was built for {'decode' if plan.decode else 'prefill'}")
    if q.shape[1] != plan.group * k_pages.shape[2]:
        raise ValueError(f"the plan's GQA group is {plan.group}, q's {q.shape[1]} heads over {k_pages.shape[2]}")
    if q.shape[0] > plan.layout.tokens:
        raise ValueError(f"the plan covers {plan.layout.tokens} query tokens, q has {q.shape[0]}")
    if plan.device != q.device:
        raise ValueError(f"the plan is on {plan.device}, q on {q.device}")
