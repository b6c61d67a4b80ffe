"""Paged KV memory and the attention step that runs over it.

`PagePool` is the memory: one tensor [2 (k/v), layers, num_pages, page_size,
kv_heads, head_dim] and a free list (k/v outermost, so all layers' key pages form
one [layers * num_pages, ...] array: block mode copies every layer in one launch). A request sees the pool through page rows
(see `page_rows`): which physical page, its rotation shift `delta`, the stored
position of its first token and how many of its tokens are valid. `PagedAttention` is the
callable the model's layers call: it writes the step's new K/V into their slots,
then runs the kernels over each request's page list.

Every mode uses this one path; they differ only in the page lists they build and
in whether the kernel rotates queries per page (`lazy`) or the keys already sit
at their logical positions (`block`, `full`).
"""

from __future__ import annotations

import torch

import kernels
from lazyrag.models import rotate


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.kv = torch.zeros(2, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.num_pages = num_pages
        self.peak_used = 0

    @classmethod
    def for_bytes(cls, budget_bytes: float, num_layers, num_kv_heads, head_dim, page_size, dtype, device) -> "PagePool":
        per_page = num_layers * 2 * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        return cls(num_layers, num_kv_heads, head_dim, max(1, int(budget_bytes // per_page)), page_size, dtype, device)

    @property
    def bytes_per_page(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def used(self) -> int:
        return self.num_pages - len(self.free_pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_pages):
            raise OutOfPages(f"need {n} pages, {len(self.free_pages)} free of {self.num_pages}")
        pages = [self.free_pages.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.used)
        return pages

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[0, i], self.kv[1, i]

    def all_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value pages of every layer as [layers * num_pages, page_size, kv_heads, head_dim];
        page p of layer l is row l * num_pages + p."""
        return self.kv[0].flatten(0, 1), self.kv[1].flatten(0, 1)

    def write_tokens(self, pages: list[int], kv: torch.Tensor) -> None:
        """kv in the store's layout [tokens (whole pages), layers, 2, kv_heads, head_dim]."""
        n = len(pages)
        x = kv.view(n, self.page_size, *kv.shape[1:]).permute(3, 2, 0, 1, 4, 5)
        self.kv[:, :, torch.tensor(pages, device=self.kv.device)] = x.to(self.kv.device, non_blocking=True)

    def read_tokens(self, pages: list[int]) -> torch.Tensor:
        """The inverse of write_tokens: [len(pages) * page_size, layers, 2, kv_heads, head_dim]."""
        x = self.kv[:, :, torch.tensor(pages, device=self.kv.device)]
        return x.permute(2, 3, 1, 0, 4, 5).reshape(len(pages) * self.page_size, x.shape[1], 2, *x.shape[4:])


# A request's view of the pool is a tensor of page rows [n, 4] int32, in logical order:
PAGE, DELTA, START, LENGTH = range(4)
# page: physical page; delta: logical - stored position; start: stored position of the
# page's first token; length: valid tokens in the page.


def page_rows(pages: list[int], start: int, tokens: int, delta: int, page_size: int) -> torch.Tensor:
    """Rows for a run of `tokens` tokens stored from position `start` in consecutive pages."""
    n = -(-tokens // page_size)
    i = torch.arange(n, dtype=torch.int32)
    rows = torch.empty(n, 4, dtype=torch.int32)
    rows[:, PAGE] = torch.tensor(pages[:n], dtype=torch.int32)
    rows[:, DELTA] = delta
    rows[:, START] = start + i * page_size
    rows[:, LENGTH] = (tokens - i * page_size).clamp(max=page_size)
    return rows


def page_table(requests: list[torch.Tensor], device: torch.device) -> kernels.PageTable:
    count = torch.tensor([len(r) for r in requests], dtype=torch.int32)
    table = torch.nn.utils.rnn.pad_sequence(requests, batch_first=True).to(device)  # [B, W, 4]
    return kernels.PageTable(ids=table[..., PAGE].contiguous(), delta=table[..., DELTA].contiguous(),
                             start=table[..., START].contiguous(), length=table[..., LENGTH].contiguous(),
                             count=count.to(device))


def slots_for(rows: torch.Tensor, first: int, n: int, page_size: int) -> torch.Tensor:
    """Flat pool slots (page * page_size + offset) of tokens first..first+n-1 of a run of rows."""
    i = torch.arange(first, first + n)
    return rows[i // page_size, PAGE].long() * page_size + i % page_size


class PagedAttention:
    """The attention of one forward step over the pool (see the module docstring).

    q_lens: new tokens per request (all 1 in decode); positions: their logical
    positions; slots: where their K/V go; lazy: rotate queries per page in the kernel.
    """

    def __init__(self, pool: PagePool, requests: list[torch.Tensor], q_lens: list[int],
                 positions: torch.Tensor, slots: torch.Tensor, inv_freq: torch.Tensor, sm_scale: float, lazy: bool):
        dev = pool.kv.device
        self.pool = pool
        self.pages = page_table(requests, dev)
        self.positions = positions.to(device=dev, dtype=torch.int32)
        self.slots = slots.to(dev)
        self.decode = all(n == 1 for n in q_lens)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        self.cu_seqlens = cu.to(dev)
        self.inv_freq, self.sm_scale, self.lazy = inv_freq, sm_scale, lazy

    @classmethod
    def for_step(cls, pool: PagePool, token_lists: list[list[int]], contexts: list[torch.Tensor],
                 owns: list[torch.Tensor], first: list[int], inv_freq: torch.Tensor, sm_scale: float,
                 lazy: bool) -> tuple[torch.Tensor, "PagedAttention"]:
        """One forward step: request b feeds token_lists[b], which go to its own rows `owns[b]`
        from index first[b], after its context rows. Returns the tokens' logical positions and
        the attention callable."""
        ps = pool.page_size
        positions = torch.cat([torch.arange(int(o[0, START]) + f, int(o[0, START]) + f + len(t))
                               for t, o, f in zip(token_lists, owns, first)])
        slots = torch.cat([slots_for(o, f, len(t), ps) for t, o, f in zip(token_lists, owns, first)])
        return positions, cls(pool, [torch.cat((c, o)) for c, o in zip(contexts, owns)],
                              [len(t) for t in token_lists], positions, slots, inv_freq, sm_scale, lazy)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pages, v_pages = self.pool.layer(layer)
        k_pages.view(-1, *k_pages.shape[2:])[self.slots] = k
        v_pages.view(-1, *v_pages.shape[2:])[self.slots] = v
        if not self.lazy:  # keys sit at logical positions: rotate q once, like any engine
            q = rotate(q, self.positions, self.inv_freq)
        if self.decode:
            return kernels.lazy_decode(q, k_pages, v_pages, self.pages, self.positions, self.inv_freq,
                                       self.sm_scale, rotate=self.lazy)
        return kernels.lazy_prefill(q, k_pages, v_pages, self.pages, self.cu_seqlens, self.positions,
                                    self.inv_freq, self.sm_scale, rotate=self.lazy)
