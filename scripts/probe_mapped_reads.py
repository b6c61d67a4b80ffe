"""Can a chunk go from the page cache to the GPU without a staging copy?

Today a cold read is two copies: pread out of the page cache into a pinned staging buffer (the
reader process), then that buffer to the GPU. Registering the file's mapped pages with CUDA
(cudaHostRegister, read-only) lets the GPU's copy engine read the page cache itself. This
probe times, on a file the page cache holds, for 1 to 8 threads at once:
- staged: pread into a pinned buffer, then the copy to the GPU (the loader's path);
- registered: register the chunk's mapped range, copy it to the GPU, unregister;
- pageable: the copy to the GPU straight from the mapping, unregistered (the driver stages it);
- registered once: the whole file registered first, then copies alone.
It prints each way's GB/s and, for registered, what registering and unregistering cost a chunk.
The raw rates favour registering (docs/benchmarks.md, "Tried and not kept"); a cold run reading
that way was slower all the same.
Usage: python3 scripts/probe_mapped_reads.py [--chunks 16] [--chunk-mb 256] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

READ_ONLY = 8  # cudaHostRegisterReadOnly


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (ctypes calls release the GIL)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        raise SystemExit("no libcudart mapped in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def make_file(path: Path, nbytes: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        step = 64 << 20
        for start in range(0, nbytes, step):
            f.write(rng.integers(0, 2**63, size=min(step, nbytes - start) // 8, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:  # resident in the page cache
        while f.read(64 << 20):
            pass


def run(threads: int, chunks: int, work) -> float:
    """Seconds for `chunks` chunks spread over `threads` threads, each calling work(i, thread_state)."""
    local = threading.local()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: work(i, local), range(chunks)))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-mb", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--threads", default="1,2,4,8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_mapped_reads.py needs a CUDA GPU")
    warnings.filterwarnings("ignore", message=".*non-writable.*")
    lib = cudart()
    dev = torch.device("cuda")
    chunk = args.chunk_mb << 20
    size = chunk * args.chunks
    path = args.dir / "lazyrag-probe-mapped.bin"
    make_file(path, size)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    host = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    base = host.data_ptr()
    rows, detail = [], {}
    # whether a read-only file mapping can be registered at all (without the read-only flag CUDA
    # refuses it: invalid argument, left as the thread's last error for torch's next check to raise)
    err = lib.cudaHostRegister(base, chunk, READ_ONLY)
    detail["register_read_only"] = err and lib.cudaGetErrorString(err).decode()
    if err:
        raise SystemExit(f"cudaHostRegister(read-only) of a file mapping refused: {detail['register_read_only']}")
    lib.cudaHostUnregister(base)
    threads = [int(t) for t in args.threads.split(",")]
    outs = [torch.empty(chunk, dtype=torch.uint8, device=dev) for _ in range(max(threads))]

    owner: dict[int, int] = {}
    lock = threading.Lock()

    def slot(local) -> tuple[torch.cuda.Stream, int]:
        """The calling thread's stream and its index (its device buffer, its pinned buffer)."""
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(dev)
        with lock:
            return local.stream, owner.setdefault(threading.get_ident(), len(owner))

    # staged: pread into a pinned buffer, then the copy
    pinned = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(max(threads))]

    def staged(i, local):
        s, k = slot(local)
        buf = pinned[k]
        view = memoryview(buf.numpy())
        got = 0
        while got < chunk:
            got += os.preadv(fd, [view[got:]], i * chunk + got)
        with torch.cuda.stream(s):
            outs[k].copy_(buf, non_blocking=True)
        s.synchronize()

    times: dict[str, list[float]] = {"register": [], "copy": [], "unregister": []}
    errors: set[int] = set()

    def registered(i, local):
        s, k = slot(local)
        ptr = base + i * chunk
        t0 = time.perf_counter()
        err = lib.cudaHostRegister(ptr, chunk, READ_ONLY)
        t1 = time.perf_counter()
        if err:
            errors.add(err)
            return
        with torch.cuda.stream(s):
            outs[k].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)
        s.synchronize()
        t2 = time.perf_counter()
        lib.cudaHostUnregister(ptr)
        t3 = time.perf_counter()
        with lock:
            times["register"].append(t1 - t0)
            times["copy"].append(t2 - t1)
            times["unregister"].append(t3 - t2)

    def from_mapping(i, local):  # pageable, or registered once
        s, k = slot(local)
        with torch.cuda.stream(s):
            outs[k].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)
        s.synchronize()

    for name, work in (("staged", staged), ("registered", registered), ("pageable", from_mapping)):
        for n in threads:
            owner.clear()
            for key in times:
                times[key].clear()
            run(n, min(n, args.chunks), work)  # warm-up: streams, first registrations
            owner.clear()
            for key in times:
                times[key].clear()
            seconds = run(n, args.chunks, work)
            row = {"way": name, "threads": n, "GB/s": size / seconds / 1e9 if not errors else None}
            if name == "registered" and times["register"]:
                for key in times:
                    row[f"{key}_ms"] = 1e3 * statistics.median(times[key])
            if name == "registered" and errors:
                row["errors"] = sorted(f"{e}: {lib.cudaGetErrorString(e).decode()}" for e in errors)
            rows.append(row)
            print(row, flush=True)

    # registered once, whole file: the registration's own rate, then copies alone
    t0 = time.perf_counter()
    err = lib.cudaHostRegister(base, size, READ_ONLY)
    t1 = time.perf_counter()
    detail["whole_register_s"] = t1 - t0
    detail["whole_register_error"] = err
    if not err:
        for n in threads:
            owner.clear()
            seconds = run(n, args.chunks, from_mapping)
            rows.append({"way": "registered once", "threads": n, "GB/s": size / seconds / 1e9})
            print(rows[-1], flush=True)
        # the bytes the GPU got are the file's
        outs[0].copy_(host[:chunk])
        detail["bytes_match"] = bool(torch.equal(outs[0][: 1 << 20].cpu(), host[: 1 << 20]))
        t2 = time.perf_counter()
        lib.cudaHostUnregister(base)
        detail["whole_unregister_s"] = time.perf_counter() - t2
    detail["file_GB"] = size / 1e9
    detail["chunk_MB"] = chunk / 1e6
    print(json.dumps(detail))
    out = Path(os.environ.get("OUT", "."))
    (out / "probe_mapped_reads.json").write_text(json.dumps({"rows": rows, "detail": detail}, indent=1))
    print(f"\n{'way':<16}{'threads':>8}{'GB/s':>8}{'reg ms':>9}{'copy ms':>9}{'unreg ms':>9}")
    for r in rows:
        gbs = f"{r['GB/s']:.1f}" if r["GB/s"] else "-"
        print(f"{r['way']:<16}{r['threads']:>8}{gbs:>8}" + "".join(
            f"{r[k]:>9.1f}" if k in r else f"{'':>9}" for k in ("register_ms", "copy_ms", "unregister_ms")))
    del host
    mapping.close()
    os.close(fd)
    path.unlink()


if __name__ == "__main__":
    main()
