"""Store throughput: append (write), and chunk reads as the engine's loader makes them.

Builds a store of random KV with a real model's geometry, then compares in one run:

  dd          `dd` reading the segment files after they are dropped from the page cache
              (posix_fadvise DONTNEED, no root needed): the disk's own sequential speed
  cold        every chunk, in random order, through the store's read path (pieces read in
              parallel and checksummed) after the same drop, at each --threads count
  zarr        the same chunks through zarr's own slicing, cold
  page cache  every chunk from the OS page cache, at each --threads count
  append      Store.append, the write path (one thread, from page-aligned memory as `index` writes)

and, with --bounds, what bounds a read from the page cache, at each --threads count:

  memcpy      host memory to host memory (numpy's copy on each thread): the memory system's rate
  files       the segment files' bytes from the page cache in pieces, no store in between, with
              and without each piece's crc32c: what the checksum costs
  beside H2D  the same file reads, without and with crc32c, while another thread copies pinned
              memory to the GPU without pause, as a cold run's loads do (CUDA only), and the
              copies' own rate beside the reads without crc32c (answer's reads on a GPU)
  GPU crc32c  the loader's check on the GPU (device_crc32c) over an 8B chunk's 264 MiB, beside a
              device-to-device copy of the same bytes (HBM: bytes read and written)
  first read  one thread reading 256 MiB of the files into a fresh mapping of a memfd whose pages
              exist (a staging buffer as the reader process first sees it): its pages faulted in
              one by one under the read, or mapped at once (MAP_POPULATE, as the reader process
              maps its buffers; the mapping's time counted), beside the same read again

Reads land in pinned host memory when CUDA is available (pageable otherwise), one buffer per
chunk in flight; --chunk-readers chunks are read at once (default 1, so a row's threads are all
the threads reading; the loader reads 4 at once), each split into pieces on the threads.
Figures are GB/s (1e9 bytes).

Usage: python scripts/bench_store.py [--gib 4] [--layers 32 --kv-heads 8 --head-dim 128] [--threads 1,4,8,16] [--bounds]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np
import torch
import zarr

from lazyrag.store import NewChunk, SegmentReader, Store, StoreSettings, chunk_id_for, storage_dtype, torch_dtype
from lazyrag.store.file_writes import aligned_empty
from lazyrag.store.format import SEGMENT_MARKER
from lazyrag.store.parallel_reads import PIECE_BYTES, ParallelReads


def evict(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def segment_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "segments").rglob("*")
                  if p.is_file() and p.name not in ("zarr.json", SEGMENT_MARKER))


def dd_gb_s(files: list[Path]) -> float:
    """`dd` over every file, by the seconds dd itself reports (no process start-up counted)."""
    total, seconds = 0, 0.0
    for f in files:
        run = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], capture_output=True, text=True,
                             check=True)
        m = re.search(r"^(\d+) bytes.*copied, ([\d.,e+-]+) s", run.stderr, re.MULTILINE)
        total += int(m.group(1))
        seconds += float(m.group(2).replace(",", "."))
    return total / seconds / 1e9 if seconds else float("nan")


BOUNDS_BUFFER = 1 << 30  # where bound rows land: larger than any CPU cache, as a chunk's staging is


def threaded_gb_s(threads: int, jobs: list, work) -> float:
    """GB/s of ``work(job) -> bytes`` over every job on ``threads`` threads."""
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, jobs[: threads]))  # start the threads and warm their first pages untimed
        t = time.perf_counter()
        done = sum(ex.map(work, jobs))
    return done / (time.perf_counter() - t) / 1e9


def bounds(files: list[Path], threads: list[int], piece: int, pinned: bool) -> dict:
    """Rates that bound a page-cache read (see the module's docstring), each at every thread count."""
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    pieces = [(f, off, min(piece, f.stat().st_size - off)) for f in files for off in range(0, f.stat().st_size, piece)]
    jobs = list(enumerate(pieces))
    slots = min(len(pieces), BOUNDS_BUFFER // piece)
    dest = torch.empty(slots * piece, dtype=torch.uint8)
    dest = dest.pin_memory() if pinned else dest
    dest_np = dest.numpy()
    dest_np[:] = 0  # every page present before anything is timed

    def read(job, crc: bool) -> int:
        i, (f, off, n) = job
        view = memoryview(dest_np)[(i % slots) * piece:][:n]
        got = os.preadv(fds[f], [view], off)
        if crc:
            crc32c.crc32c(view)
        return got

    source = np.ones(dest_np.size, dtype=np.uint8)
    copies = [(i % slots) * piece for i in range(len(pieces))]

    def memcpy(at: int) -> int:
        np.copyto(dest_np[at: at + piece], source[at: at + piece])
        return piece

    out: dict = {}
    for f in files:  # every file in the page cache
        os.posix_fadvise(fds[f], 0, 0, os.POSIX_FADV_WILLNEED)
    threaded_gb_s(max(threads), jobs, lambda j: read(j, False))
    for n in threads:
        out[f"memcpy_{n}"] = threaded_gb_s(n, copies, memcpy)
        out[f"files_{n}"] = threaded_gb_s(n, jobs, lambda j: read(j, False))
        out[f"files_crc_{n}"] = threaded_gb_s(n, jobs, lambda j: read(j, True))
        if pinned:  # answer's reads (checked on the GPU), then with the host check `check` makes
            out[f"files_beside_h2d_{n}"], out[f"h2d_beside_{n}"] = beside_h2d(
                lambda: threaded_gb_s(n, jobs, lambda j: read(j, False)))
            out[f"files_crc_beside_h2d_{n}"], _ = beside_h2d(lambda: threaded_gb_s(n, jobs, lambda j: read(j, True)))
    out.update(first_read_gb_s(pieces, fds))
    if pinned:
        out["h2d_alone"] = beside_h2d(lambda: time.sleep(1.0) or 0.0)[1]
        out["gpu_crc32c"], out["gpu_copy_hbm"] = gpu_check_gb_s()
    for fd in fds.values():
        os.close(fd)
    return out


def first_read_gb_s(pieces: list, fds: dict, nbytes: int = 256 << 20) -> dict:
    """GB/s of one thread's reads of the files' first ``nbytes`` into a fresh shared mapping of a
    memfd whose pages exist: faulted in under the read, mapped at once first, and read again."""
    fd = os.memfd_create("bench-staging", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    owner = mmap.mmap(fd, nbytes)
    owner.write(b"\0" * nbytes)  # the pages exist, as a pinned staging buffer's do
    jobs, total = [], 0  # (file, its offset, bytes, where they land)
    for f, off, n in pieces:
        if total >= nbytes:
            break
        jobs.append((f, off, min(n, nbytes - total), total))
        total += jobs[-1][2]

    def read_into(view: mmap.mmap) -> None:
        for f, off, n, at in jobs:
            os.preadv(fds[f], [memoryview(view)[at: at + n]], off)

    def timed(flags: int) -> tuple[float, mmap.mmap]:
        t = time.perf_counter()
        view = mmap.mmap(fd, nbytes, flags=flags)
        read_into(view)
        return total / (time.perf_counter() - t) / 1e9, view

    out = {}
    out["first_read_faulted"], _ = timed(mmap.MAP_SHARED)
    out["first_read_populated"], mapped = timed(mmap.MAP_SHARED | mmap.MAP_POPULATE)
    t = time.perf_counter()
    read_into(mapped)
    out["read_again"] = total / (time.perf_counter() - t) / 1e9
    owner.close()
    os.close(fd)
    return out


def beside_h2d(measure) -> tuple[float, float]:
    """``measure()`` while another thread copies 256 MiB of pinned memory to the GPU again and again;
    its result and the copies' GB/s meanwhile."""
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    stream = torch.cuda.Stream()
    stop = threading.Event()
    copied = [0, 0.0]

    def copy() -> None:
        with torch.cuda.stream(stream):
            t = time.perf_counter()
            while not stop.is_set():
                dst.copy_(src, non_blocking=True)
                stream.synchronize()
                copied[0] += src.numel()
            copied[1] = time.perf_counter() - t

    th = threading.Thread(target=copy)
    th.start()
    time.sleep(0.2)  # the copies under way first
    result = measure()
    stop.set()
    th.join()
    return result, copied[0] / copied[1] / 1e9


def gpu_check_gb_s(nbytes: int = 264 << 20, reps: int = 10) -> tuple[float, float]:
    """GB/s of device_crc32c over ``nbytes``, and of a device copy of them counted as bytes read
    plus written (what HBM moves), timed with CUDA events after a warm-up."""
    from lazyrag.serve.device_checksums import device_crc32c, scratch_words

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(data)

    def timed(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    scratch = torch.empty(scratch_words(data.numel()), dtype=torch.int32, device=data.device)  # as the loader's
    crc_s = timed(lambda: device_crc32c(data, scratch))
    copy_s = timed(lambda: copy.copy_(data))
    return nbytes / crc_s / 1e9, 2 * nbytes / copy_s / 1e9


def print_bounds(b: dict, threads: list[int]) -> None:
    rows = [("memcpy", "memcpy"), ("page cache, no crc32c", "files"), ("page cache, crc32c", "files_crc"),
            ("page cache, beside H2D", "files_beside_h2d"), ("H2D beside those reads", "h2d_beside"),
            ("page cache, crc32c, beside H2D", "files_crc_beside_h2d")]
    print(f"{'GB/s':32s}" + "".join(f"{n:>8d}" for n in threads))
    for label, key in rows:
        if f"{key}_{threads[0]}" in b:
            print(f"{label:32s}" + "".join(f"{b[f'{key}_{n}']:8.2f}" for n in threads))
    for label, key in [("first read, faulted page by page", "first_read_faulted"),
                       ("first read, mapped at once", "first_read_populated"), ("read again", "read_again")]:
        print(f"{label:32s}{b[key]:8.2f}")
    if "h2d_alone" in b:
        print(f"{'H2D alone':32s}{b['h2d_alone']:8.2f}")
    if "gpu_crc32c" in b:
        print(f"{'crc32c on the GPU':32s}{b['gpu_crc32c']:8.2f}")
        print(f"{'GPU copy (HBM read + write)':32s}{b['gpu_copy_hbm']:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temp dir under the cwd)")
    ap.add_argument("--gib", type=float, default=4.0, help="store size")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--chunks-per-segment", type=int, default=16)
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 8, 16],
                    help="piece threads to measure, each a row (cold and page cache)")
    ap.add_argument("--piece-mib", type=float, default=PIECE_BYTES / 2**20, help="the largest piece")
    ap.add_argument("--chunk-readers", type=int, default=1,
                    help="chunks read at once (1: each row's threads are all the threads reading)")
    ap.add_argument("--bounds", action="store_true",
                    help="also measure memcpy, raw file reads with and without crc32c, and reads beside H2D copies")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    s = StoreSettings(
        model="bench", fingerprint="bench", kv_dtype=args.kv_dtype, num_layers=args.layers,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page,
        chunking={"chunk_tokens": args.chunk_tokens}, encoding={"attend": "preamble+self"},
    )
    sdt = storage_dtype(s.kv_dtype)
    row_bytes = s.row_bytes
    lengths_rng = random.Random(0)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_store.", dir="."))
    path = base / "bench.zarr"
    pinned = torch.cuda.is_available()
    results: dict = {"geometry": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                   "kv_dtype": args.kv_dtype, "kib_per_token": row_bytes / 1024,
                                   "chunk_tokens": args.chunk_tokens, "page": args.page},
                     "reads": {"buffers": "pinned" if pinned else "pageable", "piece_mib": args.piece_mib,
                               "chunk_readers": args.chunk_readers, "cpus": os.cpu_count()}}

    # -- build ----------------------------------------------------------------
    target = int(args.gib * 2**30)
    written = 0
    write_s = 0.0
    n_chunks = 0
    noise = np.random.default_rng(0).integers(0, 2**15, size=2**22, dtype=np.uint16).view(sdt)
    with Store.create_or_open(path, s) as st:
        while written < target:
            chunks, rows = [], 0
            for _ in range(args.chunks_per_segment):
                n = lengths_rng.randint(args.chunk_tokens * 3 // 4, args.chunk_tokens)
                ids = tuple(range(n_chunks * 100_000, n_chunks * 100_000 + n))
                chunks.append(NewChunk(chunk_id_for(s, ids), f"doc{n_chunks}", 0, ids, ""))
                rows += s.padded(n)
                n_chunks += 1
            # in page-aligned memory, as `index` hands its batches over (written with O_DIRECT)
            kv = aligned_empty(rows * row_bytes).view(sdt).reshape(rows, *s.row_shape)
            kv.reshape(-1)[:] = np.resize(noise, kv.size)
            t = time.perf_counter()
            st.put_documents(chunks)  # one document per chunk: readers see a chunk once a document lists it
            st.append(chunks, kv)
            write_s += time.perf_counter() - t
            written += kv.nbytes
    results["store"] = {"path": str(path), "chunks": n_chunks, "bytes": written}
    results["append_GBps"] = written / write_s / 1e9

    with Store.open(path) as st:
        infos = list(st.iter_chunks())
    shuffled = infos[:]
    random.Random(1).shuffle(shuffled)
    total = sum(c.padded_length for c in infos) * row_bytes
    max_rows = max(c.padded_length for c in infos)
    buffers: queue.SimpleQueue = queue.SimpleQueue()  # one per chunk in flight: two reads never share one
    for _ in range(args.chunk_readers):
        buf = torch.empty((max_rows, *s.row_shape), dtype=torch_dtype(s.kv_dtype))
        buffers.put(buf.pin_memory() if pinned else buf)

    def read_all(reader: SegmentReader) -> float:
        """GB/s reading every chunk (random order) with `reader`, --chunk-readers at once."""
        def one(c) -> None:
            buf = buffers.get()
            try:
                reader.read_kv(c, out=buf[: c.padded_length])
            finally:
                buffers.put(buf)

        t = time.perf_counter()
        with ThreadPoolExecutor(args.chunk_readers) as ex:
            list(ex.map(one, shuffled))
        return total / (time.perf_counter() - t) / 1e9

    evict(path)
    results["dd_cold_GBps"] = dd_gb_s(segment_files(path))
    piece_bytes = int(args.piece_mib * 2**20)
    for n in args.threads:
        reads = ParallelReads(threads=n, piece_bytes=piece_bytes)
        reader = SegmentReader(path, s, reads=reads)
        for c in {c.segment: c for c in infos}.values():  # open each segment (metadata, shard index) untimed
            reader.read_kv(c)
        evict(path)
        results[f"cold_{n}threads_GBps"] = read_all(reader)
        read_all(reader)  # every chunk in the page cache now
        results[f"page_cache_{n}threads_GBps"] = read_all(reader)
        reader.close()
        reads.close()

    evict(path)
    arrays = {}
    t = time.perf_counter()
    for c in shuffled:
        arr = arrays.get(c.segment) or arrays.setdefault(
            c.segment, zarr.open_array(str(path / "segments" / c.segment), mode="r"))
        arr[c.offset : c.offset + c.padded_length]
    results["zarr_cold_GBps"] = total / (time.perf_counter() - t) / 1e9

    if args.bounds:
        results["bounds"] = bounds(segment_files(path), args.threads, piece_bytes, pinned)

    best_cold = max(results[f"cold_{n}threads_GBps"] for n in args.threads)
    results["best_cold_vs_dd"] = best_cold / results["dd_cold_GBps"]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            if k == "bounds":
                print_bounds(v, args.threads)
            else:
                print(f"{k:32s} {v:.2f}" if isinstance(v, float) else f"{k:32s} {v}")
    if not args.dir:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
