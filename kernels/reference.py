"""Plain PyTorch versions of the lazy-attention kernels.

Same signatures and semantics as the Triton kernels (docs/kernels.md). They are
the tests' oracle and the engine's path where Triton cannot run (CPU). Vectorised per
request: one batched matmul over all pages (the query rotated for each page's delta), or
one SDPA call when the request has a single delta; no per-key Python loops.
Scores and softmax are computed in fp32; the rotated query is rounded to the input dtype
before the dot product, as the kernels do. APE's temperature and scale, where given, scale
and shift the scores of the request's APE entries. fp8 pages are dequantised (values times
their row's scale, in fp32) as each request gathers them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import dequantize_fp8, quantize_fp8
from .pages import PageTable, ape_enabled
from .rope import rope
from .shared_plan import SharedPlan, full_table


def _gather(pages: Tensor, scale: Tensor | None, ids: Tensor) -> Tensor:
    """Pages ``ids`` of a pool: as stored, or dequantised to fp32 when the pool is fp8 (``scale`` given)."""
    ids = ids.long()
    return pages[ids] if scale is None else dequantize_fp8(pages[ids], scale[ids])


def _attend_one(qb, mpos, K, V, delta, start, length, inv_freq, sm_scale, rotate, ape=None):
    """One request: qb [L, H, D] (input dtype), mpos [L] int32; K, V [n, PS, Hkv, D] its gathered
    pages, entries already cut to count. ape: None, or (lo, hi, 1 / T, ln S) for a non-empty run of
    entries lo <= p < hi."""
    L, H, D = qb.shape
    n, PS, Hkv, _ = K.shape
    G = H // Hkv
    N = n * PS
    dev = qb.device
    j = torch.arange(PS, device=dev, dtype=torch.int64)
    kpos = ((start.long() + delta.long())[:, None] + j[None, :]).reshape(N)
    valid = (j[None, :] < length.long()[:, None]).reshape(N)

    deltas, page_delta = torch.unique(delta.long(), return_inverse=True)
    if ape is None and (not rotate or len(deltas) <= 1):
        # one delta (a chunk at index time, or keys already at their logical positions):
        # rotating the query once makes this ordinary attention
        if rotate and len(deltas):
            qb = rope(qb.to(torch.float32), mpos - deltas[0], inv_freq).to(qb.dtype)
        return _attend_plain(qb, mpos, K.reshape(N, Hkv, D), V.reshape(N, Hkv, D), kpos, valid, sm_scale)

    mask = valid[None, :] & (kpos[None, :] <= mpos.long()[:, None])  # [L, N]
    # the query rotated by R(m - delta) once per distinct delta, rounded to the input dtype as
    # the kernels do, handed to every page of that delta; then all pages' scores in one batched
    # matmul: [Hkv, N, G, L]
    if rotate:
        pos = (mpos.long()[None, :] - deltas[:, None]).reshape(-1)
        qr = rope(qb.to(torch.float32).repeat(len(deltas), 1, 1), pos, inv_freq).to(qb.dtype).to(torch.float32)
        qr = qr.view(len(deltas), L, H, D)[page_delta]
    else:  # keys at their logical positions: the same query for every page
        qr = qb.to(torch.float32).expand(n, L, H, D)
    K = K.to(torch.float32)
    V = V.reshape(N, Hkv, D).to(torch.float32).permute(1, 0, 2)  # [Hkv, N, D]
    scores = torch.einsum("nphd,nlhgd->hnpgl", K, qr.reshape(n, L, Hkv, G, D)).reshape(Hkv, N, G, L)
    scores.mul_(sm_scale)
    if ape is not None:
        lo, hi, inv_temperature, log_scale = ape
        scores[:, lo * PS: hi * PS].mul_(inv_temperature).add_(log_scale)
    scores.masked_fill_(~mask.t()[None, :, None, :], float("-inf"))
    m = scores.amax(dim=1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    scores.sub_(m).exp_()
    l = scores.sum(dim=1)  # [Hkv, G, L]
    o = torch.bmm(scores.view(Hkv, N, G * L).transpose(1, 2), V).view(Hkv, G, L, D)
    l = l[..., None]
    o = torch.where(l > 0, o / l.clamp_min(1e-30), torch.zeros_like(o))
    return o.permute(2, 0, 1, 3).reshape(L, H, D)


def _attend_plain(qb, mpos, k, v, kpos, valid, sm_scale):
    """Ordinary attention for keys already at their logical positions (rotate=False).

    Padding rows are dropped first; when the keys are exactly the queries' positions (a
    whole prompt) the mask is causal and SDPA can skip the upper triangle: this is what
    makes `full` mode tolerable on the CPU.
    """
    L, H, D = qb.shape
    # keys past the last query are visible to none (rows reserved for the answer); dropping them
    # lets a whole prompt take the causal path
    keep = (valid & (kpos <= mpos.max())).nonzero().squeeze(1)
    kpos, k, v = kpos[keep], k[keep], v[keep]
    qh, kh, vh = (x.to(torch.float32).transpose(0, 1)[None] for x in (qb, k, v))
    if kpos.shape[0] == L and torch.equal(kpos, mpos.long()):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    mask = kpos[None, :] <= mpos.long()[:, None]  # [L, N]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    # a query with no visible key attends to nothing: zero, like the kernels (SDPA gives NaN)
    return torch.where(mask.any(1)[:, None, None], o[0].transpose(0, 1), 0.0)


def _check(q, k_pages, v_pages, inv_freq, k_scale, v_scale):
    D = q.shape[-1]
    if (k_pages.dtype == torch.float8_e4m3fn) != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale come with float8_e4m3fn pages, and only with them")
    if D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {D}")
    if k_pages.shape != v_pages.shape or k_pages.dim() != 4 or k_pages.shape[-1] != D:
        raise ValueError(f"k_pages/v_pages must be [num_pages, page_size, kv_heads, {D}], got "
                         f"{tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    H, Hkv = q.shape[-2], k_pages.shape[2]
    if H % Hkv:
        raise ValueError(f"num_heads {H} is not a multiple of kv_heads {Hkv}")
    if tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be [{D // 2}], got {tuple(inv_freq.shape)}")


def _ape_ranges(pages: PageTable, counts: list[int], temperature: float, scale: float) -> list:
    """Per request, _attend_one's ape argument: None where APE is off or its run is empty."""
    if not ape_enabled(temperature, scale):
        return [None] * len(counts)
    if not pages.has_ape:
        raise ValueError("ape_temperature and ape_scale need PageTable.ape_lo and ape_hi")
    runs = zip(pages.ape_lo.tolist(), pages.ape_hi.tolist(), counts)
    return [(max(lo, 0), min(hi, n), 1.0 / temperature, math.log(scale)) if max(lo, 0) < min(hi, n) else None
            for lo, hi, n in runs]


def lazy_prefill(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, cu_seqlens_q: Tensor,
                 q_pos: Tensor, inv_freq: Tensor, sm_scale: float, rotate: bool = True,
                 ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale: Tensor | None = None,
                 v_scale: Tensor | None = None, **_unused) -> Tensor:
    _check(q, k_pages, v_pages, inv_freq, k_scale, v_scale)
    out = torch.zeros_like(q)
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    counts = pages.count.tolist()
    apes = _ape_ranges(pages, counts, ape_temperature, ape_scale)
    for b in range(len(cu) - 1):
        qs, qe, n = cu[b], cu[b + 1], counts[b]
        if qe <= qs or n <= 0:
            continue
        ids = pages.ids[b, :n]
        o = _attend_one(q[qs:qe], q_pos[qs:qe], _gather(k_pages, k_scale, ids), _gather(v_pages, v_scale, ids),
                        pages.delta[b, :n], pages.start[b, :n], pages.length[b, :n], inv_freq, sm_scale, rotate,
                        apes[b])
        out[qs:qe] = o.to(q.dtype)
    return out


def lazy_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, q_pos: Tensor,
                inv_freq: Tensor, sm_scale: float, rotate: bool = True, ape_temperature: float = 1.0,
                ape_scale: float = 1.0, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                **_unused) -> Tensor:
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return lazy_prefill(q, k_pages, v_pages, pages, cu, q_pos, inv_freq, sm_scale, rotate, ape_temperature,
                        ape_scale, k_scale, v_scale)


def rotate_copy(k_pages: Tensor, v_pages: Tensor, src: Tensor, dst: Tensor, delta: Tensor, inv_freq: Tensor,
                dst_k: Tensor | None = None, dst_v: Tensor | None = None, k_scale: Tensor | None = None,
                v_scale: Tensor | None = None, dst_k_scale: Tensor | None = None, dst_v_scale: Tensor | None = None):
    if dst_k is None:
        dst_k, dst_k_scale = k_pages, k_scale
    if dst_v is None:
        dst_v, dst_v_scale = v_pages, v_scale
    s = src.long()
    k = _gather(k_pages, k_scale, s).to(torch.float32)  # [N, PS, Hkv, D]
    v = v_pages[s].clone()
    # every row of page i turns by delta[i]: the page's rows are rope's heads
    rot = rope(k.flatten(1, 2), delta, inv_freq.to(torch.float32)).view_as(k)
    d = dst.long()
    if k_scale is None:
        dst_k[d] = rot.to(dst_k.dtype)
    else:  # fp8: each rotated row requantised, the values' scales copied with them
        dst_k[d], dst_k_scale[d] = quantize_fp8(rot)
        dst_v_scale[d] = v_scale[s].clone()
    dst_v[d] = v.to(dst_v.dtype)
    return dst_k, dst_v


def shared_prefill(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, plan: SharedPlan,
                   cu_seqlens_q: Tensor, q_pos: Tensor, inv_freq: Tensor, sm_scale: float,
                   ape_temperature: float = 1.0, ape_scale: float = 1.0, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None, **_unused) -> Tensor:
    """Chunk-major prefill, the same math: each request's whole table rebuilt from its remainder
    and the plan's shared runs."""
    return lazy_prefill(q, k_pages, v_pages, full_table(pages, plan), cu_seqlens_q, q_pos, inv_freq, sm_scale, True,
                        ape_temperature, ape_scale, k_scale, v_scale)


def shared_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, plan: SharedPlan, q_pos: Tensor,
                  inv_freq: Tensor, sm_scale: float, ape_temperature: float = 1.0, ape_scale: float = 1.0,
                  k_scale: Tensor | None = None, v_scale: Tensor | None = None, **_unused) -> Tensor:
    return lazy_decode(q, k_pages, v_pages, full_table(pages, plan), q_pos, inv_freq, sm_scale, True, ape_temperature,
                       ape_scale, k_scale, v_scale)


def bit_rows(data: Tensor, pad: int, matrix: Tensor, xor: int, out: Tensor) -> None:
    """Each 64-byte row's bits times a 0/1 matrix, mod 2, into ``out`` (see kernels.bit_rows)."""
    rows = out.numel()
    padded = torch.zeros(rows * 64, dtype=torch.uint8, device=data.device)
    padded[pad: pad + data.numel()] = data
    shifts = torch.arange(8, device=data.device)
    powers = torch.ones(32, dtype=torch.int64, device=data.device) << torch.arange(32, device=data.device)
    done = 0
    for block in padded.view(rows, 64).split(1 << 14):  # about 64 MB of fp32 bits at a time
        bits = ((block[:, :, None] >> shifts) & 1).reshape(len(block), 512).float()
        parity = (bits @ matrix.float()).long() & 1  # sums of at most 512 ones: exact in fp32
        words = (parity * powers).sum(1) ^ (xor & 0xFFFFFFFF)
        out[done: done + len(block)] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        done += len(block)


def rows_to_pages(rows: Tensor, pool: Tensor, pages: Tensor) -> None:
    """A chunk's token-major rows into pool pages (see kernels.rows_to_pages)."""
    kinds, layers, num_pages, page_size = pool.shape[:4]
    x = rows.reshape(pages.numel(), page_size, layers, kinds, -1).permute(3, 2, 0, 1, 4)
    pool.view(kinds, layers, num_pages, page_size, -1)[:, :, pages] = x
