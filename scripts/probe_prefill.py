#!/usr/bin/env python
"""Where prefill's cost of deferral goes, on a CUDA GPU (written for the H200).

For Llama-3.1-8B prefill shapes it times, in one run:
  lazy_prefill with rotate=False (no position work); rotate=True on
  the benchmark's page table (a new delta every chunk: one query rebuild per chunk); and
  rotate=True with every delta folded into the page starts (the same masks and work, one
  rebuild per tile). The last two differ only in the rebuilds, so their gap over the number
  of chunks is what one rebuild costs.
Then lazy_prefill's tuning variants given on the command line (JSON objects of keyword
arguments). Results on the H200: docs/results/kernels-prefill-deferral-h200.md.
Usage: python scripts/probe_prefill.py ['{"num_stages": 2}' ...]
"""
from __future__ import annotations

import json
import os
import sys

import torch

# the workload, timing and smoke mode that scripts/bench_kernels.py uses; imported before the
# kernels, as it picks Triton's interpreter in smoke mode
from lazyrag import kernel_bench as bk
from lazyrag.kernel_bench import bench, log

from lazyrag import kernels  # noqa: E402
from lazyrag.kernels import PageTable


def one_run_table(p: PageTable) -> PageTable:
    """The same pages with delta 0 and starts moved to where the deltas put them: the same
    masks and the same work, but one query rebuild per tile (the output differs: each key is
    seen at its stored position)."""
    return PageTable(p.ids, torch.zeros_like(p.delta), p.start + p.delta, p.length, p.count)


def probe(B, ctx, q_len, variants):
    H, Hkv, D, PS = 32, 8, 128, 64
    w = bk.Work(H, Hkv, D, PS, B, ctx // 512, 512, q_len, 64)
    dev = bk.DEV
    q = [torch.randn(B * q_len, H, D, device=dev, dtype=bk.DT) for _ in range(2)]
    qpos = (ctx + torch.arange(q_len, device=dev, dtype=torch.int32)).repeat(B)
    cu = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    flops = 4 * D * H * B * sum(ctx + i + 1 for i in range(q_len))
    flat = one_run_table(w.pages)

    def run(pages, **kw):
        return bench([lambda i=i: kernels.lazy_prefill(q[i], w.k, w.v, pages, cu, qpos, w.invf, scale,
                                                       max_seqlen_q=q_len, **kw) for i in range(2)])

    ref = kernels.lazy_prefill(q[0], w.k, w.v, w.pages, cu, qpos, w.invf, scale, max_seqlen_q=q_len)
    rows = {"rotate=False": run(w.pages, rotate=False), "rotate=True": run(w.pages),
            "rotate=True, one delta": run(flat)}
    for text in variants:
        cfg = json.loads(text)
        out = kernels.lazy_prefill(q[0], w.k, w.v, w.pages, cu, qpos, w.invf, scale, max_seqlen_q=q_len, **cfg)
        rows[text] = run(w.pages, **cfg)
        rows[text + ", one delta"] = run(flat, **cfg)
        log(f"  {text}: rel err vs default {bk.rel(out, ref):.1e}")
    n_chunks = ctx // 512
    base = rows["rotate=False"]
    lines = [f"prefill {B}x{q_len} over {ctx} ({n_chunks} chunks + own pages)", "",
             "| variant | us | TFLOP/s | vs rotate=False |", "|---|---:|---:|---:|"]
    for name, t in rows.items():
        lines.append(f"| {name} | {t * 1e3:.1f} | {flops / t / 1e9:.0f} | {100 * (t / base - 1):+.1f}% |")
    per = (rows["rotate=True"] - rows["rotate=True, one delta"]) / n_chunks
    lines.append(f"\none rebuild costs about {per * 1e3:.2f} us of kernel time (whole grid)")
    return "\n".join(lines)


def main():
    torch.manual_seed(0)
    if bk.SMOKE:  # BENCH_SMOKE=1: tiny shapes under the interpreter, to check this script
        tables = [probe(1, 1024, 16, sys.argv[1:])]
    else:
        log(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
        tables = [probe(8, 8192, 128, sys.argv[1:]), probe(4, 16384, 256, sys.argv[1:])]
    text = "\n\n".join(tables)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_prefill.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    with bk.kernel_backend():
        main()
