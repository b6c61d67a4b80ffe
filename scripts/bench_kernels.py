#!/usr/bin/env python
"""Benchmark the lazy-attention kernels on a CUDA GPU (written for the H200).

Rows (Llama-3.1-8B attention 32/8/128 and SmolLM2 9/3/64, bf16):
  decode  batch 32 x 8,192 (16 chunks of 512 shared among requests), batch 8 x 32,768
          vs torch SDPA over the same KV pre-rotated and contiguous (no pages, no positions)
  prefill 8 x 128 question tokens over 8,192 cached, 4 x 256 over 16,384
          vs torch SDPA with the equivalent mask on pre-rotated contiguous KV
  rotate_copy bytes/s vs a device-to-device copy measured in the same run
  deferral: rotate=True vs rotate=False on the same data
  shared  a step of the paper's workload (32 requests x 5 chunks of 2,048 tokens drawn by Zipf
          2.1 from 100 documents, page size 64, Llama-3-8B attention): chunk-major
          (shared_decode, shared_prefill of 32 question tokens) vs the per-request kernels on
          the same step vs SDPA on pre-rotated contiguous KV, with the step's unique KV bytes
          and their time at the measured copy bandwidth
Also sweeps page size (16/32/64) and a few launch configurations: each row times the
kernels' defaults (what the engine runs) and notes the fastest alternative when one beat them.
Prints a table last; writes it as markdown to $OUT/bench_kernels.md when $OUT is set.
--splits: only decode, timed at each split count (to check the kernels' split rule).
Usage: python scripts/bench_kernels.py [--quick] [--ps64] [--pool-size] [--splits] [--only shared]
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

# the timing harness and workload, shared with scripts/probe_prefill.py; imported before Triton,
# as it picks Triton's interpreter in smoke mode (BENCH_SMOKE=1)
from lazyrag.kernel_bench import (DEV, DT, LOG, SMOKE, Work, bench, bench_graph, inv_freq,  # noqa: E402
                                  kernel_backend, kernel_times, log, rel)
import triton  # noqa: E402

from lazyrag import kernels  # noqa: E402
from lazyrag.kernels import PageTable, rope  # noqa: E402


def arguments():
    p = argparse.ArgumentParser(description="Benchmark the lazy-attention kernels on a CUDA GPU (BENCH_SMOKE=1: "
                                            "tiny shapes on the CPU under the Triton interpreter).")
    p.add_argument("--quick", action="store_true", help="time only each row's default launch configuration")
    p.add_argument("--ps64", action="store_true", help="page size 64 only (skip the page-size sweep)")
    p.add_argument("--pool-size", action="store_true",
                   help="only: a small pool vs one past 2**31 elements per layer (64-bit offsets)")
    p.add_argument("--splits", action="store_true", help="only: decode at each split count")
    p.add_argument("--only", choices=["shared"],
                   help="run only these rows: shared = chunk-major attention on a step of the paper's workload")
    return p.parse_args()


ARGS = arguments()
QUICK, PS64, POOL_SIZE, SPLITS = ARGS.quick, ARGS.ps64, ARGS.pool_size, ARGS.splits
ROWS: list[dict] = []


# ------------------------------------------------------------------------------ rows

def faster(r) -> str:
    """A note on the fastest alternative configuration, when it beat the defaults."""
    t, cfg, _ = r["alt"]
    return f"; {cfg} {t * 1e3:.1f} us" if t < r["t"] else ""


def row(name, t_ms, amount, unit, base_ms, limit, note=""):
    ach = amount / (t_ms * 1e-3) / 1e12
    r = dict(name=name, us=t_ms * 1e3, ach=ach, unit=unit, base_us=(base_ms * 1e3 if base_ms else None),
             ratio=(base_ms / t_ms if base_ms else None), limit=limit, note=note)
    ROWS.append(r)
    log(f"ROW {name}: {t_ms * 1e3:.1f} us, {ach:.2f} {unit}, base {r['base_us'] and round(r['base_us'], 1)} us, "
        f"ratio {r['ratio'] and round(r['ratio'], 3)}, limit {limit} {note}")
    return r


def measure_limits():
    n = 1 << (16 if SMOKE else 29)  # 1 GiB of bf16
    a = torch.randn(n, device=DEV, dtype=DT)
    b = torch.empty_like(a)
    t = bench([lambda: b.copy_(a)])
    copy_bw = 2 * a.numel() * 2 / (t * 1e-3) / 1e12
    del a, b
    m = 64 if SMOKE else 8192
    x = torch.randn(m, m, device=DEV, dtype=DT)
    y = torch.randn(m, m, device=DEV, dtype=DT)
    t = bench([lambda: x @ y])
    mm = 2 * m ** 3 / (t * 1e-3) / 1e12
    log(f"device copy bandwidth {copy_bw:.2f} TB/s (read+write), bf16 matmul {mm:.0f} TFLOP/s")
    return copy_bw, mm


def decode_rows(tag, H, Hkv, D, B, ctx, PS, copy_bw, cfgs, pool_chunks):
    G = H // Hkv
    w = Work(H, Hkv, D, PS, B, ctx // 512, 512, 0, pool_chunks)
    # decode query for the next token at logical position ctx
    nset = 2
    qs = [torch.randn(B, H, D, device=DEV, dtype=DT) for _ in range(nset)]
    qpos = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    K, V = w.sdpa_kv()
    Ks, Vs = [K] + [K.clone() for _ in range(nset - 1)], [V] + [V.clone() for _ in range(nset - 1)]
    qr = [rope(q.float(), qpos, w.invf).to(DT) for q in qs]
    scale = 1.0 / math.sqrt(D)

    def sdpa(i):
        return F.scaled_dot_product_attention(qr[i].view(B, Hkv, G, D), Ks[i], Vs[i], scale=scale).view(B, H, D)

    ref = sdpa(0)
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    t_sdpa = bench([lambda i=i: sdpa(i) for i in range(nset)])
    results = []  # the first configuration: the defaults
    for cfg in cfgs:
        out = kernels.lazy_decode(qs[0], w.k, w.v, w.pages, qpos, w.invf, scale, **cfg)
        err = rel(out, ref)
        t = bench([lambda i=i: kernels.lazy_decode(qs[i], w.k, w.v, w.pages, qpos, w.invf, scale, **cfg)
                   for i in range(nset)])
        log(f"  decode {tag} PS={PS} cfg={cfg}: {t * 1e3:.1f} us (err vs SDPA {err:.2e})")
        if err > 3e-2:
            log("  !! MISMATCH vs SDPA")
        results.append((t, cfg, err))
    (t, cfg, err), alt = results[0], min(results, key=lambda r: r[0])
    t_norot = bench([lambda i=i: kernels.lazy_decode(qr[i], w.k, w.v, w.pages, qpos, w.invf, scale, rotate=False,
                                                     **cfg) for i in range(nset)])
    return dict(t=t, cfg=cfg, err=err, t_sdpa=t_sdpa, t_norot=t_norot, bytes=kv_bytes, alt=alt)


def prefill_rows(tag, H, Hkv, D, B, ctx, q_len, PS, cfgs, pool_chunks):
    G = H // Hkv
    w = Work(H, Hkv, D, PS, B, ctx // 512, 512, q_len, pool_chunks)
    nset = 2
    qs = [torch.randn(B * q_len, H, D, device=DEV, dtype=DT) for _ in range(nset)]
    qpos = (ctx + torch.arange(q_len, device=DEV, dtype=torch.int32)).repeat(B)
    cu = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device=DEV)
    K, V = w.sdpa_kv()
    N = K.shape[2]
    Ks, Vs = [K] + [K.clone() for _ in range(nset - 1)], [V] + [V.clone() for _ in range(nset - 1)]
    qr = [rope(q.float(), qpos, w.invf).to(DT).view(B, q_len, H, D).permute(0, 2, 1, 3) for q in qs]  # [B,H,Lq,D]
    scale = 1.0 / math.sqrt(D)
    # equivalent mask: query i (logical ctx+i) sees keys 0..ctx+i (lower-right causal)
    mask = torch.arange(N, device=DEV)[None, :] <= (ctx + torch.arange(q_len, device=DEV))[:, None]
    mask_g = mask.repeat(G, 1)  # GQA folded into the query axis: [G*Lq, N]
    from torch.nn.attention.bias import causal_lower_right
    clr = causal_lower_right(q_len, N)
    Kx = [k.repeat_interleave(G, dim=1) for k in Ks]
    Vx = [v.repeat_interleave(G, dim=1) for v in Vs]

    variants = {
        "gqa-fold+mask": lambda i: F.scaled_dot_product_attention(
            qr[i].reshape(B, Hkv, G * q_len, D), Ks[i], Vs[i], attn_mask=mask_g, scale=scale).view(B, H, q_len, D),
        "expanded+causal_lower_right": lambda i: F.scaled_dot_product_attention(
            qr[i], Kx[i], Vx[i], attn_mask=clr, scale=scale),
    }
    flops = 4 * D * H * B * sum(ctx + i + 1 for i in range(q_len))
    base = None
    for name, fn in variants.items():
        try:
            ref = fn(0)
            t = bench([lambda i=i: fn(i) for i in range(nset)])
        except Exception as e:  # noqa: BLE001
            log(f"  SDPA variant {name} failed: {e!r}")
            continue
        log(f"  SDPA {tag} {name}: {t * 1e3:.1f} us")
        if base is None or t < base[0]:
            base = (t, name, ref)
    t_sdpa, base_name, ref = base
    ref = ref.permute(0, 2, 1, 3).reshape(B * q_len, H, D)
    results = []  # the first configuration: the defaults
    for cfg in cfgs:
        out = kernels.lazy_prefill(qs[0], w.k, w.v, w.pages, cu, qpos, w.invf, scale, max_seqlen_q=q_len, **cfg)
        err = rel(out, ref)
        t = bench([lambda i=i: kernels.lazy_prefill(qs[i], w.k, w.v, w.pages, cu, qpos, w.invf, scale,
                                                    max_seqlen_q=q_len, **cfg) for i in range(nset)])
        log(f"  prefill {tag} PS={PS} cfg={cfg}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s (err {err:.2e})")
        if err > 3e-2:
            log("  !! MISMATCH vs SDPA")
        results.append((t, cfg, err))
    (t, cfg, err), alt = results[0], min(results, key=lambda r: r[0])
    qrp = [x.permute(0, 2, 1, 3).reshape(B * q_len, H, D).contiguous() for x in qr]
    t_norot = bench([lambda i=i: kernels.lazy_prefill(qrp[i], w.k, w.v, w.pages, cu, qpos, w.invf, scale,
                                                      rotate=False, max_seqlen_q=q_len, **cfg) for i in range(nset)])
    return dict(t=t, cfg=cfg, err=err, t_sdpa=t_sdpa, base=base_name, t_norot=t_norot, flops=flops, alt=alt)


class PaperStep(Work):
    """A step of the paper's workload: B requests, each reading n_chunks distinct documents of
    chunk_len tokens drawn by Zipf(alpha) popularity from `docs`, back to back from position 0,
    then own_len tokens of its own (one own page run, delta 0). Pages of a document are shared
    by every request that reads it, at its own delta; `runs` labels them for group_shared."""

    def __init__(self, H, Hkv, D, PS, B, n_chunks, chunk_len, own_len, docs, alpha=2.1, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.H, self.Hkv, self.D, self.PS, self.B = H, Hkv, D, PS, B
        cpp, own_pp = chunk_len // PS, math.ceil(own_len / PS)
        self.k = torch.randn(docs * cpp + B * own_pp, PS, Hkv, D, device=DEV, dtype=DT)
        self.v = torch.randn_like(self.k)
        self.invf = inv_freq(D)
        popularity = torch.arange(1, docs + 1, dtype=torch.float64) ** -alpha
        width = n_chunks * cpp + own_pp
        ids, delta, start, runs = (torch.zeros(B, width, dtype=torch.int32) for _ in range(4))
        length = torch.full((B, width), PS, dtype=torch.int32)
        self.ctx = n_chunks * chunk_len
        for b in range(B):
            chosen = torch.multinomial(popularity, n_chunks, replacement=False, generator=g).tolist()
            for i, doc in enumerate(chosen):
                cols = slice(i * cpp, (i + 1) * cpp)
                ids[b, cols] = doc * cpp + torch.arange(cpp, dtype=torch.int32)
                delta[b, cols] = i * chunk_len
                start[b, cols] = torch.arange(0, chunk_len, PS, dtype=torch.int32)
                runs[b, cols] = doc + 1
            own = slice(n_chunks * cpp, width)
            ids[b, own] = docs * cpp + b * own_pp + torch.arange(own_pp, dtype=torch.int32)
            start[b, own] = self.ctx + torch.arange(0, own_pp * PS, PS, dtype=torch.int32)
            length[b, own] = (own_len - torch.arange(0, own_pp * PS, PS, dtype=torch.int32)).clamp(max=PS)
        self.pages = PageTable(ids, delta, start, length, torch.full((B,), width, dtype=torch.int32))
        self.runs = runs
        self.n_keys = self.ctx + own_len
        self.page_bytes = PS * Hkv * D * 2 * self.k.element_size()  # K and V
        self.unique_bytes = (len(torch.unique(ids[:, : n_chunks * cpp])) + B * own_pp) * self.page_bytes
        self.request_bytes = B * width * self.page_bytes  # what the per-request kernels read

    def split(self, cu, decode, block_m=64, num_splits=None, grouped=True):
        """The step's remainder tables and chunk-major plan on the device, built on the host (as
        the engine builds them when its batch changes)."""
        shared, rest = kernels.group_shared(self.pages, self.runs)
        plan = kernels.plan_shared(shared, cu, self.H, self.Hkv, self.D, decode=decode, device=torch.device(DEV),
                                   block_m=block_m, num_splits=num_splits, grouped=grouped)
        return rest.to(DEV), plan.to(DEV), shared


def shared_rows(copy_bw, bw_lim, mm_lim):
    """Chunk-major decode and 32-token prefill on a step of the paper's workload, against the
    per-request kernels on the same step and SDPA on pre-rotated contiguous KV."""
    sc = 8 if SMOKE else 1
    H, Hkv, D, PS, q_len = 32, 8, 128, 64, 32
    B, chunk_len, docs = 32 // sc, 2048 // sc, 100 // sc
    G, scale = H // Hkv, 1.0 / math.sqrt(D)
    for decode in (True, False):
        w = PaperStep(H, Hkv, D, PS, B, 5, chunk_len, q_len + 1 if decode else q_len, docs)
        K, V = w.sdpa_kv()
        n = w.n_keys
        if decode:
            qpos = torch.full((B,), n - 1, dtype=torch.int32, device=DEV)
            cu = torch.arange(B + 1, dtype=torch.int32)
        else:
            qpos = (w.ctx + torch.arange(q_len, device=DEV, dtype=torch.int32)).repeat(B)
            cu = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32)
        rest, plan, shared = w.split(cu, decode)
        pages = w.pages.to(DEV)
        q = torch.randn(qpos.shape[0], H, D, device=DEV, dtype=DT)
        qr = rope(q.float(), qpos, w.invf).to(DT)
        if decode:
            def sdpa():
                return F.scaled_dot_product_attention(qr.view(B, Hkv, G, D), K, V, scale=scale).view(B, H, D)

            def chunk_major(plan=plan, **opts):
                return kernels.shared_decode(q, w.k, w.v, rest, plan, qpos, w.invf, scale, **opts)

            def per_request():
                return kernels.lazy_decode(q, w.k, w.v, pages, qpos, w.invf, scale)
        else:
            mask = (torch.arange(n, device=DEV)[None, :] <= qpos[:q_len, None]).repeat(G, 1)  # [G * q_len, n]
            qf = qr.view(B, q_len, H, D).permute(0, 2, 1, 3).reshape(B, Hkv, G * q_len, D)
            cu_dev = cu.to(DEV)

            def sdpa():
                o = F.scaled_dot_product_attention(qf, K, V, attn_mask=mask, scale=scale)
                return o.view(B, H, q_len, D).permute(0, 2, 1, 3).reshape(B * q_len, H, D)

            def chunk_major(plan=plan, **opts):
                return kernels.shared_prefill(q, w.k, w.v, rest, plan, cu_dev, qpos, w.invf, scale, max_seqlen_q=q_len,
                                              **opts)

            def per_request():
                return kernels.lazy_prefill(q, w.k, w.v, pages, cu_dev, qpos, w.invf, scale,
                                            max_seqlen_q=q_len)
        ref = sdpa()
        errs = {name: rel(fn(), ref) for name, fn in (("chunk-major", chunk_major), ("per-request", per_request))}
        for name, err in errs.items():
            if err > 3e-2:
                log(f"  !! MISMATCH vs SDPA: {name} {err:.2e}")
        fns = (("chunk-major", chunk_major), ("per-request", per_request), ("sdpa", sdpa))
        t = {name: bench([fn]) for name, fn in fns}
        tg = {name: bench_graph(fn) for name, fn in fns}
        log("  graph-replayed: " + ", ".join(f"{k} {'n/a' if v is None else f'{v * 1e3:.1f} us'}"
                                              for k, v in tg.items()))
        log("  launched one by one: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()))
        if None not in tg.values():
            t = tg  # the row: GPU time as the engine's CUDA graphs run it, not the host's launch cost
        for name, fn in fns[:2]:
            log(f"  kernels of {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in kernel_times(fn).items()))
        def timed(fn):  # graph-replayed where it can be
            g = bench_graph(fn)
            return bench([fn]) if g is None else g

        # the defaults (grouped, 64 rows, the split rule) against the alternatives
        alts = []
        for grouped in [] if QUICK or SMOKE else ((True,) if decode else (True, False)):
            for block_m in (16, 32, 64) if decode else (64, 128):
                for splits in (None, 1, 2, 4, 8, 16) if decode else (None, 1, 2, 4):
                    if (grouped, block_m, splits) == (True, 64, None):
                        continue  # the defaults
                    other = w.split(cu, decode, block_m, splits, grouped)[1]
                    alts.append(("" if grouped else "per-head ") + f"block_m={block_m} splits={splits or 'rule'} "
                                f"{timed(lambda other=other: chunk_major(other)) * 1e3:.1f} us")
        for opts in [] if QUICK or SMOKE else (dict(num_warps=2), dict(num_warps=8), dict(num_stages=3),
                                               dict(num_stages=4)):
            alts.append(" ".join(f"{k}={v}" for k, v in opts.items()) +
                        f" {timed(lambda opts=opts: chunk_major(plan, **opts)) * 1e3:.1f} us")
        from lazyrag.kernels import shared_attention as sa
        for name, value in [] if SMOKE else [("HALF_PARTIALS", False), ("SIDE_STREAM", False), ("MERGE_HEADS", 4), ("MERGE_HEADS", 16),
                                             ("MERGE_ROWS", 4), ("MERGE_ROWS", 16)]:
            default = getattr(sa, name)
            setattr(sa, name, value)
            try:
                alts.append(f"{name.lower()}={value} {timed(chunk_major) * 1e3:.1f} us")
            finally:
                setattr(sa, name, default)
        kind = "decode" if decode else f"prefill {q_len} tokens"
        step = f"{B} x 5 x {chunk_len}, Zipf 2.1 over {docs}"
        log(f"  shared {kind}: {shared.groups} shared chunks, {shared.uses} uses; " +
            ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in t.items()))
        note = (("graph-replayed; " if t is tg else "") + f"SDPA {t['sdpa'] * 1e3:.1f} us; unique KV {w.unique_bytes / 1e6:.0f} MB = "
                f"{w.unique_bytes / (copy_bw * 1e12) * 1e6:.1f} us at copy bw; per-request reads "
                f"{w.request_bytes / 1e6:.0f} MB; err vs SDPA {errs['chunk-major']:.1e} (per-request "
                f"{errs['per-request']:.1e})" + "".join(f"; {a}" for a in alts))
        if decode:
            row(f"shared decode ({step})", t["chunk-major"], w.unique_bytes, "TB/s", t["per-request"], bw_lim, note)
        else:
            flops = 4 * D * H * B * q_len * (w.ctx + (q_len + 1) / 2)
            row(f"shared prefill {q_len} tokens ({step})", t["chunk-major"], flops, "TFLOP/s", t["per-request"],
                mm_lim, note)


def rotate_copy_row(tag, Hkv, D, PS, copy_bw):
    n_src = (64 if SMOKE else 32768 * 16) // PS
    N = n_src // 2
    k = torch.randn(n_src, PS, Hkv, D, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    dk = torch.empty(N, PS, Hkv, D, device=DEV, dtype=DT)
    dv = torch.empty_like(dk)
    invf = inv_freq(D)
    sets = []
    for s in range(2):
        src = torch.randperm(n_src, device=DEV)[:N].to(torch.int32)
        dst = torch.randperm(N, device=DEV).to(torch.int32)
        dl = torch.randint(0, 100000, (N,), device=DEV, dtype=torch.int32)
        sets.append((src, dst, dl))
    kernels.rotate_copy(k, v, *sets[0], invf, dst_k=dk, dst_v=dv)
    ref_k, ref_v = dk.clone(), dv.clone()
    kernels.reference.rotate_copy(k, v, *sets[0], invf, dst_k=ref_k, dst_v=ref_v)
    err = rel(dk, ref_k)
    moved = 2 * 2 * N * PS * Hkv * D * 2  # K and V, read + write
    t = bench([lambda s=s: kernels.rotate_copy(k, v, *s, invf, dst_k=dk, dst_v=dv) for s in sets])
    # device-to-device copy of the same bytes in the same run (contiguous, no gather)
    t_copy = bench([lambda: (dk.copy_(k[:N]), dv.copy_(v[:N]))])
    log(f"  rotate_copy {tag} PS={PS}: {t * 1e3:.1f} us, {moved / t / 1e9:.2f} TB/s; plain copy {t_copy * 1e3:.1f} us; "
        f"err {err:.1e}")
    return dict(t=t, t_copy=t_copy, bytes=moved, err=err)


def main():
    assert SMOKE or torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    if SMOKE:
        class props:  # noqa: N801
            name, multi_processor_count = "cpu-smoke", 0
    else:
        props = torch.cuda.get_device_properties(0)
    sc = 8 if SMOKE else 1  # shrink batch and context in smoke mode
    log(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    copy_bw, mm = measure_limits()
    bw_lim = f"{copy_bw:.2f} TB/s copy"
    mm_lim = f"{mm:.0f} TFLOP/s mm"

    if ARGS.only == "shared":
        shared_rows(copy_bw, bw_lim, mm_lim)
        return report(props, copy_bw, mm, 64, t0)

    # first configs: the defaults; then the alternatives they were chosen over
    dec_cfgs = [dict(), dict(tma=True), dict(num_splits=3), dict(num_splits=6), dict(num_splits=9)]
    pre_cfgs = [dict(), dict(num_stages=2), dict(num_stages=3), dict(maxnreg=0), dict(block_m=128),
                dict(num_splits=1), dict(num_splits=2), dict(num_splits=4)]
    if QUICK:
        dec_cfgs, pre_cfgs = dec_cfgs[:1], pre_cfgs[:1]

    if SPLITS:
        counts = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 22, 32]
        for tag, (H, Hkv, D) in (("Llama-8B", (32, 8, 128)), ("SmolLM2", (9, 3, 64))):
            for B, ctx, pool in ((32, 8192, 64), (8, 32768, 128)):
                B, ctx, pool = max(1, B // sc), ctx // sc, pool // sc
                d = decode_rows(tag, H, Hkv, D, B, ctx, 64, copy_bw, [dict()] + [dict(num_splits=n) for n in counts],
                                pool)
                row(f"decode {tag} B={B} ctx={ctx}, by split count", d["t"], d["bytes"], "TB/s", d["t_sdpa"],
                    bw_lim, f"defaults{faster(d)}")
        return

    if POOL_SIZE:
        for pool in (64, 4200):
            d = decode_rows("Llama-8B", 32, 8, 128, 32, 8192, 64, copy_bw, dec_cfgs[:1], pool)
            row(f"decode Llama-8B 32x8192, pool {pool} chunks", d["t"], d["bytes"], "TB/s", d["t_sdpa"], bw_lim,
                f"rotate=False {d['t_norot'] * 1e3:.1f} us")
            p = prefill_rows("Llama-8B", 32, 8, 128, 8, 8192, 128, 64, pre_cfgs[:1], pool)
            row(f"prefill Llama-8B 8x128/8192, pool {pool} chunks", p["t"], p["flops"], "TFLOP/s", p["t_sdpa"],
                mm_lim, f"rotate=False {p['t_norot'] * 1e3:.1f} us")
            torch.cuda.empty_cache()
        return

    # page size by measurement (Llama shape, rotate=True, first configs)
    ps_t = {}
    for PS in ((64,) if PS64 else (16, 32, 64)):
        d = decode_rows("llama", 32, 8, 128, 32 // sc, 8192 // sc, PS, copy_bw, dec_cfgs[:1], pool_chunks=64 // sc)
        p = prefill_rows("llama", 32, 8, 128, 8 // sc or 1, 8192 // sc, 128 // sc, PS, pre_cfgs[:1],
                         pool_chunks=64 // sc)
        ps_t[PS] = (d["t"], p["t"])
        log(f"page size {PS}: decode {d['t'] * 1e3:.1f} us, prefill {p['t'] * 1e3:.1f} us")
    first = next(iter(ps_t))
    best_ps = min(ps_t, key=lambda k: ps_t[k][0] / ps_t[first][0] + ps_t[k][1] / ps_t[first][1])
    log(f"chosen page size: {best_ps} (sum of decode+prefill times normalised to PS=16)")
    PS = best_ps

    for tag, (H, Hkv, D) in (("Llama-8B", (32, 8, 128)), ("SmolLM2", (9, 3, 64))):
        for B, ctx, pool in ((32, 8192, 64), (8, 32768, 128)):
            B, ctx, pool = max(1, B // sc), ctx // sc // (2 if SMOKE and ctx > 8192 else 1), pool // sc
            d = decode_rows(tag, H, Hkv, D, B, ctx, PS, copy_bw, dec_cfgs, pool)
            row(f"decode {tag} B={B} ctx={ctx}", d["t"], d["bytes"], "TB/s", d["t_sdpa"], bw_lim,
                f"defaults{faster(d)}, err {d['err']:.1e}")
            row(f"  deferral: decode {tag} B={B} rotate=False", d["t_norot"], d["bytes"], "TB/s", d["t"], bw_lim,
                f"cost of deferral {100 * (d['t'] / d['t_norot'] - 1):+.1f}%")
        for B, ctx, ql, pool in ((8, 8192, 128, 64), (4, 16384, 256, 64)):
            B, ctx, ql, pool = max(1, B // sc), ctx // sc // (2 if SMOKE and ctx > 8192 else 1), ql // sc, pool // sc
            p = prefill_rows(tag, H, Hkv, D, B, ctx, ql, PS, pre_cfgs, pool)
            row(f"prefill {tag} {B}x{ql} over {ctx}", p["t"], p["flops"], "TFLOP/s", p["t_sdpa"], mm_lim,
                f"defaults{faster(p)}, SDPA={p['base']}, err {p['err']:.1e}")
            row(f"  deferral: prefill {tag} {B}x{ql} rotate=False", p["t_norot"], p["flops"], "TFLOP/s", p["t"],
                mm_lim, f"cost of deferral {100 * (p['t'] / p['t_norot'] - 1):+.1f}%")
        rc = rotate_copy_row(tag, Hkv, D, PS, copy_bw)
        row(f"rotate_copy {tag} PS={PS}", rc["t"], rc["bytes"], "TB/s", rc["t_copy"], bw_lim,
            f"{100 * rc['bytes'] / rc['t'] / 1e9 / copy_bw:.0f}% of copy bw, err {rc['err']:.1e}")
    shared_rows(copy_bw, bw_lim, mm_lim)
    report(props, copy_bw, mm, PS, t0)


def report(props, copy_bw, mm, PS, t0):
    """The table of every row, printed and written to $OUT (with the log) when $OUT is set."""
    lines = [f"GPU {props.name}; device copy {copy_bw:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s; page size {PS}; "
             f"bench wall {time.time() - t0:.0f} s", "",
             "| row | time (us) | achieved | baseline (us) | ratio (base/ours) | limit | notes |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in ROWS:
        base = "" if r["base_us"] is None else f"{r['base_us']:.1f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['name'].strip()} | {r['us']:.1f} | {r['ach']:.2f} {r['unit']} | {base} | {ratio} | "
                     f"{r['limit']} | {r['note']} |")
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_kernels.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out, "bench_kernels.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    with kernel_backend():
        main()
