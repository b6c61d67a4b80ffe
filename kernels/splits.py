"""Split-and-merge (flash-decoding): a program's pages split evenly across programs, each
writing a normalised partial output and its log2-sum-exp to fp32 scratch, then one merge.

The split count follows a rule (``tuning.split_count``) that fills the GPU's resident programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import split_count  # noqa: F401  (the rule lives with the launch settings: no triton)

POISON_SCRATCH = False  # tests: fill split scratch with NaN to catch unwritten partials


@triton.jit
def split_range(n_pages, num_splits, sp):
    """Page entries [lo, hi) of split sp: a request's own pages split evenly (not the table's
    width: a CUDA graph captures one wide table for requests of any length)."""
    per_split = tl.cdiv(n_pages, num_splits)
    lo = sp * per_split
    return lo, tl.minimum(lo + per_split, n_pages)


@triton.jit
def store_partial(OP, LSE, o, m_i, l_i, rows, num_splits, sp, mask, offs_d):
    """One split's normalised output and log2-sum-exp: OP [rows, num_splits, D], LSE [rows, num_splits]."""
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    prow = rows * num_splits + sp
    tl.store(OP + prow[:, None] * offs_d.shape[0] + offs_d[None, :], o, mask=mask[:, None])
    tl.store(LSE + prow, lse, mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(OP, LSE, O, stride_ob, stride_oh, num_heads, num_splits,
                         D: tl.constexpr, SPLITS_P2: tl.constexpr):
    # one program per (row, head): a decode request or a prefill query token
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    smask = offs_s < num_splits
    offs_d = tl.arange(0, D)
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    lse = tl.load(LSE + base + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx_safe = tl.where(mx > float("-inf"), mx, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - mx_safe), 0.0)
    tot = tl.sum(w, axis=0)
    op = tl.load(OP + (base + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(op * w[:, None], axis=0)
    o = tl.where(tot > 0, o / tl.where(tot > 0, tot, 1.0), 0.0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(O.dtype.element_ty))


def scratch(shape, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Working memory for split partials (fp32 unless said), NaN-filled under the tests' POISON_SCRATCH."""
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def merge_splits(op: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, num_splits: int) -> None:
    """o[r, h] from the splits' partials op [R, H, S, D] and lse [R, H, S]."""
    R, H, D = o.shape
    # the split count is a runtime argument, not specialised (it follows the batch size; a
    # new value must not compile a new kernel mid-run); the merge rounds it up to a power of two
    _merge_splits_kernel[(R, H)](op, lse, o, o.stride(0), o.stride(1), H, num_splits, D=D,
                                 SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4)
