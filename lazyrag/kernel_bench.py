"""The kernel benchmarks' timing harness and workload (scripts/bench_kernels.py, scripts/probe_prefill.py):
median times over cycled argument sets, and a batch of requests over shared chunk pages in paged
and contiguous (SDPA) form.

BENCH_SMOKE=1 runs tiny shapes on the CPU under Triton's interpreter, to check a script's logic;
import this module before anything imports Triton, which picks its interpreter when first imported.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import time

import torch

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from lazyrag import kernels  # noqa: E402
from lazyrag.kernels import PageTable, rope  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.float16 if SMOKE else torch.bfloat16

LOG: list[str] = []  # every line log() printed, for a script's log file


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def kernel_backend():
    """Where the kernels run: CUDA tensors on the GPU; in smoke mode CPU tensors, under the interpreter."""
    return kernels.cpu_backend("triton") if SMOKE else contextlib.nullcontext()


def bench(fn_sets, warmup=20, rep=80):
    """Median ms of fn over a cycle of argument sets (so L2 does not keep one set hot)."""
    it = itertools.cycle(fn_sets)
    if SMOKE:
        t = time.perf_counter()
        next(it)()
        return (time.perf_counter() - t) * 1e3
    return do_bench(lambda: next(it)(), warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep=80):
    """Median ms of fn replayed from a CUDA graph: GPU time without the host's launch cost
    (the engine runs decode steps as graphs); None where fn cannot be captured."""
    if SMOKE:
        return bench([fn])
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a path that syncs the host cannot be captured
        log(f"  (no graph timing: {type(e).__name__}: {str(e)[:80]})")
        return None


def kernel_times(fn, iters=20):
    """GPU microseconds per call of each kernel fn launches (torch.profiler), largest first."""
    if SMOKE:
        return {}
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            times[e.key[:40]] = e.device_time_total / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def inv_freq(D):
    return (1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))).float().to(DEV)


# ------------------------------------------------------------------------------ workload

class Work:
    """B requests; each reads n_chunks chunks of chunk_len (drawn from a shared pool of
    pool_chunks chunks, so pages are shared across requests at different deltas) then owns
    q_len new tokens (own pages, delta 0). Builds the paged form and the SDPA form."""

    def __init__(self, H, Hkv, D, PS, B, n_chunks, chunk_len, q_len, pool_chunks, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.H, self.Hkv, self.D, self.PS, self.B = H, Hkv, D, PS, B
        cpp = chunk_len // PS
        own_pp = max(1, math.ceil(q_len / PS)) if q_len > 0 else 0
        num_pages = pool_chunks * cpp + B * own_pp
        self.k = torch.randn(num_pages, PS, Hkv, D, device=DEV, dtype=DT)
        self.v = torch.randn(num_pages, PS, Hkv, D, device=DEV, dtype=DT)
        self.invf = inv_freq(D)
        maxp = n_chunks * cpp + own_pp
        ids = torch.zeros(B, maxp, dtype=torch.int32)
        delta = torch.zeros(B, maxp, dtype=torch.int32)
        start = torch.zeros(B, maxp, dtype=torch.int32)
        length = torch.full((B, maxp), PS, dtype=torch.int32)
        P = 0  # stored chunk positions 0..chunk_len-1
        for b in range(B):
            chunks = torch.randperm(pool_chunks, generator=g)[:n_chunks].tolist()
            e = 0
            for i, c in enumerate(chunks):
                for p in range(cpp):
                    ids[b, e] = c * cpp + p
                    delta[b, e] = i * chunk_len - P
                    start[b, e] = P + p * PS
                    e += 1
            ctx = n_chunks * chunk_len
            for p in range(own_pp):
                ids[b, e] = pool_chunks * cpp + b * own_pp + p
                start[b, e] = ctx + p * PS
                length[b, e] = min(PS, q_len - p * PS)
                e += 1
        self.pages = PageTable(ids, delta, start, length, torch.full((B,), maxp, dtype=torch.int32)).to(DEV)
        self.ctx = n_chunks * chunk_len
        self.n_keys = self.ctx + q_len
        self.q_len = q_len

    def sdpa_kv(self):
        """Contiguous [B, Hkv, N, D] keys rotated to logical positions, values."""
        B, PS, Hkv, D = self.B, self.PS, self.Hkv, self.D
        ids = self.pages.ids.to(DEV).long()  # (a step built for chunk-major keeps its table on the host)
        K = self.k[ids].reshape(B, -1, Hkv, D)  # stored keys [B, N_all, Hkv, D]
        V = self.v[ids].reshape(B, -1, Hkv, D)
        d = self.pages.delta.to(DEV).repeat_interleave(PS, dim=1)  # [B, N_all]
        K = rope(K.float().reshape(-1, Hkv, D), d.reshape(-1), self.invf).view(B, -1, Hkv, D).to(DT)
        keep = torch.arange(K.shape[1], device=DEV) < self.n_keys  # drop padding of last own page
        K, V = K[:, keep], V[:, keep]
        return K.permute(0, 2, 1, 3).contiguous(), V.permute(0, 2, 1, 3).contiguous()
