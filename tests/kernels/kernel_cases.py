"""Random paged-KV cases for the kernel tests (fp8 pages too), a float64 oracle, and the error measures."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lazyrag import kernels
from lazyrag.kernels import PageTable


@dataclass
class Case:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    pages: PageTable
    cu: torch.Tensor
    q_pos: torch.Tensor
    inv_freq: torch.Tensor
    sm_scale: float
    lens: list


def inv_freq_for(D, base=10000.0, scale=1.0):
    return (1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)) / scale).to(torch.float32)


def rope64(x, pos, inv_freq):
    """float64 rotation of x [..., D] by pos (broadcast to x[..., 0])."""
    half = x.shape[-1] // 2
    ang = pos.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def make_case(seed, *, H=4, Hkv=2, D=64, PS=16, dtype=torch.float32, device="cpu", n_req=3,
              chunk_lens=(37, 16, 50), preamble=0, q_lens=None, base_offsets=None, plan=None,
              random_qpos=False, spare_pages=3, ape_runs=None):
    """Random paged-KV case.

    Chunks are encoded position-free at stored positions preamble..preamble+L-1 (keys stored
    rotated there). Request ``r`` reads chunks ``plan[r]`` (indices, repeats allowed) laid out
    back to back from logical ``base_offsets[r]``, then its own ``q_lens[r]`` new tokens (own
    pages, delta 0), whose positions are the queries' positions. ``ape_runs``: per request,
    the (ape_lo, ape_hi) entry range of the page table.
    """
    g = torch.Generator().manual_seed(seed)
    if plan is None:
        plan = [[0, 1], [1, 0, 2], []][:n_req]
    n_req = len(plan)
    q_lens = q_lens or [5, 1, 13][:n_req]
    base_offsets = base_offsets or [0] * n_req
    # physical pages: chunks first
    chunk_pages = []
    nxt = 0
    for L in chunk_lens:
        np_ = math.ceil(L / PS)
        chunk_pages.append(list(range(nxt, nxt + np_)))
        nxt += np_
    own_pages = []
    for L in q_lens:
        np_ = math.ceil(L / PS)
        own_pages.append(list(range(nxt, nxt + np_)))
        nxt += np_
    num_pages = nxt + spare_pages
    inv_freq = inv_freq_for(D, base=10000.0 + 17 * (seed % 7))
    # stored keys: raw keys rotated at stored positions (rows of padding get random junk too)
    k = torch.randn(num_pages, PS, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(num_pages, PS, Hkv, D, generator=g, dtype=torch.float64)
    for c, L in enumerate(chunk_lens):
        for pi, p in enumerate(chunk_pages[c]):
            pos = torch.arange(preamble + pi * PS, preamble + pi * PS + PS)
            k[p] = rope64(k[p], pos[:, None].expand(PS, Hkv), inv_freq)
    rows = []
    qpos_all = []
    for r in range(n_req):
        ents = []
        s = base_offsets[r]
        for c in plan[r]:
            L = chunk_lens[c]
            for pi, p in enumerate(chunk_pages[c]):
                ents.append((p, s - preamble, preamble + pi * PS, min(PS, L - pi * PS)))
            s += L
        # own tokens at logical positions s..s+q_len-1, stored rotated there, delta 0
        Lq = q_lens[r]
        for pi, p in enumerate(own_pages[r]):
            st = s + pi * PS
            pos = torch.arange(st, st + PS)
            k[p] = rope64(k[p], pos[:, None].expand(PS, Hkv), inv_freq)
            ents.append((p, 0, st, min(PS, Lq - pi * PS)))
        if random_qpos:
            qp = torch.randint(-5, s + Lq + 5, (Lq,), generator=g)
        else:
            qp = torch.arange(s, s + Lq)
        qpos_all.append(qp)
        rows.append(ents)
    maxp = max(1, max(len(e) for e in rows)) + 2  # extra junk entries past count
    ids = torch.randint(0, num_pages, (n_req, maxp), generator=g, dtype=torch.int32)
    delta = torch.randint(-1000, 1000, (n_req, maxp), generator=g, dtype=torch.int32)
    start = torch.randint(0, 1000, (n_req, maxp), generator=g, dtype=torch.int32)
    length = torch.randint(1, PS + 1, (n_req, maxp), generator=g, dtype=torch.int32)
    count = torch.zeros(n_req, dtype=torch.int32)
    for r, ents in enumerate(rows):
        count[r] = len(ents)
        for e, (p, d, st, ln) in enumerate(ents):
            ids[r, e], delta[r, e], start[r, e], length[r, e] = p, d, st, ln
    total = sum(q_lens)
    q = torch.randn(total, H, D, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q_pos = torch.cat(qpos_all).to(torch.int32)
    ape = () if ape_runs is None else tuple(torch.tensor(r, dtype=torch.int32) for r in zip(*ape_runs))
    pt = PageTable(ids, delta, start, length, count, *ape).to(device)
    return Case(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), pt, cu.to(device),
                q_pos.to(device), inv_freq.to(device), 1.0 / math.sqrt(D), list(q_lens))


def fp8_case(c: Case) -> tuple[Case, torch.Tensor, torch.Tensor, Case]:
    """The case with e4m3 pages, their scales, and the same case over the dequantised (fp32) pages."""
    k8, ks = kernels.quantize_fp8(c.k_pages)
    v8, vs = kernels.quantize_fp8(c.v_pages)
    quantised = Case(c.q, k8, v8, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, c.lens)
    plain = Case(c.q, kernels.dequantize_fp8(k8, ks), kernels.dequantize_fp8(v8, vs), c.pages, c.cu, c.q_pos,
                 c.inv_freq, c.sm_scale, c.lens)
    return quantised, ks, vs, plain


def cuda_fp8() -> bool:
    return torch.cuda.is_available() and kernels.fp8_supported(torch.cuda.get_device_capability())


def gpu_case(seed, H, Hkv, D, PS, n_req, q_len, chunk_len, n_chunks, base=0, ape_runs=None):
    """Realistic sizes: n_chunks chunks of chunk_len shared across requests in different orders (fp32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    plan = [torch.randperm(n_chunks, generator=g).tolist() for _ in range(n_req)]
    return make_case(seed, H=H, Hkv=Hkv, D=D, PS=PS, dtype=torch.float32, chunk_lens=[chunk_len] * n_chunks,
                     plan=plan, q_lens=[q_len] * n_req, base_offsets=[base + 1000 * r for r in range(n_req)],
                     preamble=7, spare_pages=0, ape_runs=ape_runs)


def to_cuda(c: Case, dtype) -> Case:
    return Case(c.q.to("cuda", dtype), c.k_pages.to("cuda", dtype), c.v_pages.to("cuda", dtype), c.pages.to("cuda"),
                c.cu.cuda(), c.q_pos.cuda(), c.inv_freq.cuda(), c.sm_scale, c.lens)


def direct64(c: Case, rotate=True, ape_temperature=1.0, ape_scale=1.0):
    """Dense float64 attention: keys explicitly rotated to their logical positions, explicit mask;
    the logits of the page table's APE entries (ape_lo <= entry < ape_hi) are
    (q . k) * sm_scale / ape_temperature + ln(ape_scale)."""
    PS, Hkv, D = c.k_pages.shape[1:]
    H = c.q.shape[1]
    G = H // Hkv
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    kp = c.k_pages.cpu().double()
    vp = c.v_pages.cpu().double()
    pt = c.pages.to("cpu")
    cu = c.cu.cpu().tolist()
    for b in range(len(cu) - 1):
        keys, vals, kpos, factor, bias = [], [], [], [], []
        for e in range(int(pt.count[b])):
            in_ape = pt.has_ape and int(pt.ape_lo[b]) <= e < int(pt.ape_hi[b])
            p, d, st, ln = (int(pt.ids[b, e]), int(pt.delta[b, e]), int(pt.start[b, e]), int(pt.length[b, e]))
            for j in range(ln):
                kk = kp[p, j]  # [Hkv, D], rotated at stored position st+j
                if rotate:
                    raw = rope64(kk, torch.full((Hkv,), -(st + j)), c.inv_freq)
                    kk = rope64(raw, torch.full((Hkv,), st + d + j), c.inv_freq)
                keys.append(kk)
                vals.append(vp[p, j])
                kpos.append(st + d + j)
                factor.append(1 / ape_temperature if in_ape else 1.0)
                bias.append(math.log(ape_scale) if in_ape else 0.0)
        for t in range(cu[b], cu[b + 1]):
            m = int(c.q_pos[t])
            qt = c.q[t].cpu().double()
            if rotate:
                qt = rope64(qt, torch.full((H,), m), c.inv_freq)
            if not keys:
                continue
            K = torch.stack(keys)  # [N, Hkv, D]
            V = torch.stack(vals)
            mask = torch.tensor(kpos) <= m
            if not mask.any():
                continue
            for h in range(H):
                sc = (K[:, h // G] @ qt[h]) * c.sm_scale * torch.tensor(factor, dtype=torch.float64)
                sc = sc + torch.tensor(bias, dtype=torch.float64)
                sc = sc.masked_fill(~mask, float("-inf"))
                out[t, h] = torch.softmax(sc, 0) @ V[:, h // G]
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
