#!/usr/bin/env python
"""How store reads slow the step loop: the host time of a run of small CUDA launches (a
prefill's host side) while chunk-sized reads run beside it, on threads or in a process.

Each read is what the loader does: a 256 MB range of a file in the page cache, into a pinned
buffer, in pieces on reader threads, each piece checksummed (lazyrag/store/parallel_reads.py).
Prints one table row per setting: microseconds per launch on the main thread, and the reads' rate.

Usage: python scripts/bench_read_contention.py [--gib 8] [--launches 6000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

CHUNK = 256 << 20


def read_loop(path: str, stop: threading.Event, chunk_threads: int, piece_threads: int, piece: int,
              pinned: bool, counter: list[int]) -> None:
    import torch

    from lazyrag.store.parallel_reads import ParallelReads

    reads = ParallelReads(piece_threads, piece_bytes=piece)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size

    def read_into(view, offset):
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], offset + done)

    def one(k: int) -> None:
        buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=pinned)
        view = memoryview(buf.numpy())
        off = (k * CHUNK) % (size - CHUNK)
        while not stop.is_set():
            reads.read(read_into, view, off)
            counter[0] += CHUNK
            off = (off + chunk_threads * CHUNK) % (size - CHUNK)

    with ThreadPoolExecutor(chunk_threads) as pool:
        list(pool.map(one, range(chunk_threads)))
    reads.close()


def launches(n: int) -> float:
    import torch

    x = torch.randn(16, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n // 3):
        y = x @ w
        y = y.add(1.0)
        x = y.mul(0.001)
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--launches", type=int, default=30000)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # the reads in a process of their own, until killed
        path, ct, pt, piece, pinned = args.child
        read_loop(path, threading.Event(), int(ct), int(pt), int(piece), pinned == "1", [0])
        return
    import torch

    fd, path = tempfile.mkstemp(prefix="contention-", dir="/tmp")
    block = os.urandom(64 << 20)
    with os.fdopen(fd, "wb") as f:
        for _ in range(int(args.gib * 16)):
            f.write(block)
    launches(args.launches)  # warm up
    rows = [("none", launches(args.launches), 0.0)]
    for label, ct, pt, piece, pinned, proc in [
            ("threads 4x16, 4 MB pieces, pinned", 4, 16, 4 << 20, True, False),
            ("threads 4x8, 4 MB pieces, pinned", 4, 8, 4 << 20, True, False),
            ("threads 8x1, whole chunk, pinned", 8, 1, CHUNK, True, False),
            ("threads 4x16, 4 MB pieces, pageable", 4, 16, 4 << 20, False, False),
            ("process 4x16, 4 MB pieces", 4, 16, 4 << 20, False, True)]:
        counter, stop = [0], threading.Event()
        if proc:
            child = subprocess.Popen([sys.executable, __file__, "--child", path, str(ct), str(pt), str(piece), "0"])
            time.sleep(2.0)
            us = launches(args.launches)
            child.kill()
            rate = float("nan")
        else:
            th = threading.Thread(target=read_loop, args=(path, stop, ct, pt, piece, pinned, counter))
            th.start()
            time.sleep(1.0)
            c0, t0 = counter[0], time.perf_counter()
            us = launches(args.launches)
            rate = (counter[0] - c0) / (time.perf_counter() - t0) / 1e9
            stop.set()
            th.join()
        rows.append((label, us, rate))
    os.unlink(path)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs")
    print("| reads beside the launches | us per launch | x alone | reads GB/s |\n|---|---|---|---|")
    for label, us, rate in rows:
        print(f"| {label} | {us:.1f} | {us / rows[0][1]:.2f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
