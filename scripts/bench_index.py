#!/usr/bin/env python
"""Indexing speed against its two ceilings, measured in the same run:
  bare forward  the model over the same chunks in the same batches, nothing written
  disk          `dd oflag=direct` sequential writes to the store's filesystem of as many bytes as index
                writes, one stream and as many at once as index's writer threads (the better of the two),
                measured right before and right after the index run, as tokens/s of what index writes
                (each chunk's rows padded to whole pages)
Target: index tokens/s >= 90% of the lesser, the disk taken as the mean of its speed before and after
(the disk's speed moves by a quarter from minute to minute on the H200 machine; the ratio against the
faster of the two is printed too). Also: store bytes on disk against raw KV bytes, and the index
run's timeline (batches off the GPU, segment writes, and the fsyncs and catalog commits in them).

Usage: python scripts/bench_index.py --model random:llama3-8b --dtype bf16 --docs 64 --doc-tokens 2048
       python scripts/bench_index.py            # CPU, default model, a small synthetic corpus
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lazyrag.commands import index
from lazyrag.commands.index import ChunkEncoder, PageBatches, build_index, chunk_corpus, pages_per_batch, \
    store_settings
from lazyrag.config import IndexConfig
from lazyrag.corpus import read_corpus
from lazyrag.models import load_model
from lazyrag.serve.paged import pages_for
from lazyrag.store import Store, file_writes
from lazyrag.store.storage import LocalStorage

import trace_gaps  # scripts/trace_gaps.py, beside this one


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synthetic_corpus(path: Path, docs: int, chars: int) -> None:
    rng = random.Random(0)
    vocab = ["the", "river", "flows", "north", "city", "was", "founded", "in", "year", "and", "its", "people",
             "built", "a", "bridge", "across", "valley", "where", "trade", "grew", "."]
    with open(path, "w") as fh:
        for i in range(docs):
            text = " ".join(rng.choice(vocab) for _ in range(chars // 5))
            fh.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")


class Timeline:
    """When index's batches came off the GPU and when its segments were written (host clock),
    recorded by wrapping the two calls its writer threads make."""

    def __init__(self):
        self.copies: list[tuple[float, float]] = []
        self.writes: list[tuple[float, float]] = []
        # within the writes: every fsync (each may flush the disk's cache under the other writers'
        # writes; dd flushes once a stream) and the catalog commits (SQLite's own fsync inside)
        self.fsyncs: list[tuple[float, float]] = []
        self.commits: list[tuple[float, float]] = []

    def wrap(self, fn, spans):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans.append((t0, time.perf_counter()))
        return timed

    def summary(self, t0: float, t_end: float) -> str:
        if not self.writes:
            return "no writes"
        spans = sorted(self.writes)
        first, last = spans[0][0], max(b for _, b in spans)
        model_done = max(b for _, b in self.copies)
        first_copy = min(self.copies)
        at_once = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(writes_at_once(spans).items()) if k)
        durations = sorted(b - a for a, b in spans)
        return (f"first batch off the GPU {first_copy[0] - t0:.2f}-{first_copy[1] - t0:.2f} s; first write began "
                f"{first - t0:.2f} s; last batch off the GPU {model_done - t0:.2f} s; from first to last write "
                f"({last - first:.2f} s) writes under way at once: {at_once}; a segment's write took "
                f"{durations[0]:.2f}-{durations[-1]:.2f} s (median {durations[len(durations) // 2]:.2f}); "
                f"{spent(self.fsyncs, 'fsyncs')}, {spent(self.commits, 'catalog commits')}; last write "
                f"done {last - t0:.2f} s; index returned {t_end - t0:.2f} s")


def spent(spans: list[tuple[float, float]], what: str) -> str:
    """How many calls, their seconds summed over the writer threads, and the longest."""
    if not spans:
        return f"no {what}"
    took = [b - a for a, b in spans]
    return f"{len(took)} {what} ({sum(took):.2f} s summed, longest {max(took) * 1e3:.0f} ms)"


def writes_at_once(spans: list[tuple[float, float]]) -> dict[int, float]:
    """Seconds during which k writes were under way, for each k, between the first start and last end."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    seconds: dict[int, float] = {}
    k, at = 0, events[0][0]
    for t, step in events:
        seconds[k] = seconds.get(k, 0.0) + t - at
        k, at = k + step, t
    return seconds


def synchronizing_calls(fn) -> str:
    """The places in fn that make the host wait for the GPU (torch's sync debug mode), counted and
    named: each one drains the GPU's queue, so a batch is launched only once the last has run."""
    if not torch.cuda.is_available():
        return "n/a (CPU)"
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = sorted({f"{'/'.join(Path(w.filename).parts[-3:])}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message)})
    return f"{len(found)} places" + (f": {', '.join(found[:4])}" if found else "")


def traced(run, name: str) -> str:
    """``run`` under torch.profiler with the model thread's phases labelled (the profiler records no
    labels on the writer threads; the timeline row times them); the trace goes to
    $OUT/trace-index-<name>.json.gz and the GPU's busy and idle time by phase is returned
    (scripts/trace_gaps.py)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from lazyrag.commands.index import BatchWriter, ChunkEncoder

    targets = [(ChunkEncoder, "encode"), (index, "stored_rows"), (BatchWriter, "put")]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in targets]

    def labelled(fn, label):
        def wrapped(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return wrapped

    for owner, attr, fn in originals:
        setattr(owner, attr, labelled(fn, f"lazyrag.{attr}"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with profile(activities=activities) as prof:
            run()
            sync()
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    out = Path(os.environ.get("OUT", "."), f"trace-index-{name}.json")
    prof.export_chrome_trace(str(out))
    with open(out, "rb") as src, gzip.open(f"{out}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    out.unlink()
    return trace_gaps.summarize(trace_gaps.load(Path(f"{out}.gz")))


def disk_speed_mb_s(directory: Path, mb: int) -> tuple[float, float]:
    """The disk's sequential write speed over `mb` MB: one dd stream, and as many as index's writers."""
    return disk_write_mb_s(directory, mb), disk_write_mb_s(directory, mb, index.WRITER_THREADS)


def disk_write_mb_s(directory: Path, mb: int, streams: int = 1) -> float:
    """The disk's sequential write speed: `mb` MB in all, `dd oflag=direct conv=fsync` in `streams`
    processes at once (index writes that many segments at a time)."""
    count = max(1, mb // 16 // streams)
    targets = [directory / f"dd{i}.bin" for i in range(streams)]
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={p}", "bs=16M", f"count={count}", "oflag=direct",
                               "conv=fsync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in targets]
    ok = all(p.wait() == 0 for p in procs)
    secs = time.perf_counter() - t
    for p in targets:
        p.unlink(missing_ok=True)
    return streams * count * 16 * 2**20 / secs / 1e6 if ok else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=IndexConfig.model)
    ap.add_argument("--device", default=IndexConfig.device)
    ap.add_argument("--kv-dtype", "--dtype", dest="dtype", default=IndexConfig.dtype,
                    help="the store's KV dtype, as `index --kv-dtype` takes it")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=512, help="roughly, for the default model (5 bytes a token)")
    ap.add_argument("--chunk-tokens", type=int, default=IndexConfig.chunk_tokens)
    ap.add_argument("--batch-tokens", type=int, default=IndexConfig.batch_tokens)
    ap.add_argument("--writers", type=int, default=index.WRITER_THREADS, help="index's writer threads")
    ap.add_argument("--piece-mb", type=int, default=file_writes.PIECE >> 20,
                    help="bytes of each O_DIRECT write, in MiB (dd writes 16)")
    ap.add_argument("--dir", type=Path, default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--trace", action="store_true",
                    help="after the timed runs, the bare forward and index again under torch.profiler: their "
                         "traces in $OUT and, for each, the GPU's busy and idle time by host phase (trace_gaps)")
    args = ap.parse_args()
    index.WRITER_THREADS = args.writers
    if os.environ.get("OUT"):  # written into at the end of a long run: made now
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    file_writes.PIECE = args.piece_mb << 20

    root = Path(args.dir or tempfile.mkdtemp(prefix="lazyrag-bench-index-"))
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.jsonl"
    synthetic_corpus(corpus, args.docs, args.doc_tokens * 5)
    cfg = IndexConfig(corpus=corpus, store=root / "s.zarr", model=args.model, device=args.device, dtype=args.dtype,
                      chunk_tokens=args.chunk_tokens, batch_tokens=args.batch_tokens)
    loaded = load_model(cfg.model, cfg.device, cfg.dtype)
    ps = cfg.page_size
    settings = store_settings(loaded, cfg.model, cfg.chunk_tokens, ps)
    t_chunk = time.perf_counter()
    chunks = [c for doc in chunk_corpus(read_corpus(corpus), loaded.tokenizer, settings).values() for c in doc]
    chunk_s = time.perf_counter() - t_chunk  # index chunks as it goes: its first batch should not wait for this
    tokens = sum(len(c.token_ids) for c in chunks)
    batch_pages = pages_per_batch(cfg, settings)
    encoder = ChunkEncoder(loaded, list(settings.preamble_ids), ps, batch_pages)
    batches = list(PageBatches(chunks, batch_pages, ps))
    encoder.encode([list(c.token_ids) for c in batches[0]])  # warm-up (Triton compilation)
    sync()
    one_batch = [list(c.token_ids) for c in batches[1 % len(batches)]]
    syncs = synchronizing_calls(lambda: index.stored_rows(encoder.encode(one_batch), settings))

    def bare_forward(encoder: ChunkEncoder) -> float:
        t = time.perf_counter()
        for b in batches:
            encoder.encode([list(c.token_ids) for c in b])
        sync()
        return time.perf_counter() - t

    bare_s = bare_forward(encoder)
    del encoder  # index makes its own page pool

    # dd writes what index will write: a short dd runs at a speed a long write does not keep
    row_bytes = settings.row_bytes
    mb = max(256, sum(pages_for(len(c.token_ids), ps) for c in chunks) * ps * row_bytes // 2**20)
    disk_before = disk_speed_mb_s(root, mb)
    encode, encode_at = ChunkEncoder.encode, []

    def timed_encode(*a, **k):  # when index's first batch starts: before it, the store, the first chunks
        encode_at.append(time.perf_counter())
        return encode(*a, **k)

    ChunkEncoder.encode = timed_encode
    timeline = Timeline()
    index.aligned_host_copy = timeline.wrap(index.aligned_host_copy, timeline.copies)
    index.DeviceToHost.copy = timeline.wrap(index.DeviceToHost.copy, timeline.copies)
    Store.append = timeline.wrap(Store.append, timeline.writes)
    os.fsync = timeline.wrap(os.fsync, timeline.fsyncs)  # in this process only, as the wraps above
    LocalStorage.commit_append = timeline.wrap(LocalStorage.commit_append, timeline.commits)
    t = time.perf_counter()
    result = build_index(cfg, progress=False, loaded=loaded)
    sync()
    index_s = time.perf_counter() - t
    timeline_row = timeline.summary(t, t + index_s)
    setup_s = encode_at[0] - t
    with Store.open(cfg.store) as store:
        summary = store.summary()
        per_token = store.settings.row_bytes  # as stored: an fp8 row carries its scales
        kv_dtype = store.settings.kv_dtype
    raw = summary["padded_tokens"] * per_token
    disk_after = disk_speed_mb_s(root, mb)
    best_before, best_after = max(disk_before), max(disk_after)  # the better of one stream and several
    disk_mb_s = (best_before + best_after) / 2
    # the disk's time is that of the bytes index writes: each chunk's rows padded to whole pages
    written_per_token = raw / tokens
    disk_tok_s = disk_mb_s * 1e6 / written_per_token
    fastest_tok_s = max(best_before, best_after) * 1e6 / written_per_token
    bare_tok_s, index_tok_s = tokens / bare_s, tokens / index_s
    bound = min(bare_tok_s, disk_tok_s)
    device = torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu"
    rows = [
        ("model / KV dtype / device", f"{args.model} / {kv_dtype} / {device}"),
        ("chunks / tokens", f"{len(chunks)} / {tokens:,}"),
        ("KV per token: a row / written (pages padded)", f"{per_token:,} / {written_per_token:,.0f} bytes"),
        ("bare forward", f"{bare_tok_s:,.0f} tok/s"),
        ("calls that wait for the GPU in one batch (encode and quantise)", syncs),
        ("batches (pages each)", f"{len(batches)}: {', '.join(str(sum(len(c.token_ids) for c in b) // ps) for b in batches)}"),
        (f"disk write before index ({mb:,} MB, dd oflag=direct, 1 / {index.WRITER_THREADS} at once)",
         f"{disk_before[0]:,.0f} / {disk_before[1]:,.0f} MB/s"),
        (f"disk write after index (the same)", f"{disk_after[0]:,.0f} / {disk_after[1]:,.0f} MB/s"),
        ("disk, mean of the better before and after", f"{disk_mb_s:,.0f} MB/s = {disk_tok_s:,.0f} tok/s of KV"),
        ("index (build_index, model loaded)", f"{index_tok_s:,.0f} tok/s"),
        ("index / min(forward, disk)", f"{index_tok_s / bound:.1%} (target >= 90%)"),
        ("index / min(forward, the faster disk)", f"{index_tok_s / min(bare_tok_s, fastest_tok_s):.1%}"),
        ("the corpus chunked alone", f"{chunk_s:.2f} s ({tokens / chunk_s:,.0f} tok/s)"),
        ("where index's time went", f"{index_s:.1f} s: {setup_s:.2f} s before the first batch; the model waited {result.write_wait_s:.1f} s for writers "
                                    f"(a free one, then the last writes); writers, summed over threads: {result.writer_copy_s:.1f} s copying "
                                    f"off the GPU, {result.writer_store_s:.1f} s storing"),
        ("index's timeline", timeline_row),
        ("store on disk / raw KV", f"{summary['bytes'] / 1e6:,.1f} MB / {raw / 1e6:,.1f} MB = "
                                   f"{summary['bytes'] / raw:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if args.trace:
        shutil.rmtree(cfg.store)  # the traced index writes as much again
        runs = {"bare": lambda: bare_forward(ChunkEncoder(loaded, list(settings.preamble_ids), ps, batch_pages)),
                "index": lambda: build_index(cfg, progress=False, loaded=loaded)}
        for name, run in runs.items():
            print(f"\n## {name}, under the profiler\n{traced(run, name)}")
    if not args.dir:  # an 8B store is tens of GB
        shutil.rmtree(root, ignore_errors=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_index.md").write_text(
            "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n")


if __name__ == "__main__":
    main()
