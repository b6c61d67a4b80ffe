#!/usr/bin/env python
"""End-to-end speed of lazy / block / full on the LazyAttention paper's workload (H200).

100 documents of 2,048 tokens, Zipf(alpha) popularity (2.1, and uniform), 5 documents per
prompt in random order, 32-token questions, 16 output tokens (EOS ignored). For each model:
index the documents on the GPU, then in one process and on the same requests
  closed   every request arrives at t=0 (TTFT includes queueing), per mode
  poisson  open-loop arrivals at fractions of lazy's closed-batch throughput
  sweep    lazy and block at several cache budgets: hit ratio and TTFT
TTFT is measured from each request's arrival. Writes $OUT/bench_e2e.json and prints tables.
`--plot results.json` draws the cache sweep (matplotlib) into docs/.

Usage: python scripts/bench_e2e.py [--models random:llama3.2-1b,random:llama3-8b] [--requests 200]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from lazyrag.workload import PAPER, Workload, documents, draw_docs, words, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, however this one is loaded
from trace_gaps import length, merged  # noqa: E402

# the paper's workload (lazyrag/workload.py); --docs/--doc-tokens override the first two
DOCS, DOC_TOKENS, PER_PROMPT, QUESTION_TOKENS, NEW_TOKENS = (PAPER.docs, PAPER.doc_tokens, PAPER.per_prompt,
                                                             PAPER.question_tokens, PAPER.new_tokens)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def allocations() -> dict[str, float]:
    """Counters of the allocations that synchronise a GPU: pinned host blocks made (and the
    microseconds spent making them), device segments made (cudaMalloc), and retries after one
    failed (which free every cached block). Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    host, device = torch.cuda.memory.host_memory_stats(), torch.cuda.memory_stats()
    return {"pinned_allocs": host.get("num_host_alloc", 0), "pinned_alloc_ms": host.get("host_alloc_time.total", 0) / 1e3,
            "device_segments": device.get("segment.all.allocated", 0), "alloc_retries": device.get("num_alloc_retries", 0)}


def segment_sizes() -> dict[int, list] | None:
    """The device segments torch's allocator holds, by address: [MiB, pool, stream]. None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {seg["address"]: [round(seg["total_size"] / 2**20, 1), seg["segment_type"], seg["stream"]]
            for seg in torch.cuda.memory_snapshot()}


@contextlib.contextmanager
def full_collections(out: dict):
    """Python's full garbage collections while the context lasts: their count and milliseconds
    (total and longest) into `out`; each stops every thread that needs the GIL."""
    times, started = [], []

    def note(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                times.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield
    finally:
        gc.callbacks.remove(note)
        out.update({"count": len(times), "ms": round(sum(times) * 1e3, 1), "max_ms": round(max(times, default=0) * 1e3, 1)})


def free_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_dir() -> Path:
    return Path(os.environ.get("OUT", "."))


def workload() -> Workload:
    """The paper's workload at this run's --docs and --doc-tokens."""
    return dataclasses.replace(PAPER, docs=DOCS, doc_tokens=DOC_TOKENS)


def zipf_docs(rng: random.Random, alpha: float | None, n: int) -> list[list[str]]:
    return draw_docs(rng, workload(), n, alpha)


def build_store(model: str, root: Path, page_size: int, kv_dtype: str = "auto") -> tuple[Path, dict]:
    from lazyrag.config import IndexConfig
    from lazyrag.commands.index import build_index

    corpus = write_jsonl(root / "corpus.jsonl", documents(workload(), seed=0))
    store = root / (model.replace(":", "-") + ".zarr")
    result = build_index(IndexConfig(corpus=corpus, store=store, model=model, chunk_tokens=DOC_TOKENS,
                                     batch_tokens=16384, page_size=page_size, dtype=kv_dtype), progress=False)
    return store, result.to_json()


def run(engine_args: dict, loaded, store, mode: str, prompts, questions, cache_gb: float, batch_size: int,
        arrivals: list[float] | None = None, warm: bool = False, timed=contextlib.nullcontext,
        order: str = "given") -> dict:
    """One timed run on a fresh engine. warm: first answer the same requests once, untimed, so
    the timed pass finds the cache as a long-running server would (no first reads from disk).
    timed: a context manager around the timed pass alone (the profiler). order: the prompts'
    document order, as `answer --chunk-order` takes it."""
    from lazyrag.eval import scoring as metrics
    from lazyrag.serve import Engine, Request
    from lazyrag.serve.ordering import PopularFirst, shared_prefixes
    from lazyrag.serve.scheduler import StepCounts

    t_engine = time.perf_counter()
    engine = Engine(loaded, store, mode, cache_gb * 2**30, batch_size, stop_at_eos=False, **engine_args)
    engine_s = time.perf_counter() - t_engine
    chunks = {d: store.doc_chunks(d) for d in {d for p in prompts for d in p}}
    fmt_q = [loaded.tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    done: list = []
    offsets = arrivals or [0.0] * len(prompts)
    given = [[c for d in p for c in chunks[d]] for p in prompts]
    if order == "popular":
        popular = PopularFirst(given)
        given = [popular.order(g) for g in given]
    shared = shared_prefixes(given, engine.mode.whole_prefix_uses)

    def requests(t0: float) -> list:
        return [Request(f"r{i}", g, fmt_q[i], NEW_TOKENS, arrival=t0 + offsets[i], shared_prefix=shared[i])
                for i, g in enumerate(given)]

    if warm:
        engine.run(requests(0.0), lambda r: None)
        engine.cache.reset_counters()
        engine.steps = StepCounts()
    sync()
    before, collections, segments = allocations(), {}, segment_sizes()
    with timed(), full_collections(collections):
        t0 = time.perf_counter()
        engine.run(requests(t0), done.append)
        sync()
        seconds = time.perf_counter() - t0
    made = {k: round(v - before[k], 1) for k, v in allocations().items()}
    if segments is not None:  # each new segment: MiB, its pool, its stream
        made["new_segments"] = [v for a, v in segment_sizes().items() if a not in segments]
    c, steps = engine.cache.counters, engine.steps
    engine.close()
    out_tokens = sum(len(r.generated) for r in done)
    result = {
        "mode": mode, "requests": len(done), "seconds": round(seconds, 3), "engine_s": round(engine_s, 3),
        "cache_gb": cache_gb,
        "batch_size": batch_size, "ttft_ms": metrics.summarize([r.ttft_ms for r in done]),
        "latency_ms": metrics.summarize([r.latency_ms for r in done]),
        "req_per_s": round(len(done) / seconds, 3), "out_tok_per_s": round(out_tokens / seconds, 1),
        "hit_ratio": round(c.hit_ratio, 4), "token_hit_ratio": round(c.token_hit_ratio, 4),
        "kv_peak_gb": round(c.peak_pages * c.page_bytes / 2**30, 2), "bytes_read_gb": round(c.bytes_read / 2**30, 2),
        "bytes_read": c.bytes_read,
        "evictions": c.evictions, "read_wait_s": round(c.read_wait_s, 3), "warm": warm,
        "host_cache_gb": engine_args.get("host_cache_bytes", 0) / 2**30, "host_hits": c.host_hits,
        "read_ahead": c.read_ahead, "order": order, "allocations": made, "full_collections": collections,
        "recomputed_tokens_per_req": round(c.recomputed_tokens / max(1, len(done)), 1),
        "reused_tokens_per_req": round(c.reused_tokens / max(1, len(done)), 1), "reuse_ratio": round(c.reuse_ratio, 4),
        "prefill_steps": steps.prefills, "prefill_batch_mean": round(steps.prefilled / max(1, steps.prefills), 1),
        "decode_steps": steps.decodes, "decode_batch_mean": round(steps.decoded / max(1, steps.decodes), 1),
    }
    del engine
    free_cache()
    return result


def shared_check(kw: dict, loaded, store, prompts, questions, cache_gb: float, batch_size: int) -> dict:
    """Chunk-major attention against each request reading its own pages, on the same requests:
    both teacher-forced along the per-request engine's greedy answer (relative error of the
    logits, top-1 agreement), and the greedy answers of both. The control: block mode against the
    same (the same attention, keys rotated before they are rounded to bf16 rather than the
    query: what bf16 rounding alone moves through the model)."""
    from lazyrag.eval.fidelity import top1_matches
    from lazyrag.serve import Engine, Request

    chunks = {d: store.doc_chunks(d) for d in {d for p in prompts for d in p}}
    qids = [loaded.tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    reqs = [Request(f"r{i}", [c for d in p for c in chunks[d]], qids[i], NEW_TOKENS) for i, p in enumerate(prompts)]
    answers, logits = {}, {}
    for shared, mode in ((False, "lazy"), (True, "lazy"), ("control", "block")):
        engine = Engine(loaded, store, mode, cache_gb * 2**30, batch_size, stop_at_eos=False,
                        shared_attention=shared is True, **kw)
        done = {}
        engine.run(reqs, lambda seq, done=done: done.__setitem__(seq.id, list(seq.generated)))
        answers[shared] = done
        logits[shared] = engine.teacher_forced_logits(reqs, [answers[False][r.id] for r in reqs])
        engine.close()
        del engine
        free_cache()
    out = {"requests": len(reqs), "tokens": sum(len(a) for a in answers[False].values())}
    for name, key in (("", True), ("control_", "control")):
        rel = [((a - b).norm() / b.norm()).item() for a, b in zip(logits[key], logits[False])]
        out.update({f"{name}logits_rel_err_max": round(max(rel), 5),
                    f"{name}logits_rel_err_mean": round(sum(rel) / len(rel), 5),
                    f"{name}top1_agreement": round(sum(int(top1_matches(b, a).sum()) for a, b in
                                                       zip(logits[key], logits[False])) / out["tokens"], 4),
                    f"{name}identical_answers": sum(answers[key][r.id] == answers[False][r.id] for r in reqs) / len(reqs)})
    return out


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One configuration of the batch sweep."""
    mode: str
    fraction: float = 0.0
    warm: bool = False
    shared: bool = True       # chunk-major attention
    reuse: bool = False       # recomputed pages reused across requests (answer's default)
    order: str = "given"      # answer --chunk-order
    workload: str = "zipf"    # zipf 2.1, or uniform popularity
    requests: int = 0
    disk: bool = False        # cold, the store's files first dropped from the OS page cache
    prefill_graphs: bool = True  # prefill steps' layers replayed from CUDA graphs (False: op by op)
    read_threads: int = 0     # chunk reads at once (0: the loader's default)
    host_checksums: bool = False  # reads' crc32c checked in the reader process, not on the GPU
    lookahead: int = 0        # waiting requests the scheduler reads ahead for and may admit (0: its default)

    @property
    def variant(self) -> bool:
        """A cold lazy run with one loader or scheduler setting changed, set against the default's warm run."""
        return bool(self.read_threads or self.host_checksums or self.lookahead)

    @property
    def label(self) -> str:
        """The row's mode: the mode, or the setting this run changed."""
        if self.lookahead:
            return f"lazy, look-ahead {self.lookahead}"
        if self.host_checksums:
            return "lazy, crc32c on the host"
        if self.read_threads:
            return f"lazy, {self.read_threads} chunk reads at once"
        if not self.prefill_graphs:
            return "lazy, prefill op by op"
        if self.mode == "lazy" and not self.shared:
            return "lazy, per-request pages"
        return self.mode


def batch_sweep(kw: dict, loaded, store, prompts, questions, cache_gb: float, args, model: str, save, out,
                uniform=None) -> list:
    """Closed runs of lazy without recompute, full, and at each --recompute fraction: lazy as `answer`
    runs it by default (recomputed pages reused, the given order), with `--chunk-order popular`,
    without reuse (`--no-recompute-reuse`) and block with the same recompute; each at every --batch-sizes
    value and every --sweep-requests count: a mode's best batch size against another's best."""
    from lazyrag.serve import Recompute

    counts = args.sweep_requests or [len(prompts)]
    configs = []
    for n in counts:
        configs += [Sweep("lazy", requests=n)] + ([] if args.skip_full else [Sweep("full", requests=n)])
        # the same run at each other count of chunk reads at once
        configs += [Sweep("lazy", requests=n, read_threads=t) for t in args.read_threads[1:]]
        if args.host_checksums_too:  # the same run with the reads checked on the host
            configs.append(Sweep("lazy", requests=n, host_checksums=True))
        configs += [Sweep("lazy", requests=n, lookahead=a) for a in args.lookahead_too]
        if args.eager_prefill_too:  # the same run with prefill steps launched op by op
            configs.append(Sweep("lazy", requests=n, prefill_graphs=False))
        if args.per_request_too:  # lazy with each request reading its own pages: what chunk-major buys
            configs.append(Sweep("lazy", shared=False, requests=n))
        for f in args.recompute:
            if f:  # answer's default (reuse, given order), with popular order, and without reuse
                configs += [Sweep("lazy", f, reuse=True, requests=n), Sweep("lazy", f, reuse=True, order="popular",
                                                                         requests=n), Sweep("lazy", f, requests=n)]
            if not args.skip_block:
                configs.append(Sweep("block", f, requests=n))
            if args.per_request_too and f:
                configs.append(Sweep("lazy", f, shared=False, requests=n))
        if uniform is not None:  # popularity without skew: little to reuse
            configs += [Sweep("lazy", workload="uniform", requests=n)]
            configs += [Sweep("lazy", f, reuse=r, order=o, workload="uniform", requests=n)
                        for f in args.recompute if f for r, o in ((True, "given"), (True, "popular"), (False, "given"))]
    cold = [c for c in configs if c.mode == "lazy" and c.workload == "zipf" and c.prefill_graphs and not c.variant]
    if args.warm:  # each lazy and block run again, on a cache warmed by one untimed pass
        configs += [dataclasses.replace(c, warm=True) for c in configs if c.mode != "full" and not c.variant]
    if args.from_disk:  # last: a run from disk leaves in the page cache only what it read
        configs += [dataclasses.replace(c, disk=True) for c in cold]
    rows = []
    for c in configs:
        source = uniform if c.workload == "uniform" else prompts
        n = min(c.requests, args.full_requests) if c.mode == "full" else c.requests
        for bs in args.batch_sizes:
            recompute = Recompute(c.fraction, args.recompute_policy, reuse=c.reuse)
            engine_args = dict(kw, recompute=recompute, shared_attention=c.shared)
            use_read_threads((c.read_threads or args.read_threads[0]) if args.read_threads else None)
            try:
                if c.disk:
                    evict(store.path)
                with setting("lazyrag.serve.runner", "PREFILL_GRAPH_TOKENS", None if c.prefill_graphs else 0), \
                        setting("lazyrag.serve.scheduler", "LOOKAHEAD", c.lookahead or None), \
                        loader_defaults(**({"check_on_device": False} if c.host_checksums else {})):
                    r = run(engine_args, loaded, store, c.mode, source[:n], questions[:n], cache_gb, bs,
                            warm=c.warm, order=c.order)
                if c.disk:
                    r.update(disk_bound(store.path, r))
            except Exception as exc:  # block's copies may not fit a large batch: say so
                r = {"mode": c.mode, "batch_size": bs, "warm": c.warm, "error": str(exc)[:120]}
            r["mode"] = c.label
            r.update(recompute=c.fraction, policy=args.recompute_policy, page_size=args.page_size, reuse=c.reuse,
                     order=c.order, workload=c.workload, sweep_requests=c.requests, disk=c.disk)
            r.update(recompute_floor(loaded, r, store))
            rows.append(r)
            out["batch_sweep"] = rows
            save(out)
            print(f"[{model}] batch sweep {c}, batch {bs}: {json.dumps(r)}", flush=True)
    return rows


@contextlib.contextmanager
def setting(module: str, name: str, value):
    """A module's setting changed for a run (None: left as it is)."""
    import importlib

    mod = importlib.import_module(module)
    old = getattr(mod, name)
    setattr(mod, name, old if value is None else value)
    try:
        yield
    finally:
        setattr(mod, name, old)


def evict(path: Path) -> None:
    """Drop a store's files from the OS page cache (posix_fadvise DONTNEED; honoured on the H200
    machine, where drop_caches and O_DIRECT gave the same rate)."""
    from bench_store import evict as drop

    drop(path)


DISK_SAMPLE = 8 << 30  # the disk's rate is read over this much of the store's segment files


def disk_bound(path: Path, r: dict) -> dict:
    """A from-disk run's bound: the disk's own sequential rate (dd over up to DISK_SAMPLE bytes of
    the store's segment files, dropped from the page cache first), measured just after the run,
    and the requests per second the run's bytes read allow at that rate."""
    from bench_store import dd_gb_s, segment_files

    files, total = [], 0
    for f in segment_files(path):
        if total >= DISK_SAMPLE:
            break
        files.append(f)
        total += f.stat().st_size
    evict(path)
    rate = dd_gb_s(files)
    seconds = r["bytes_read"] / (rate * 1e9)
    return {"disk_gb_s": round(rate, 6), "disk_sample_bytes": total,  # the bound is computed from it: no coarse rounding
            "disk_bound_req_per_s": round(r["requests"] / seconds, 3) if seconds else None}


BF16_MATRIX_RATE = 790e12  # dense bf16 FLOP/s measured on the H200 (.library device notes)


def recompute_floor(loaded, r: dict, store) -> dict:
    """What a row's recompute costs at the bf16 matrix rate: 2 FLOPs per weight per recomputed token,
    plus its attention (QK and PV over the context before it, half the prompt on average)."""
    tokens = r.get("recomputed_tokens_per_req")
    if tokens is None:
        return {}
    cfg = loaded.cfg
    weights = sum(p.numel() for n, p in loaded.model.named_parameters() if "embed" not in n)
    context = PER_PROMPT * DOC_TOKENS / 2
    flops = tokens * (2 * weights + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context)
    return {"recompute_gflop_per_req": round(flops / 1e9, 1),
            "recompute_floor_ms_per_req": round(flops / BF16_MATRIX_RATE * 1e3, 6)}


def _fastest(rows: list[dict]) -> dict | None:
    return max((r for r in rows if "req_per_s" in r), key=lambda r: r["req_per_s"], default=None)


def sweep_table(results: list[dict]) -> str:
    """Each (mode, recompute) at its best batch size, with the ratios the claims rest on."""
    lines = ["| model | workload | requests | cache | mode | recompute | reuse, order | best batch | req/s "
             "| cold / warm | TTFT mean ms | recomputed / reused tokens per req | recompute floor ms/req "
             "| prefill / decode steps (mean batch) | req/s at each batch size |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        best = {}
        for r in res.get("batch_sweep", []):
            key = (r.get("workload", "zipf"), r.get("sweep_requests", r.get("requests")), r.get("warm", False),
                   r["mode"], r["recompute"], r.get("policy", "head") if r["recompute"] else "",
                   r.get("reuse", False), r.get("order", "given"), r.get("disk", False))
            best.setdefault(key, []).append(r)
        for (workload, n, warm, mode, f, policy, reuse, order, disk), rows in best.items():
            top = _fastest(rows)
            # a cold run against the warm run of the same requests and settings, both at their best batch;
            # a variant of the cold run ("lazy, crc32c on the host") against its mode's warm run
            twins = [best.get((workload, n, True, m, f, policy, reuse, order, False), []) for m in
                     (mode, mode.split(",")[0])]
            warm_top = None if warm else _fastest(twins[0] or twins[1])
            ratio = f"{top['req_per_s'] / warm_top['req_per_s']:.2f}x" if top and warm_top else ""
            each = ", ".join(f"{r['batch_size']}: {r['req_per_s']:.1f}" if "req_per_s" in r else
                             f"{r['batch_size']}: does not fit" for r in rows)
            if top:
                recompute = f"{f:g} {policy}" if f else "0"
                how = (("reuse" if reuse else "no reuse") + f", {order}") if f and mode == "lazy" else ""
                work = (f"{top['recomputed_tokens_per_req']:.0f} / {top['reused_tokens_per_req']:.0f}"
                        if f and "recomputed_tokens_per_req" in top else "")
                floor = f"{top['recompute_floor_ms_per_req']:.2f}" if f and "recompute_floor_ms_per_req" in top else ""
                steps = (f"{top['prefill_steps']} ({top['prefill_batch_mean']:.1f}) / "
                         f"{top['decode_steps']} ({top['decode_batch_mean']:.1f})" if "prefill_steps" in top else "")
                lines.append(f"| {res['model'].split(':')[-1]} | {workload} | {top['requests']} | "
                             f"{'warm' if warm else 'cold, from disk' if disk else 'cold'} | {mode} | {recompute} | {how} | {top['batch_size']} | "
                             f"{top['req_per_s']:.1f} | {ratio} | {top['ttft_ms']['mean']:.0f} | {work} | {floor} | {steps} | {each} |")
    return "\n".join(lines) + disk_table(results)


def disk_table(results: list[dict]) -> str:
    """Each from-disk run against its bound: min(the same run from the page cache, the disk's
    rate over the bytes it read)."""
    lines = ["", "", "| model | requests | recompute | batch | page cache req/s | from disk req/s | read GiB "
             "| disk GB/s (dd) | disk bound req/s | from disk / min(page cache, disk bound) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        rows = res.get("batch_sweep", [])
        for d in (r for r in rows if r.get("disk") and "req_per_s" in r):
            same = [r for r in rows if not r.get("disk") and not r.get("warm") and "req_per_s" in r
                    and all(r.get(k) == d.get(k) for k in ("mode", "recompute", "reuse", "order", "workload",
                                                           "sweep_requests", "batch_size"))]
            if not same or not d.get("disk_bound_req_per_s"):
                continue
            bound = min(same[0]["req_per_s"], d["disk_bound_req_per_s"])
            lines.append(f"| {res['model'].split(':')[-1]} | {d['requests']} | {d['recompute']:g} | {d['batch_size']} | "
                         f"{same[0]['req_per_s']:.1f} | {d['req_per_s']:.1f} | {d['bytes_read_gb']:.1f} | "
                         f"{d['disk_gb_s']:.2f} | {d['disk_bound_req_per_s']:.1f} | **{d['req_per_s'] / bound:.2f}** |")
    return "\n".join(lines) if len(lines) > 4 else ""


@contextlib.contextmanager
def labelled_phases():
    """The engine's host phases as named ranges in a profiler trace (what the GPU waits for)."""
    from torch.profiler import record_function

    def wrap(fn, label):
        def wrapped(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return wrapped

    with wrapped_phases(wrap):
        yield


@dataclasses.dataclass(frozen=True)
class Phase:
    """One call of a host phase, as logged_phases records it."""
    label: str
    start: float
    end: float
    sequences: int
    cpu: float


@contextlib.contextmanager
def logged_phases(log: list):
    """The engine's host phases appended to `log` as Phases on the perf_counter clock, without a
    profiler's cost per operation (sequences: a step's, else 0; cpu: the calling thread's CPU
    seconds inside, so wall minus cpu is time spent waiting)."""
    def wrap(fn, label):
        def wrapped(*a, **k):
            t, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                n = len(a[1]) if len(a) > 1 and isinstance(a[1], list) else 0
                log.append(Phase(label.removeprefix("lazyrag."), t, time.perf_counter(), n, time.thread_time() - cpu))
        return wrapped

    with wrapped_phases(wrap):
        yield


@contextlib.contextmanager
def wrapped_phases(wrap):
    """The engine's host phases each wrapped by `wrap(function, label)` while the context lasts."""
    from lazyrag.serve import cuda_graphs, engine, loader, paged, runner, scheduler, sharing
    from lazyrag.serve.paged import StepInputs

    targets = [(engine.Engine, "_choose_recompute"), (engine.Engine, "_accept"), (engine.Engine, "_sample"),
               (runner.Runner, "prefill"), (runner.Runner, "decode"), (runner.Runner, "row_attention"),
               (scheduler.Scheduler, "schedule"), (scheduler.Scheduler, "retire"), (scheduler.Scheduler, "_admit"),
               (loader.ChunkLoader, "load"), (sharing.ChunkMajor, "upload"), (sharing.ChunkMajor, "plan"),
               (sharing.ChunkMajor, "cut"), (cuda_graphs.PrefillGraphs, "run")]
    originals = [(cls, name, cls.__dict__[name]) for cls, name in targets]
    for cls, name, fn in originals:
        setattr(cls, name, wrap(fn, f"lazyrag.{cls.__name__}.{name}"))
    upload, pack = StepInputs.__dict__["upload"], paged.pack_step
    StepInputs.upload = classmethod(wrap(upload.__func__, "lazyrag.StepInputs.upload"))
    paged.pack_step = wrap(pack, "lazyrag.pack_step")
    try:
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
        StepInputs.upload, paged.pack_step = upload, pack


@contextlib.contextmanager
def loader_defaults(**values):
    """The engines made meanwhile build their ChunkLoader with these keyword defaults instead
    (staging_bytes: bytes read ahead not yet loaded; check_on_device: False checks reads' crc32c
    in the reader process, as on a CPU)."""
    from lazyrag.serve import loader

    init = loader.ChunkLoader.__init__
    names = init.__code__.co_varnames[1: init.__code__.co_argcount]
    defaults = init.__defaults__
    first = len(names) - len(defaults)
    patched = list(defaults)
    for name, value in values.items():
        patched[names.index(name) - first] = value
    init.__defaults__ = tuple(patched)
    try:
        yield
    finally:
        init.__defaults__ = defaults


_DEFAULT_READ_THREADS = None


def use_read_threads(threads: int | None) -> None:
    """For the engines made from now on, a reader process with `threads` chunk reads at once (the
    loader's count; None: its default), new unless the count is the one in use."""
    global _DEFAULT_READ_THREADS
    from lazyrag.serve import loader
    from lazyrag.store import read_process

    if _DEFAULT_READ_THREADS is None:
        _DEFAULT_READ_THREADS = loader.chunk_read_threads
    count = threads or _DEFAULT_READ_THREADS()
    if loader.chunk_read_threads() == count:
        return
    loader.chunk_read_threads = (lambda: threads) if threads else _DEFAULT_READ_THREADS
    with read_process._shared_lock:
        old, read_process._shared = read_process._shared, None
    if old is not None:
        old.close()


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans."""
    return length(merged(np.array(spans, float).reshape(-1, 2)))


def profile_run(engine_args: dict, loaded, store, mode: str, prompts, questions, cache_gb: float,
                batch_size: int, model: str, warm: bool = False, trace: Path | None = None) -> dict:
    """One closed run under torch.profiler: where the time goes (GPU busy share, top kernels, the
    engine's host phases).
    warm: the timed pass of a warm run (run's `warm`) alone is profiled. trace: also write the
    profiler's trace there (gzipped Chrome trace JSON), the engine's phases labelled."""
    import gzip
    import shutil

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    order = "popular" if engine_args.get("recompute") else "given"  # answer's default with recompute
    with labelled_phases():
        r = run(engine_args, loaded, store, mode, prompts, questions, cache_gb, batch_size, warm=warm,
                timed=lambda: prof, order=order)
    if trace:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()

    # device-side events only (kernels, memcpys): a CPU op's device time repeats its kernels'
    events = prof.key_averages()
    # the labelled phases' ranges show on the device's timeline too: not work, leave them out
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.key.startswith("lazyrag.")]
    busy_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:12]
    h2d_us = sum(e.self_device_time_total for e in kernels if "HtoD" in e.key)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type != DeviceType.CPU and not e.name.startswith("lazyrag.") and "Memcpy" not in e.name
             and "Memset" not in e.name]
    syncs = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
    wait_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU and e.key in syncs)
    summary = {"seconds": r["seconds"], "warm": warm, "req_per_s": r["req_per_s"], "gpu_busy_s": round(busy_us / 1e6, 3),
               "gpu_busy_share": round(busy_us / 1e6 / r["seconds"], 3),
               # the time some kernel ran, overlaps counted once and copies left out
               "kernels_busy_share": round(covered_us(spans) / 1e6 / r["seconds"], 3),
               "h2d_copy_s": round(h2d_us / 1e6, 3),
               "host_sync_wait_s": round(wait_us / 1e6, 3),
               "top_kernels_ms": {e.key[:80]: round(e.self_device_time_total / 1e3, 1) for e in top},
               "top_host_ops_ms": {f"{e.key[:70]} x{e.count}": round(e.self_cpu_time_total / 1e3, 1) for e in host},
               # the engine's host phases, each with what it calls (nested: row_attention is in _choose_recompute)
               "host_phases_ms": {f"{e.key[len('lazyrag.'):]} x{e.count}": round(e.cpu_time_total / 1e3, 1)
                                  for e in events if e.device_type == DeviceType.CPU and e.key.startswith("lazyrag.")}}
    print(f"[{model}] profile {mode} ({len(prompts)} requests): {json.dumps(summary)}", flush=True)
    return summary


def step_log_run(engine_args: dict, loaded, store, prompts, questions, cache_gb: float, batch_size: int,
                 warm: bool) -> dict:
    """One timed lazy run with its host phases logged (logged_phases): when each prefill step ran
    and for how long, how long the host waited for the GPU, and when chunks were loaded."""
    log: list = []
    t0 = []
    late: list[tuple[float, float]] = []  # (when, how late) of each wake of a thread that sleeps 0.5 ms

    def gil_probe(stop: threading.Event) -> None:
        # a sleeping thread wakes late when it must wait for the GIL (or a core)
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0005)
            now = time.perf_counter()
            late.append((now, now - t - 0.0005))

    @contextlib.contextmanager
    def timed():
        stop = threading.Event()
        probe = threading.Thread(target=gil_probe, args=(stop,), daemon=True)
        with logged_phases(log):
            t0.append(time.perf_counter())
            probe.start()
            try:
                yield
            finally:
                stop.set()
                probe.join()

    r = run(engine_args, loaded, store, "lazy", prompts, questions, cache_gb, batch_size, warm=warm, timed=timed)
    start = t0[0]

    def ms(t: float) -> float:
        return round((t - start) * 1e3, 1)

    def phase(name: str) -> list[Phase]:
        return [e for e in log if e.label == name]

    def total_ms(name: str) -> float:
        return round(sum(e.end - e.start for e in phase(name)) * 1e3, 1)

    def cpu_ms(name: str) -> float:
        return round(sum(e.cpu for e in phase(name)) * 1e3, 1)

    def inside_ms(name: str, a: float, b: float) -> float:
        return round(sum(e.end - e.start for e in phase(name) if a <= e.start and e.end <= b) * 1e3, 1)

    def prefill(e: Phase) -> dict:
        a, b = e.start, e.end
        lates = [x for t, x in late if a <= t <= b]
        return {"at_ms": ms(a), "host_ms": round((b - a) * 1e3, 1), "cpu_ms": round(e.cpu * 1e3, 1),
                "sequences": e.sequences, **{f"{k}_ms": inside_ms(name, a, b) for k, name in
                   (("cut", "ChunkMajor.cut"), ("plan", "ChunkMajor.plan"), ("pack", "pack_step"),
                    ("upload", "StepInputs.upload"), ("graphs", "PrefillGraphs.run"))},
                "gil_late_max_ms": round(max(lates, default=0) * 1e3, 1)}

    decodes, loads = phase("Runner.decode"), phase("ChunkLoader.load")
    lates = sorted(x for _, x in late)
    summary = {"seconds": r["seconds"], "req_per_s": r["req_per_s"], "warm": warm, "allocations": r["allocations"],
               "full_collections": r["full_collections"],
               "prefills": [prefill(e) for e in phase("Runner.prefill")],
               "decode_steps": len(decodes), "decode_host_ms": total_ms("Runner.decode"),
               "decode_cpu_ms": cpu_ms("Runner.decode"),
               "first_decode_ms": ms(decodes[0].start) if decodes else None,
               "accept_wait_ms": total_ms("Engine._accept"), "schedule_ms": total_ms("Scheduler.schedule"),
               "schedule_cpu_ms": cpu_ms("Scheduler.schedule"),
               "cut_ms": total_ms("ChunkMajor.cut"), "plan_ms": total_ms("ChunkMajor.plan"),
               "sample_ms": total_ms("Engine._sample"),
               "loads": len(loads), "load_ms": total_ms("ChunkLoader.load"),
               "last_load_ms": ms(loads[-1].end) if loads else None,
               "loads_by_100ms": [sum(1 for e in loads if k <= (e.start - start) * 10 < k + 1)
                                  for k in range(int(r["seconds"] * 10) + 1)],
               "gil_late_ms": {q: round(lates[min(len(lates) - 1, int(f * len(lates)))] * 1e3, 2) if lates else None
                               for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))}}
    print(f"step log ({'warm' if warm else 'cold'}, {len(prompts)} requests): {json.dumps(summary)}", flush=True)
    return summary


def bench_model(model: str, args, root: Path, save) -> dict:
    """All runs for one model; `save(partial)` after each, so a time limit loses nothing."""
    from lazyrag.models import load_model
    from lazyrag.store import Store

    t = time.perf_counter()
    store_path, index = build_store(model, root, args.page_size, args.kv_dtype)
    index["wall_s"] = round(time.perf_counter() - t, 1)
    print(f"[{model}] indexed {index['tokens_total']:,} tokens in {index['seconds']}s", flush=True)
    store = Store.open(store_path)
    loaded = load_model(model, "auto", store.settings.kv_dtype)
    # Read every chunk once, so all modes find the store equally warm in the OS page cache
    # (otherwise the first mode timed pays the cold disk reads for everyone).
    t = time.perf_counter()
    warm_bytes = sum(store.read_kv(c).nbytes for c in store.iter_chunks())
    index["warm_read_gb_s"] = round(warm_bytes / (time.perf_counter() - t) / 1e9, 2)
    rng = random.Random(1)
    n = max([args.requests, *args.sweep_requests])
    questions = [words(rng, QUESTION_TOKENS) for _ in range(n)]
    zipf = zipf_docs(rng, 2.1, n)
    uniform = zipf_docs(rng, None, n)
    out = {"model": model, "index": index, "closed": [], "uniform": [], "poisson": [], "sweep": []}
    kw = {"cuda_graphs": not args.eager}
    cache = args.cache_gb
    # compile the kernels for small and full batches, so compilation lands in no timed run
    for mode in ("lazy",) if (args.only_lazy_at or args.host_tier) and not args.recompute else ("lazy", "block"):
        for m in (4, args.batch_size):
            run(kw, loaded, store, mode, zipf[:m], questions[:m], cache, args.batch_size)
            if args.recompute:  # and the recompute path's kernels (its probe, its many feeds)
                from lazyrag.serve import Recompute
                rkw = dict(kw, recompute=Recompute(max(args.recompute), args.recompute_policy))
                run(rkw, loaded, store, mode, zipf[:m], questions[:m], cache, args.batch_size)
    if not args.skip_full:
        run(kw, loaded, store, "full", zipf[:2], questions[:2], cache, args.batch_size)
    if args.profile:  # with the last --recompute fraction, if any: where recompute's time goes
        from lazyrag.serve import Recompute
        pkw = dict(kw, recompute=Recompute(args.recompute[-1], args.recompute_policy)) if args.recompute else kw
        out["profile"] = {}
        for threads in args.read_threads or [None]:
            if threads:
                use_read_threads(threads)
            first = threads == (args.read_threads or [None])[0]
            for m in ("lazy", "block") if first and not args.skip_block else ("lazy",):
                for warm in (False, True) if args.warm and first else (False,):
                    name = f"{m}{'-warm' if warm else ''}{f'-{threads}t' if threads else ''}"
                    trace = (out_dir() / f"trace-{name}.json.gz") if args.trace else None
                    out["profile"][name] = profile_run(pkw, loaded, store, m, zipf[:args.profile], questions, cache,
                                                       args.batch_size, model, warm=warm, trace=trace)
                    save(out)
    if args.step_log:
        out["step_log"] = {}
        for warm in (False, True):
            out["step_log"]["warm" if warm else "cold"] = step_log_run(kw, loaded, store, zipf[:args.step_log],
                                                                       questions, cache, args.batch_size, warm)
            save(out)
        # cold again at each further count of chunk reads at once, and each further staging size
        variants = [(f"cold, {t} chunk reads at once", t, {}) for t in args.read_threads[1:]]
        variants += [(f"cold, {gb:g} GB of staging", None, {"staging_bytes": int(gb * 2**30)}) for gb in args.staging_gb]
        if args.host_checksums_too:
            variants.append(("cold, crc32c on the host", None, {"check_on_device": False}))
        for name, threads, loader_kw in variants:
            use_read_threads(threads or (args.read_threads[0] if args.read_threads else None))
            with loader_defaults(**loader_kw):
                if "staging_bytes" in loader_kw:  # once untimed first: new staging buffers are pinned as first written
                    run(kw, loaded, store, "lazy", zipf[:args.step_log], questions, cache, args.batch_size)
                out["step_log"][name] = step_log_run(kw, loaded, store, zipf[:args.step_log], questions, cache,
                                                     args.batch_size, False)
            save(out)
        use_read_threads(args.read_threads[0] if args.read_threads else None)
    if args.check_shared:
        out["shared_check"] = shared_check(kw, loaded, store, zipf[:args.check_shared], questions[:args.check_shared],
                                           cache, args.batch_size)
        save(out)
        print(f"[{model}] chunk-major against per-request pages: {json.dumps(out['shared_check'])}", flush=True)
    if args.host_tier:
        host_tier_runs(kw, loaded, store, zipf, questions, args.host_tier, args, model, save, out)
    if args.recompute:
        out["batch_sweep"] = batch_sweep(kw, loaded, store, zipf, questions, cache, args, model, save, out,
                                         uniform if args.uniform_too else None)
        return out
    if args.only_lazy_at or args.host_tier:
        for gb in args.only_lazy_at:
            r = run(kw, loaded, store, "lazy", zipf, questions, gb, args.batch_size)
            out["closed"].append(r)
            save(out)
            print(f"[{model}] lazy at {gb} GB: {json.dumps(r)}", flush=True)
        return out
    # Runs in one process get faster as they go (docs/benchmarks.md: lazy timed six times on the
    # same requests went from 23.6 to 40.3 req/s), so lazy and block alternate for --rounds
    # rounds and the last round is the result; the earlier ones are kept in the JSON.
    out["earlier_rounds"] = []

    def alternate(workload: str, prompts: list) -> None:
        for rnd in range(1, args.rounds + 1):
            for mode in ("lazy", "block"):
                r = run(kw, loaded, store, mode, prompts, questions, cache, args.batch_size)
                r["round"] = rnd
                (out[workload] if rnd == args.rounds else out["earlier_rounds"]).append(dict(r, workload=workload))
                save(out)
                print(f"[{model}] {workload} {mode} round {rnd}: {json.dumps(r)}", flush=True)

    alternate("closed", zipf)
    def closed_again(key: str, engine_args: dict, warm: bool = False) -> None:
        """The closed Zipf runs once more, lazy and block, with one thing changed."""
        out[key] = []
        for mode in ("lazy", "block"):
            r = run(engine_args, loaded, store, mode, zipf, questions, cache, args.batch_size, warm=warm)
            out[key].append(r)
            save(out)
            print(f"[{model}] closed {mode} {key}: {json.dumps(r)}", flush=True)

    if args.eager_too:  # without CUDA graphs: what replaying the decode step buys
        closed_again("eager", dict(kw, cuda_graphs=False))
    if args.warm:  # on a cache warmed by one untimed pass
        closed_again("warm", kw, warm=True)
    if not args.skip_full:
        m = min(n, args.full_requests)
        r = run(kw, loaded, store, "full", zipf[:m], questions[:m], cache, args.batch_size)
        out["closed"].append(r)
        save(out)
        print(f"[{model}] closed full: {json.dumps(r)}", flush=True)
    alternate("uniform", uniform)
    lazy_rate = out["closed"][0]["req_per_s"]
    for frac in args.rates:
        rate = frac * lazy_rate
        gaps = random.Random(2)
        arrivals, t = [], 0.0
        for _ in range(args.poisson_requests):
            t += gaps.expovariate(rate)
            arrivals.append(t)
        m = args.poisson_requests
        for mode in ("lazy", "block"):
            r = run(kw, loaded, store, mode, zipf[:m], questions[:m], cache, args.batch_size, arrivals)
            r["rate_req_s"] = round(rate, 3)
            out["poisson"].append(r)
            save(out)
            print(f"[{model}] poisson {rate:.2f}/s {mode}: {json.dumps(r)}", flush=True)
    per_doc_gb = index["tokens_total"] / DOCS * loaded.cfg.num_layers * 2 * loaded.cfg.num_kv_heads \
        * loaded.cfg.head_dim * 2 / 2**30
    for docs in args.sweep_docs:
        gb = docs * per_doc_gb * 1.05 + args.batch_size * 0.01
        for mode in ("lazy", "block"):
            try:
                r = run(kw, loaded, store, mode, zipf, questions, gb, args.batch_size)
            except Exception as exc:  # too small for block's copies: say so
                r = {"mode": mode, "cache_gb": round(gb, 2), "error": str(exc)[:120]}
            r["cache_docs"] = docs
            out["sweep"].append(r)
            save(out)
            print(f"[{model}] sweep {docs} docs ({gb:.1f} GB) {mode}: {json.dumps(r)}", flush=True)
    del loaded
    free_cache()
    return out


def host_tier_runs(kw: dict, loaded, store, prompts, questions, gpu_docs: int, args, model, save, out) -> list:
    """Lazy on the Zipf requests with a GPU cache of `gpu_docs` documents' worth (and a batch's own
    pages), without and with a pinned host tier that holds every document. An untimed run with the
    tier first pins its buffers (kept by the process, as a long-running `answer` keeps them), so the
    timed runs measure serving."""
    page, row_bytes = store.settings.page_size, store.settings.row_bytes
    doc_bytes = store.max_padded_length() * row_bytes  # one chunk per document
    own_bytes = -(-(QUESTION_TOKENS + NEW_TOKENS) // page) * page * row_bytes
    gpu_gb = (gpu_docs * doc_bytes + args.batch_size * own_bytes + page * row_bytes) * 1.05 / 2**30
    host_gb = DOCS * doc_bytes * 1.1 / 2**30
    if has_cuda():
        run(dict(kw, host_cache_bytes=host_gb * 2**30), loaded, store, "lazy", prompts, questions, gpu_gb,
            args.batch_size)
    out["host_tier"] = []
    for host in (0.0, host_gb):
        r = run(dict(kw, host_cache_bytes=host * 2**30), loaded, store, "lazy", prompts, questions, gpu_gb,
                args.batch_size)
        r["cache_docs"] = gpu_docs
        out["host_tier"].append(r)
        save(out)
        print(f"[{model}] host tier {host:.2f} GB, GPU cache {gpu_gb:.2f} GB: {json.dumps(r)}", flush=True)
    return out["host_tier"]


def table(results: list[dict]) -> str:
    lines = ["| model | workload | mode | requests | TTFT mean / p50 / p95 ms | req/s | out tok/s | hit ratio "
             "| KV peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        short = res["model"].split(":")[-1]
        for label, rows in (("zipf 2.1 closed", res["closed"]), ("zipf 2.1 closed, eager", res.get("eager", [])),
                            ("zipf 2.1 closed, warm cache", res.get("warm", [])),
                            ("uniform closed", res["uniform"]), ("zipf 2.1 poisson", res["poisson"]),
                            ("zipf 2.1 closed, GPU cache below the working set", res.get("host_tier", []))):
            for r in rows:
                t = r["ttft_ms"]
                wl = label + (f" {r['rate_req_s']}/s" if "rate_req_s" in r else "")
                wl += f" ({r['cache_gb']:.2f} GB, host tier {r['host_cache_gb']:.2f} GB)" if "cache_docs" in r else ""
                lines.append(f"| {short} | {wl} | {r['mode']} | {r['requests']} | {t['mean']:.0f} / {t['p50']:.0f} / "
                             f"{t['p95']:.0f} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.0f} | "
                             f"{r['hit_ratio']:.2f} | {r['kv_peak_gb']:.1f} |")
        tier = res.get("host_tier", [])
        if len(tier) == 2:
            lines.append(f"| {short} | **ratio** host tier | with vs without | | TTFT mean "
                         f"{tier[0]['ttft_ms']['mean'] / tier[1]['ttft_ms']['mean']:.2f}x "
                         f"| {tier[1]['req_per_s'] / tier[0]['req_per_s']:.2f}x | | | |")
        closed = {r["mode"]: r for r in res["closed"]}
        uni = {r["mode"]: r for r in res["uniform"]}
        if "block" not in closed or "block" not in uni:  # a diagnosis run (--only-lazy-at): no ratios
            continue
        lz, bl = closed["lazy"], closed["block"]
        fu = closed.get("full", {"ttft_ms": {"mean": float("nan")}, "req_per_s": float("nan")})
        lines.append(f"| {short} | **ratios** zipf | lazy vs block / full | | TTFT mean "
                     f"{bl['ttft_ms']['mean'] / lz['ttft_ms']['mean']:.2f}x / {fu['ttft_ms']['mean'] / lz['ttft_ms']['mean']:.2f}x "
                     f"| {lz['req_per_s'] / bl['req_per_s']:.2f}x / {lz['req_per_s'] / fu['req_per_s']:.2f}x | | | |")
        lines.append(f"| {short} | **ratios** uniform | lazy vs block | | TTFT mean "
                     f"{uni['block']['ttft_ms']['mean'] / uni['lazy']['ttft_ms']['mean']:.2f}x "
                     f"| {uni['lazy']['req_per_s'] / uni['block']['req_per_s']:.2f}x | | | |")
    return "\n".join(lines)


def reads_table(results: list[dict]) -> str:
    """Each run's wait on chunk reads against its wall time, and where its misses came from."""
    lines = ["| model | workload | mode | GPU / host cache GB | s | read wait s | read wait share | GB read "
             "| misses read ahead | host tier hits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for label, key in (("zipf 2.1 closed", "closed"), ("uniform closed", "uniform"),
                           ("GPU cache below the working set", "host_tier")):
            for r in res.get(key, []):
                lines.append(f"| {res['model'].split(':')[-1]} | {label} | {r['mode']} | {r['cache_gb']:.1f} / "
                             f"{r['host_cache_gb']:.1f} | {r['seconds']:.2f} | {r['read_wait_s']:.2f} | "
                             f"{r['read_wait_s'] / r['seconds']:.0%} | {r['bytes_read_gb']:.1f} | "
                             f"{r['read_ahead']} | {r['host_hits']} |")
    return "\n".join(lines)


def profile_table(results: list[dict]) -> str:
    """The profiled runs: how busy the GPU was (summed, and the time some kernel ran), its
    host-to-device copy time, the host's waits."""
    lines = ["| model | run | req/s | s | GPU busy (summed over streams) | some kernel running | H2D copies s "
             "| host sync waits s |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, p in res.get("profile", {}).items():
            running = f"{p['kernels_busy_share']:.0%}" if "kernels_busy_share" in p else "-"
            lines.append(f"| {res['model'].split(':')[-1]} | {name} | {p['req_per_s']:.1f} | {p['seconds']:.2f} | "
                         f"{p['gpu_busy_share']:.0%} | {running} | {p['h2d_copy_s']:.3f} | {p['host_sync_wait_s']:.3f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(path.read_text())["results"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        for mode in ("lazy", "block"):
            rows = [r for r in res["sweep"] if r["mode"] == mode and "error" not in r]
            if not rows:
                continue
            x = [r["cache_gb"] for r in rows]
            label = f"{res['model'].split(':')[-1]} {mode}"
            axes[0].plot(x, [r["hit_ratio"] for r in rows], marker="o", label=label)
            axes[1].plot(x, [r["ttft_ms"]["mean"] for r in rows], marker="o", label=label)
    axes[0].set(xlabel="cache budget (GB)", ylabel="chunk hit ratio", title="hit ratio, Zipf 2.1")
    axes[1].set(xlabel="cache budget (GB)", ylabel="mean TTFT (ms)", title="TTFT, Zipf 2.1 closed batch",
                yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(__file__).resolve().parent.parent / "docs" / "cache_sweep.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    global DOCS, DOC_TOKENS
    from lazyrag.config import IndexConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="random:llama3.2-1b,random:llama3-8b")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--full-requests", type=int, default=64, help="full mode recomputes 10k-token prompts")
    ap.add_argument("--poisson-requests", type=int, default=100)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.3, 0.6, 0.9],
                    help="arrival rates as fractions of lazy's closed-batch throughput")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--skip-block", action="store_true", help="the batch sweep without block's rows")
    ap.add_argument("--rounds", type=int, default=2, help="closed runs (Zipf, uniform): lazy and block alternate "
                                                            "this many times; the last round is reported")
    ap.add_argument("--sweep-docs", type=lambda s: [int(x) for x in s.split(",") if x], default=[5, 10, 20, 50, 100],
                    help="cache budgets, in documents' worth of KV")
    ap.add_argument("--cache-gb", type=float, default=60.0)
    ap.add_argument("--only-lazy-at", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                    help="diagnosis: after the warm-up, only time lazy on the Zipf requests at these "
                         "cache budgets (GB), in this order (e.g. 60,26.6,60,26.6: size or order?)")
    ap.add_argument("--host-tier", type=int, default=0, metavar="DOCS",
                    help="diagnosis: after the warm-up, time lazy on the Zipf requests with a GPU cache of DOCS "
                         "documents' worth, without and then with a pinned host tier (the engine's "
                         "--host-cache-gb) that holds every document; then only the --only-lazy-at runs (or, with "
                         "--recompute, the batch sweep)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also run lazy and block on N Zipf requests under torch.profiler (GPU busy share, "
                         "host-to-device copy time, host waits, top kernels) before the timed runs, with the last "
                         "--recompute fraction if any; cold, and with --warm also the timed pass of a warm run")
    ap.add_argument("--read-threads", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="chunk reads at once (the loader's reader process): the batch sweep runs at the first, "
                         "and its cold lazy Zipf rows again at each other; with --profile, lazy is profiled cold "
                         "at each (block and warm at the first only, block not with --skip-block); with "
                         "--step-log, a cold run again at each other")
    ap.add_argument("--step-log", type=int, default=0, metavar="N",
                    help="diagnosis: also run lazy on N Zipf requests, cold then warm, with the engine's host phases "
                         "timed without a profiler (each prefill step's start, host time and size, decode steps, "
                         "waits for the GPU, chunk loads per 100 ms)")
    ap.add_argument("--staging-gb", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                    help="with --step-log, a cold run again with the loader reading ahead up to each of these "
                         "many GB not yet loaded (its staging buffers; default 4)")
    ap.add_argument("--host-checksums-too", action="store_true",
                    help="also run each cold lazy Zipf count of the batch sweep (and, with --step-log, a cold "
                         "run) with the chunks' crc32c checked in the reader process instead of on the GPU")
    ap.add_argument("--lookahead-too", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="also run each cold lazy Zipf count of the batch sweep with the scheduler reading ahead for, "
                         "and admitting from, this many waiting requests (default: a batch's worth, at least 64)")
    ap.add_argument("--trace", action="store_true",
                    help="with --profile, also write each profiled run's trace (cold and warm) to "
                         "$OUT/trace-<run>.json.gz (Chrome trace format), the engine's host phases labelled")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--recompute", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                    help="only the batch sweep: lazy (no recompute), full, then lazy and block at each of these "
                         "recompute fractions (0: plain block), each at every --batch-sizes value")
    ap.add_argument("--recompute-policy", default="attention")
    ap.add_argument("--sweep-requests", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="the batch sweep at each of these request counts (default: --requests)")
    ap.add_argument("--from-disk", action="store_true",
                    help="the batch sweep's cold lazy Zipf rows once more, last, with the store's files first "
                         "dropped from the OS page cache (posix_fadvise), each beside the disk's own rate "
                         "(dd over the store's segment files, dropped again) and the bound it sets")
    ap.add_argument("--uniform-too", action="store_true",
                    help="the batch sweep's lazy rows also on requests of uniform popularity")
    ap.add_argument("--check-shared", type=int, default=0, metavar="N",
                    help="first compare chunk-major attention with per-request pages on N Zipf requests (logits "
                         "teacher-forced along the per-request answer, top-1 agreement, identical answers)")
    ap.add_argument("--eager-prefill-too", action="store_true",
                    help="diagnosis: also time each lazy run (cold, and warm with --warm) with prefill steps "
                         "launched op by op, not replayed from CUDA graphs")
    ap.add_argument("--per-request-too", action="store_true",
                    help="in the batch sweep, also lazy without chunk-major attention (each request reads its pages), "
                         "with and without recompute")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 32, 64, 128])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs anywhere (the engine's --eager)")
    ap.add_argument("--serial-chunk-major", action="store_true",
                    help="diagnosis: the chunk-major kernel on the request kernels' stream, its partial outputs "
                         "in fp32 (what overlapping them and halving the partials' bytes buys end to end)")
    ap.add_argument("--warm", action="store_true",
                    help="after the closed Zipf rounds (in the batch sweep: after the cold runs, those without "
                         "recompute), time lazy and block once more on a cache warmed by an untimed pass over the "
                         "same requests (a long-running server's steady state)")
    ap.add_argument("--eager-too", action="store_true",
                    help="after the closed Zipf rounds, time lazy and block once more without CUDA graphs")
    ap.add_argument("--gc-unfrozen", action="store_true",
                    help="diagnosis: the engine's runs without freezing the objects alive before them "
                         "(lazyrag/serve/frozen.py), so Python's full collections walk them all")
    ap.add_argument("--kv-dtype", default="auto", help="the store's KV dtype, as `index --kv-dtype` takes it")
    ap.add_argument("--page-size", type=int, default=IndexConfig.page_size, help="the store's page size (tokens)")
    ap.add_argument("--docs", type=int, default=DOCS)
    ap.add_argument("--doc-tokens", type=int, default=DOC_TOKENS)
    ap.add_argument("--plot", type=Path, help="draw docs/cache_sweep.png from a results file and exit")
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot)
    DOCS, DOC_TOKENS = args.docs, args.doc_tokens
    import torch

    if args.gc_unfrozen:
        from lazyrag.serve import engine

        engine.objects_frozen = contextlib.nullcontext
    if args.serial_chunk_major:
        from lazyrag.kernels import shared_attention
        shared_attention.SIDE_STREAM = shared_attention.HALF_PARTIALS = False

    out_dir().mkdir(parents=True, exist_ok=True)
    results = []
    info = {"gpu": torch.cuda.get_device_name() if has_cuda() else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv)}
    def save(partial: dict | None = None) -> None:
        done = results + ([partial] if partial else [])
        (out_dir() / "bench_e2e.json").write_text(json.dumps({"info": info, "results": done}, indent=1))

    for model in args.models.split(","):
        # each model's store is deleted once its runs are done: an 8B store is tens of GB
        with tempfile.TemporaryDirectory(prefix="lazyrag-e2e-") as root:
            results.append(bench_model(model, args, Path(root), save))
        save()
    text = sweep_table(results) if args.recompute else table(results) + "\n\n" + reads_table(results)
    text += ("\n\n" + profile_table(results)) if profile_table(results) else ""
    print(text)
    (out_dir() / "bench_e2e.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
