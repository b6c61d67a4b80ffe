#!/usr/bin/env python
"""Answering across GPUs: one engine against `--data-parallel N`, affinity routing against
round-robin, on the paper workload of scripts/bench_e2e.py with more requests.

The store is indexed once (on the GPU); the queries file names each prompt's documents
(Zipf 2.1 over the store's documents, 5 per prompt); every configuration answers the same
file through `lazyrag answer` itself (`answer_file`), cold: fresh engines, an empty GPU
cache, the store in the OS page cache. Throughput is the run's queries over its answering
seconds (engines already started); the hit ratio is over chunk references. Writes
$OUT/bench_parallel.json and prints a table.

Usage: python scripts/bench_parallel.py [--model random:llama3-8b] [--requests 400] [--runs inproc,2:affinity,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from lazyrag.workload import PAPER, Workload, documents, queries, write_jsonl


def build_store(model: str, root: Path, w: Workload) -> tuple[Path, dict]:
    """The workload's documents indexed on the GPU, one chunk each (as scripts/bench_e2e.py does)."""
    from lazyrag.commands.index import build_index
    from lazyrag.config import IndexConfig

    corpus = write_jsonl(root / "corpus.jsonl", documents(w, seed=0))
    store = root / (model.replace(":", "-") + ".zarr")
    result = build_index(IndexConfig(corpus=corpus, store=store, model=model, chunk_tokens=w.doc_tokens,
                                     batch_tokens=16384, page_size=64), progress=False)
    return store, result.to_json()


def write_queries(path: Path, w: Workload, n: int, seed: int) -> None:
    write_jsonl(path, queries(w, n, seed))


def answer(store: Path, queries: Path, out: Path, args, engines: int, routing: str, actors: bool) -> dict:
    import torch

    from lazyrag.commands.answer import answer_file
    from lazyrag.config import AnswerConfig

    cfg = AnswerConfig(queries=queries, store=store, out=out, cache_gb=args.cache_gb, batch_size=args.batch_size,
                       max_new_tokens=PAPER.new_tokens, recompute=args.recompute,
                       data_parallel=engines, routing=routing,
                       ray_address="local" if actors and engines == 1 else None)
    t = time.perf_counter()
    summary = answer_file(cfg, report=lambda msg: print(msg, flush=True), progress=False)
    wall = time.perf_counter() - t
    rec = summary.record
    c = rec["cache"]
    refs = c["hits"] + c["misses"]
    row = {
        "engines": engines, "actors": actors, "routing": routing if engines > 1 else "-", "queries": rec["queries"],
        "seconds": rec["seconds"], "wall_s": round(wall, 1), "req_per_s": rec["queries_per_s"],
        "hit_ratio": round(c["hits"] / refs, 4) if refs else None,
        "bytes_read_gb": round(c.get("bytes_read", 0) / 2**30, 2), "ttft_ms": rec["ttft_ms"],
        "per_engine": [{"queries": e["queries"], "hit_ratio": e.get("hit_ratio"),
                        "bytes_read_gb": round(e["cache"].get("bytes_read", 0) / 2**30, 2),
                        "device": e.get("device"), "cache_gb": e.get("cache_gb", args.cache_gb)}
                       for e in rec.get("engines", [])],
    }
    out.unlink(missing_ok=True)
    # the one-engine run's model and pool live in this process: give the GPU back to the actors
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], info: dict) -> str:
    base = rows[0]["req_per_s"]
    lines = [f"`{info['command']}`", "",
             f"{info['date']}; {info['gpus']} x {info['gpu']}; torch {info['torch']}, ray {info['ray']}; "
             f"{info['model']}, cache {info['cache_gb']} GB per engine, batch {info['batch_size']}, "
             f"recompute {info['recompute']}", "",
             "| engines | where | routing | queries | seconds | req/s | vs 1 engine | hit ratio | per-engine hit ratio (queries) "
             "| GB read | TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{e['hit_ratio']:.3f} ({e['queries']})" for e in r["per_engine"] if e["hit_ratio"] is not None)
        where = "Ray actors" if r["actors"] else "this process"
        lines.append(f"| {r['engines']} | {where} | {r['routing']} | {r['queries']} | {r['seconds']:.2f} | {r['req_per_s']:.1f} "
                     f"| {r['req_per_s'] / base:.2f}x | {r['hit_ratio']:.3f} | {per or '-'} | {r['bytes_read_gb']} "
                     f"| {r['ttft_ms']['p50']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--requests", type=int, default=400, help="twice bench_e2e's 200")
    ap.add_argument("--runs", default="inproc,2:affinity,2:round-robin",
                    help="inproc: one engine in this process (the baseline, first); N:ROUTING: N engine actors on "
                         "Ray (1:affinity measures what the actor costs against inproc)")
    ap.add_argument("--cache-gb", type=float, default=60.0, help="per engine")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--recompute", type=float, default=0.0)
    ap.add_argument("--docs", type=int, default=PAPER.docs)
    ap.add_argument("--doc-tokens", type=int, default=PAPER.doc_tokens)
    args = ap.parse_args()
    w = Workload(docs=args.docs, doc_tokens=args.doc_tokens)
    import ray
    import torch

    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"command": "python scripts/bench_parallel.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "ray": ray.__version__,
            "model": args.model, "cache_gb": args.cache_gb, "batch_size": args.batch_size,
            "recompute": args.recompute}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lazyrag-parallel-") as root:
        root = Path(root)
        t = time.perf_counter()
        store, index = build_store(args.model, root, w)
        info["index_s"] = round(time.perf_counter() - t, 1)
        print(f"indexed {index['tokens_total']:,} tokens in {info['index_s']} s", flush=True)
        queries = root / "queries.jsonl"
        write_queries(queries, w, args.requests, seed=1)
        # a short untimed run first, so kernel compilation lands in no timed run
        warm = root / "warm.jsonl"
        write_queries(warm, w, 8, seed=2)
        answer(store, warm, root / "warm-out.jsonl", args, 1, "affinity", actors=False)
        for run in args.runs.split(","):
            engines, routing = (1, "affinity") if run == "inproc" else (int(run.split(":")[0]), run.split(":")[1])
            row = answer(store, queries, root / f"out-{run.replace(':', '-')}.jsonl", args, engines, routing,
                         actors=run != "inproc")
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "bench_parallel.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    text = table(rows, info)
    print(text)
    (out_dir / "bench_parallel.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
