"""Store throughput: append (write) and read_kv (the cache-loading hot path).

Builds a store of random KV with a real model's geometry, evicts its files from the
page cache (posix_fadvise DONTNEED, so no root needed), then compares in one run:

  disk      plain sequential reads of the segment files (8 MiB reads): the baseline
  pread     bare os.preadv of the same byte ranges read_kv reads, in random order
  read_kv   Store.read_kv over every chunk, in storage order and in random order,
            into one reused (optionally pinned) buffer, and from several threads
  zarr      the same chunks through zarr's own slicing (arr[offset:offset+padded])

Usage: python scripts/bench_store.py [--gib 4] [--layers 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zarr

from lazyrag.store import NewChunk, SegmentReader, Store, StoreSettings, chunk_id_for, storage_dtype, torch_dtype


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
    return sorted(p for p in (path / "segments").rglob("*") if p.is_file() and p.name != "zarr.json")


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
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--pin", action="store_true", help="read into pinned host memory (needs CUDA)")
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
    results: dict = {"geometry": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                   "kv_dtype": args.kv_dtype, "kib_per_token": row_bytes / 1024,
                                   "chunk_tokens": args.chunk_tokens, "page": args.page}}

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
            kv = np.resize(noise, rows * row_bytes // sdt.itemsize).reshape(rows, *s.row_shape)
            t = time.perf_counter()
            st.put_documents(chunks)  # one document per chunk: readers see a chunk once a document lists it
            st.append(chunks, kv)
            write_s += time.perf_counter() - t
            written += kv.nbytes
    results["store"] = {"path": str(path), "chunks": n_chunks, "bytes": written}
    results["append_MBps"] = written / write_s / 1e6

    with Store.open(path) as st:
        infos = list(st.iter_chunks())
        max_rows = max(c.padded_length for c in infos)
        buf = torch.empty((max_rows, *s.row_shape), dtype=torch_dtype(s.kv_dtype))
        if args.pin:
            buf = buf.pin_memory()

        def run(label: str, order: list, threads: int = 1) -> None:
            evict(path)
            # one buffer per thread: a buffer shared by two reads in flight fails their checksums
            spare = [buf] + [torch.empty_like(buf) for _ in range(threads - 1)]
            mine = threading.local()

            def read(c) -> None:
                if not hasattr(mine, "buf"):
                    mine.buf = spare.pop()
                st.read_kv(c, out=mine.buf[: c.padded_length])

            t = time.perf_counter()
            if threads == 1:
                for c in order:
                    read(c)
            else:
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(read, order))
            dt = time.perf_counter() - t
            total = sum(c.padded_length for c in order) * row_bytes
            results[label] = total / dt / 1e6

        # baseline: the disk's sequential read speed over the same files
        evict(path)
        files = segment_files(path)
        chunk = bytearray(8 << 20)
        t = time.perf_counter()
        total = 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while (n := fh.readinto(chunk)):
                    total += n
        results["disk_seq_MBps"] = total / (time.perf_counter() - t) / 1e6

        # the same byte ranges as read_kv_random, with bare preads: read_kv's own overhead
        shuffled = infos[:]
        random.Random(1).shuffle(shuffled)
        # the store opens each segment (metadata, shard index) once; do it now so the
        # timed read_kv runs below measure reads only
        for c in {c.segment: c for c in infos}.values():
            st.read_kv(c, out=buf[: c.padded_length])
        evict(path)
        reader = SegmentReader(path, s)
        raw = bytearray(max_rows * row_bytes)
        fds = {}
        total = 0
        t = time.perf_counter()
        for c in shuffled:
            file, start, nbytes = reader.byte_range(c)
            fd = fds.get(file) or fds.setdefault(file, os.open(file, os.O_RDONLY))
            os.preadv(fd, [memoryview(raw)[:nbytes]], start)
            total += nbytes
        results["pread_random_MBps"] = total / (time.perf_counter() - t) / 1e6
        reader.close()
        for fd in fds.values():
            os.close(fd)

        run("read_kv_seq_MBps", infos)
        run("read_kv_random_MBps", shuffled)
        run(f"read_kv_random_{args.threads}threads_MBps", shuffled, threads=args.threads)

        evict(path)
        arrays = {}
        t = time.perf_counter()
        for c in shuffled:
            arr = arrays.get(c.segment) or arrays.setdefault(
                c.segment, zarr.open_array(str(path / "segments" / c.segment), mode="r"))
            arr[c.offset : c.offset + c.padded_length]
        results["zarr_slice_random_MBps"] = sum(c.padded_length for c in shuffled) * row_bytes / (time.perf_counter() - t) / 1e6

        # warm page cache: what read_kv costs when the disk is out of the picture
        for c in infos:
            st.read_kv(c, out=buf[: c.padded_length])
        t = time.perf_counter()
        for c in infos:
            st.read_kv(c, out=buf[: c.padded_length])
        results["read_kv_cached_MBps"] = sum(c.padded_length for c in infos) * row_bytes / (time.perf_counter() - t) / 1e6

    results["read_kv_vs_disk"] = results["read_kv_random_MBps"] / results["disk_seq_MBps"]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            print(f"{k:32s} {v:.1f}" if isinstance(v, float) else f"{k:32s} {v}")
    if not args.dir:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
