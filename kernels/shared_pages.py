"""Chunk-major grouping: the runs of page-table entries that read stored page sequences (chunks,
the preamble), grouped by sequence so that the chunk-major kernels read each such page once per
step for every request using it.

Host side and pure (CPU tensors in and out); docs/kernels.md, "Chunk-major attention", is the
contract.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from .pages import PageTable


@dataclass
class SharedPages:
    """Shared runs of page-table entries grouped by the page sequence they read (CSR, int32).

    Group ``g`` reads pages ``page_ptr[g]:page_ptr[g+1]`` of ``page_ids``, ``page_start`` and
    ``page_length`` (each physical page once, in stored order) and has the uses
    ``use_ptr[g]:use_ptr[g+1]``. Use ``u`` is one run of entries of request ``use_request[u]``
    at shift ``use_delta[u]``: the group's pages ``use_first[u]`` to ``use_first[u] +
    use_pages[u] - 1``. ``use_ape[u]`` is 1 where the run lies in its request's APE entries;
    ``use_slot[u]`` is the use's index among its request's uses (its output slot).
    """

    page_ptr: Tensor
    page_ids: Tensor
    page_start: Tensor
    page_length: Tensor
    use_ptr: Tensor
    use_request: Tensor
    use_delta: Tensor
    use_first: Tensor
    use_pages: Tensor
    use_ape: Tensor
    use_slot: Tensor

    @property
    def groups(self) -> int:
        return int(self.page_ptr.shape[0]) - 1

    @property
    def uses(self) -> int:
        return int(self.use_request.shape[0])

    def numpy(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name).cpu().numpy() for f in fields(self)}


def group_shared(pages: PageTable, runs: Tensor) -> tuple[SharedPages, PageTable]:
    """Split a page table into the runs of stored page sequences and each request's remainder.

    runs: int32 [B, max_pages]: 0 for an entry only its request reads (its own tokens, a
    private page), else a label naming the stored page sequence (a chunk, the preamble) the
    entry is a page of: the same label in every request, for every page of that sequence.
    A run is a stretch of consecutive entries of one request with one label and one delta, on
    one side of its APE bounds, whose pages follow each other in stored order (the same chunk
    twice in a request is two runs). The runs of one page sequence form a group, also where
    only one run reads it: the chunk-major plan splits every group's pages across programs,
    while a long run left in its request's remainder would make that request's walk the step's
    longest.

    Every key of a shared entry must precede every query of its request (chunk pages come
    before a request's own tokens): the chunk-major kernels apply no causal mask to them.
    Returns the groups and the remainder table: each request's other entries in order, its
    APE bounds moved onto them.
    """
    pages.validate()
    B, W = pages.ids.shape
    if runs.dtype != torch.int32 or tuple(runs.shape) != (B, W):
        raise ValueError(f"runs must be int32 [{B}, {W}], got {runs.dtype} {tuple(runs.shape)}")
    ids, delta, start, length = (t.cpu().numpy().astype(np.int64) for t in
                                 (pages.ids, pages.delta, pages.start, pages.length))
    count = pages.count.cpu().numpy().astype(np.int64)
    col = np.arange(W)[None, :]
    label = np.where(col < count[:, None], runs.cpu().numpy().astype(np.int64), 0)
    if (label < 0).any():
        raise ValueError("runs labels must be >= 0")
    if pages.has_ape:
        ape_lo, ape_hi = pages.ape_lo.cpu().numpy().astype(np.int64), pages.ape_hi.cpu().numpy().astype(np.int64)
    else:
        ape_lo = ape_hi = np.zeros(B, np.int64)
    in_ape = (col >= ape_lo[:, None]) & (col < ape_hi[:, None])

    seq_pages, rank = _page_sequences(label, ids, start, length)
    run = _runs(label, delta, in_ape, rank)
    b_of, e_of = np.nonzero(label > 0)  # row-major: runs appear in request, then entry order
    r_of = run[b_of, e_of]
    n_runs = int(r_of.max()) + 1 if len(r_of) else 0
    first = np.full(n_runs, W, np.int64)
    np.minimum.at(first, r_of, e_of)
    run_b = np.zeros(n_runs, np.int64)
    run_b[r_of] = b_of
    run_label = label[run_b, first]
    run_len = np.bincount(r_of, minlength=n_runs)
    shared_labels = np.unique(run_label)

    keep = np.isin(run_label, shared_labels)  # the shared runs, in request then entry order
    k_b, k_first, k_label = run_b[keep], first[keep], run_label[keep]
    new_request = np.concatenate([[True], k_b[1:] != k_b[:-1]]) if len(k_b) else np.zeros(0, bool)
    slot = np.arange(len(k_b)) - np.maximum.accumulate(np.where(new_request, np.arange(len(k_b)), 0))
    group = np.searchsorted(shared_labels, k_label)
    by_group = np.argsort(group, kind="stable")
    seq_lo = np.searchsorted(seq_pages[0], shared_labels)
    seq_hi = np.searchsorted(seq_pages[0], shared_labels, side="right")
    page_sel = np.concatenate([np.arange(a, b) for a, b in zip(seq_lo, seq_hi)]) if len(shared_labels) else \
        np.zeros(0, np.int64)
    shared = SharedPages(
        page_ptr=_i32(np.concatenate([[0], np.cumsum(seq_hi - seq_lo)])),
        page_ids=_i32(seq_pages[2][page_sel]), page_start=_i32(seq_pages[1][page_sel]),
        page_length=_i32(seq_pages[3][page_sel]),
        use_ptr=_i32(np.concatenate([[0], np.cumsum(np.bincount(group, minlength=len(shared_labels)))])),
        use_request=_i32(k_b[by_group]), use_delta=_i32(delta[k_b, k_first][by_group]),
        use_first=_i32(rank[k_b, k_first][by_group]), use_pages=_i32(run_len[keep][by_group]),
        use_ape=_i32(in_ape[k_b, k_first][by_group]), use_slot=_i32(slot[by_group]))
    shared_entry = np.isin(label, shared_labels) & (label > 0)
    return shared, _remainder(pages, ~shared_entry & (col < count[:, None]), (ids, delta, start, length),
                              ape_lo, ape_hi)


def _page_sequences(label, ids, start, length):
    """Each label's distinct pages in stored order, as four arrays (label, start, id, length)
    sorted by label, then start, then id; and each labelled entry's rank in its sequence."""
    b, e = np.nonzero(label > 0)
    rank = np.full(label.shape, -1, np.int64)
    if len(b) == 0:
        return np.zeros((4, 0), np.int64), rank
    lab, page, at, n = label[b, e], ids[b, e], start[b, e], length[b, e]
    # each (label, page) once, by one integer key: a chunk's pages recur in every request reading
    # it, and sorting every entry by four keys took most of a decode batch's cut
    _, first, inverse = np.unique((lab << 32) | (page & 0xFFFFFFFF), return_index=True, return_inverse=True)
    if (at != at[first][inverse]).any() or (n != n[first][inverse]).any():
        raise ValueError("a page of a shared run appears with two starts or lengths under one label")
    order = np.lexsort((page[first], at[first], lab[first]))  # by label, then start, then id
    uniq = np.stack([lab, at, page, n])[:, first[order]]
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    of_entry = position[inverse]
    rank[b, e] = of_entry - np.searchsorted(uniq[0], uniq[0])[of_entry]
    return uniq, rank


def _runs(label, delta, in_ape, rank):
    """Run index of each labelled entry (row-major numbering), -1 elsewhere."""
    same = ((label[:, 1:] > 0) & (label[:, 1:] == label[:, :-1]) & (delta[:, 1:] == delta[:, :-1])
            & (in_ape[:, 1:] == in_ape[:, :-1]) & (rank[:, 1:] == rank[:, :-1] + 1))
    starts = (label > 0) & ~np.concatenate([np.zeros((label.shape[0], 1), bool), same], axis=1)
    run = np.cumsum(starts.reshape(-1)).reshape(label.shape) - 1
    return np.where(label > 0, run, -1)


def _remainder(pages: PageTable, keep, planes, ape_lo, ape_hi) -> PageTable:
    """The kept entries of each request, in order, in a table as wide as the widest; APE bounds
    counted in kept entries."""
    B = keep.shape[0]
    n = keep.sum(1)
    width = max(1, int(n.max(initial=0)))
    out = [np.zeros((B, width), np.int64) for _ in planes]
    out[3][:] = 1  # unused entries: any valid length
    before = np.concatenate([np.zeros((B, 1), np.int64), np.cumsum(keep, 1)], axis=1)  # kept entries before e
    kb, ke = np.nonzero(keep)
    for src, dst in zip(planes, out):
        dst[kb, before[kb, ke]] = src[kb, ke]
    ape = ()
    if pages.has_ape:
        W = keep.shape[1]
        ape = tuple(_i32(before[np.arange(B), np.clip(x, 0, W)]) for x in (ape_lo, ape_hi))
    return PageTable(*(_i32(x) for x in out), _i32(n), *ape)


def _i32(x) -> Tensor:
    return torch.as_tensor(np.ascontiguousarray(x, dtype=np.int32))
