#!/usr/bin/env python
"""A first pass in a fresh process: what `answer` pays before its chunks flow at full speed.

bench_e2e's cold runs come after warm-up runs in the same process, which have already pinned the
loader's staging buffers. A fresh `answer` process has pinned nothing: pinning is slow and
serial (about 0.2 s per 277 MB buffer on an H200 machine), so `answer` starts pinning them on a
thread of its own before its model loads (lazyrag/serve/loader.py, pin_staging_ahead, pinning
lazyrag/serve/staging.py's buffers). Here each run is a new process that does the same, loads
the model (timed), makes an engine (timed) and answers the paper workload's first N requests
cold (timed); then makes a second engine and answers them cold again, its buffers now pinned
(the baseline, measured in the same process). With --under-reads-too, a second kind of process
pins nothing ahead: its reader threads pin the buffers as they first write them, for the A/B.
The store is in the page cache for every run (the parent reads it once after indexing).

Usage: python scripts/bench_first_pass.py --model random:llama3-8b --requests 200 --repeats 2 --under-reads-too
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_e2e  # noqa: E402  (the workload, the store and the timed run)


def prompts_and_questions(n: int) -> tuple[list, list]:
    """bench_e2e's first n requests when n is its largest count (questions, then Zipf documents)."""
    import random

    rng = random.Random(1)
    questions = [bench_e2e.words(rng, bench_e2e.QUESTION_TOKENS) for _ in range(n)]
    return bench_e2e.zipf_docs(rng, 2.1, n), questions


def child(args) -> dict:
    """One fresh process: a first cold pass, then a second on a new engine (buffers pinned)."""
    import torch

    from lazyrag.models import load_model
    from lazyrag.serve import loader, staging
    from lazyrag.store import Store

    pinned: list[tuple[float, str]] = []  # when each staging buffer was made, and on which thread
    make = staging.SharedBuffer

    def recorded(*a, **k):
        buf = make(*a, **k)
        pinned.append((time.perf_counter(), staging.threading.current_thread().name))
        return buf

    staging.SharedBuffer = recorded
    t = time.perf_counter()
    store = Store.open(args.store)
    if not args.under_reads:  # as `answer` does (lazyrag/commands/answer_engine.py)
        loader.pin_staging_ahead(store, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load_model(args.model, "auto", store.settings.kv_dtype)
    bench_e2e.sync()
    load_s = time.perf_counter() - t
    prompts, questions = prompts_and_questions(args.requests)
    starts = []

    @contextmanager
    def timed():
        starts.append(time.perf_counter())
        yield

    runs = []
    for _ in range(2):
        r = bench_e2e.run({"cuda_graphs": True}, loaded, store, "lazy", prompts, questions, args.cache_gb,
                          args.batch_size, timed=timed)
        runs.append(r)
    first_start = starts[0]
    before = sum(1 for at, _ in pinned if at <= first_start)
    return {
        "pinned": "under the first reads" if args.under_reads else "ahead, while the model loads",
        "load_s": round(load_s, 2),
        "engine_s": [r["engine_s"] for r in runs],
        "first_s": runs[0]["seconds"], "second_s": runs[1]["seconds"],
        "first_req_s": runs[0]["req_per_s"], "second_req_s": runs[1]["req_per_s"],
        "buffers": len(pinned), "pinned_before_first_pass": before,
        "pin_threads": sorted({name.rsplit("_", 1)[0] for _, name in pinned}),
        "last_pinned_s": round(max(at for at, _ in pinned) - first_start, 3) if pinned else None,
    }


def table(rows: list[dict]) -> str:
    lines = ["| staging buffers pinned | model load (s) | engine start, first / second (s) | first pass (s) | "
             "second pass (s) | first pass speed / second | buffers pinned before the first pass | "
             "last pinned (s into the first pass) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pinned']} | {r['load_s']:.2f} | {r['engine_s'][0]:.2f} / {r['engine_s'][1]:.2f} | "
                     f"{r['first_s']:.3f} | {r['second_s']:.3f} | **{r['second_s'] / r['first_s']:.2f}x** | "
                     f"{r['pinned_before_first_pass']} of {r['buffers']} | {r['last_pinned_s']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--cache-gb", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes of each kind, alternating")
    ap.add_argument("--under-reads-too", action="store_true",
                    help="also processes whose buffers are pinned as reads first write them")
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)  # a child's store
    ap.add_argument("--under-reads", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--docs", type=int, default=bench_e2e.DOCS)
    ap.add_argument("--doc-tokens", type=int, default=bench_e2e.DOC_TOKENS)
    args = ap.parse_args()
    if os.environ.get("OUT"):  # written into at the end of a long run: made now
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    bench_e2e.DOCS, bench_e2e.DOC_TOKENS = args.docs, args.doc_tokens
    if args.store:
        print(json.dumps(child(args)))
        return

    import torch

    from lazyrag.config import IndexConfig
    from lazyrag.store import Store

    root = Path(tempfile.mkdtemp(prefix="lazyrag-e2e-first-"))
    rows = []
    try:
        store_path, _ = bench_e2e.build_store(args.model, root, IndexConfig.page_size)
        with Store.open(store_path) as store:  # into the page cache, as bench_e2e's runs find it
            for c in store.iter_chunks():
                store.read_kv(c)
        base = [sys.executable, __file__, "--store", str(store_path), "--model", args.model, "--requests",
                str(args.requests), "--batch-size", str(args.batch_size), "--cache-gb", str(args.cache_gb),
                "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens)]

        def fresh_process(extra: list[str]) -> dict:
            done = subprocess.run(base + extra, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"a fresh process failed ({done.returncode}):\n{done.stderr[-3000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        fresh_process([])  # untimed: Triton compiles into its disk cache, which every later process finds
        for _ in range(args.repeats):
            for extra in [[], ["--under-reads"]] if args.under_reads_too else [[]]:
                rows.append(fresh_process(extra))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # an 8B store is tens of GB
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    text = (f"{args.model}, {args.requests} requests, batch {args.batch_size}, {args.cache_gb:g} GB; "
            f"{time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}\n\n{table(rows)}")
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_first_pass.md").write_text(text + "\n")
        Path(os.environ["OUT"], "bench_first_pass.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
