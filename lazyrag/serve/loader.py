"""Chunk I/O: getting a chunk's KV from the store (or the host tier) into pool pages.

The look-ahead names the chunks coming requests need, in the order to read them. Reads
start in that order while the bytes read ahead and not yet loaded stay within a budget (the
staging buffers they land in), and every load that consumes one starts the next, so the store
is read while the GPU works. At most half the cores' worth of chunks are read at once
(`chunk_read_threads`), each by the reader process (lazyrag/store/read_process.py) in pieces,
which writes the staging buffers it shares with this one (lazyrag/serve/staging.py): on an H200 machine (16 cores) 8
reader threads in the serving process slowed the step loop's launches 1.5x, the same reads in
another process not at all (scripts/bench_read_contention.py). On a GPU a read ends on the GPU:
its reader thread copies the bytes there on a stream of its own, into one of the buffers made
with the loader (DeviceCopies), and checks their crc32c there (lazyrag/serve/device_checksums.py),
which leaves the reader process's cores a copy out of the page cache per byte and no checksum
pass; a corrupt chunk fails its read as on the host. Loading it then writes it into its pages
(kernels.rows_to_pages) on the loader's copy stream, which waits for nothing on the
compute stream: the pages it fills are free, so no kernel in flight reads them (the engine drains
the GPU before it frees pages a failed step may still touch). Compute waits only for the copy of
a chunk it is about to read (`after_copy`).
An optional host-memory tier keeps recently read chunks, so a chunk evicted from the pool comes
back without the disk: it keeps the staging buffer the chunk was read into and gives staging
one back when it evicts, so the host copies nothing. What to load and when is the chunk
cache's business (lazyrag/serve/cache.py); this module only moves bytes and reports what each
load cost.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import crc32c
import torch

from lazyrag.serve.device_checksums import aligned_words, device_checks_work, device_crc32c, scratch_words
from lazyrag.serve.memory import available_bytes
from lazyrag.serve.paged import PagePool
from lazyrag.serve.staging import STAGING_BYTES, Slot, Staging, staging_shape
from lazyrag.store import ChunkInfo, Store, rows_dtype
from lazyrag.store.integrity import Warn, warn_stderr
from lazyrag.store.read_process import SharedBuffer, shared_read_process


@dataclass
class LoadReport:
    """What one load cost, for the cache's counters."""

    host_hit: bool = False    # served by the host tier, not the disk
    read_ahead: bool = False  # served by a read the look-ahead had started
    read_wait_s: float = 0.0  # waiting on the disk read (or a prefetch still in flight)
    bytes_read: int = 0       # from the store on disk
    bytes_to_gpu: int = 0     # copied into the pool
    copied: torch.cuda.Event | None = None  # the copy's event (GPU): compute reading the pages waits for it


class Loader(Protocol):
    """What the chunk cache needs from its I/O."""

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        """The chunks coming requests need, none in the pool, in the order to read them;
        each call replaces the last one's list."""

    def reading(self, chunk_id: str) -> bool:
        """Whether the chunk's read has started and not finished: loading it now would wait."""

    def queued(self, chunk_id: str) -> bool:
        """Whether the chunk's read waits its turn behind reads under way: it starts as they are
        loaded, without a load asking for it."""

    def finished(self) -> list[ChunkInfo]:
        """The look-ahead's chunks that loading now waits for nothing for, not loaded yet: reads
        done (in the look-ahead's order), then chunks the host tier keeps."""

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport:
        """Write the chunk's KV into `pages` (free pages: nothing in flight reads them)."""

    def after_copy(self, copied: torch.cuda.Event | None) -> None:
        """Compute queued from now on runs after this copy (a LoadReport's `copied`)."""

    def settle(self, copied: torch.cuda.Event | None) -> None:
        """Wait until this copy has run (before its pages go to anyone else)."""

    def close(self) -> None: ...


@dataclass
class _Kept:
    """A chunk in the host tier: its KV, the staging buffer holding it (GPU only), the event of its
    last copy to the GPU, and what it costs the tier's budget."""

    kv: torch.Tensor
    buf: SharedBuffer | None
    copied: torch.cuda.Event | None
    cost: int


@dataclass
class _HostTier:
    budget: int
    used: int = 0
    entries: OrderedDict[str, _Kept] = field(default_factory=OrderedDict)

    def get(self, chunk_id: str) -> _Kept | None:
        kept = self.entries.get(chunk_id)
        if kept is not None:
            self.entries.move_to_end(chunk_id)
        return kept

    def put(self, chunk_id: str, kept: _Kept) -> list[_Kept]:
        """Keep a chunk (its cost at most the budget); return the entries evicted for it."""
        evicted = []
        old = self.entries.pop(chunk_id, None)
        if old is not None:
            self.used -= old.cost
            evicted.append(old)
        while self.used + kept.cost > self.budget:
            _, lru = self.entries.popitem(last=False)
            self.used -= lru.cost
            evicted.append(lru)
        self.entries[chunk_id] = kept
        self.used += kept.cost
        return evicted


def pin_staging_ahead(store: Store, device: torch.device, staging_bytes: int = STAGING_BYTES) -> None:
    """On a GPU, start pinning the first staging buffers a loader over ``store`` uses on a thread of
    their own: two per chunk read at once, within its budget and at most one per stored chunk (each
    is a memfd, so not the whole budget of small chunks). `answer` and `bench` call this before
    their model loads, so that a fresh process does not pin them under its first reads (about 3 s
    for an 8B model's 4 GB on an H200 machine); pinned beside the engine's graph capture instead,
    they slowed the capture by as much as they saved (scripts/bench_first_pass.py)."""
    nbytes, count = staging_shape(store, staging_bytes)
    if device.type == "cuda" and nbytes:
        threads = chunk_read_threads()
        Staging.pin_ahead(nbytes, min(count, store.num_chunks, 2 * threads), device,
                          share=shared_read_process(threads).share)


class DeviceCopies:
    """Buffers on the pool's device that staged reads are copied into and checked in, each with
    the memory its crc32c works in and a host word its result lands in, all made with the loader:
    a device allocation under a cold run waits for every copy in flight, and memory allocated on a
    reader thread's stream is not shared with the others (each made device segments of its own for
    the crc32c's levels: 16-18 a cold run on an H200). Every buffer and every level of its
    crc32c starts 64-byte aligned, so the kernel's one compiled variant serves them all. A read
    takes a buffer (none free: it is checked on the host); its load gives it back with the event of
    the copy out of it, which the next read's copy into it waits for on the device."""

    def __init__(self, nbytes: int, count: int, device: torch.device):
        self.nbytes, self.count = nbytes, count
        self.stride, self.words = self.sizes(nbytes)
        self.memory = torch.empty(count * self.stride, dtype=torch.uint8, device=device)
        self.scratch = torch.empty(count * self.words, dtype=torch.int32, device=device)
        self.results = torch.empty(count, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.free: deque[tuple[int, torch.cuda.Event | None]] = deque((i, None) for i in range(count))
        self._lock = threading.Lock()

    @staticmethod
    def sizes(nbytes: int) -> tuple[int, int]:
        """One buffer's bytes and its crc32c's int32 words, each rounded up so that the next one
        starts 64-byte aligned too."""
        return -(-nbytes // 64) * 64, aligned_words(scratch_words(nbytes))

    @staticmethod
    def bytes_each(nbytes: int) -> int:
        """Device bytes one buffer of ``nbytes`` takes, its crc32c's working memory included."""
        stride, words = DeviceCopies.sizes(nbytes)
        return stride + 4 * words

    def take(self) -> tuple[int, torch.cuda.Event | None] | None:
        with self._lock:
            return self.free.popleft() if self.free else None

    def buffer(self, index: int, nbytes: int) -> torch.Tensor:
        return self.memory[index * self.stride: index * self.stride + nbytes]

    def crc32c(self, index: int, nbytes: int) -> torch.Tensor:
        """The crc32c of buffer ``index``'s first ``nbytes`` queued on the current stream, in its own
        working memory, and its copy to the host queued after it: the one-element host tensor it
        lands in, to read once the stream has run."""
        crc = device_crc32c(self.buffer(index, nbytes), self.scratch[index * self.words: (index + 1) * self.words])
        result = self.results[index: index + 1]
        result.copy_(crc, non_blocking=True)
        return result

    def give(self, index: int, copied: torch.cuda.Event | None = None) -> None:
        with self._lock:
            self.free.append((index, copied))

    def close(self) -> None:
        """Wait for the copies out of the buffers: their memory goes back to torch after this."""
        with self._lock:
            for _, copied in self.free:
                if copied is not None:
                    copied.synchronize()


@dataclass
class _Read:
    """One chunk read: started by the look-ahead (a future) or on demand."""

    info: ChunkInfo
    slot: Slot | None  # None: read into pageable memory
    nbytes: int
    buf: SharedBuffer | None = None  # the staging buffer, once the reader has it
    future: Future | None = None
    on_device: torch.Tensor | None = None  # its bytes on the pool's device, checked there
    copy: int | None = None  # the DeviceCopies buffer holding on_device


def chunk_read_threads() -> int:
    """Chunk reads at once: half the cores (at most 8), at least 2, so the step loop keeps a core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, min(8, cores // 2))


class ChunkLoader:
    """Reads chunks from the store into pool pages (the `Loader` the engine uses).

    read_threads: chunk reads at once (default: chunk_read_threads());
    staging_bytes: the most bytes read ahead and not yet loaded (the staging buffers, one per
    chunk, made when first used; on a GPU each such read also holds its copy there, in buffers
    made with the loader within a quarter of the memory free: past them, reads are checked on
    the host);
    check_on_device: check a staged read's crc32c on the pool's device (default: on a GPU), not in
    the reader process, once known bytes' crc32c there is found right (else ``warn`` says why)."""

    def __init__(self, store: Store, pool: PagePool, host_cache_bytes: float = 0, read_threads: int | None = None,
                 staging_bytes: int = STAGING_BYTES, check_on_device: bool | None = None, warn: Warn = warn_stderr):
        self.store, self.pool = store, pool
        self.check_on_device = pool.kv.is_cuda if check_on_device is None else check_on_device
        self._thread = threading.local()  # a reader thread's CUDA stream
        nbytes, count = staging_shape(store, staging_bytes)
        if self.check_on_device:
            why_not = device_checks_work(pool.kv.device, largest=nbytes)
            if why_not is not None:
                warn(f"{why_not}; chunk reads are checked on the host instead")
                self.check_on_device = False
        self.device_copies = None
        if self.check_on_device and nbytes:
            # within a quarter of the memory free, so that they never take the steps' working memory
            room = available_bytes(pool.kv.device) if pool.kv.is_cuda else None
            room = min(staging_bytes, room // 4) if room is not None else staging_bytes
            copies = min(room // DeviceCopies.bytes_each(nbytes), count, store.num_chunks)
            if copies:
                self.device_copies = DeviceCopies(nbytes, copies, pool.kv.device)
        self.host = _HostTier(int(host_cache_bytes))
        threads = read_threads or chunk_read_threads()
        # these threads only wait: the reads themselves run in the reader process
        self.reader = ThreadPoolExecutor(threads, thread_name_prefix="lazyrag-read")
        self.process = shared_read_process(threads)
        self.process.start()
        self.pending: dict[str, _Read] = {}  # reads started by the look-ahead and not loaded yet
        self.wanted: list[ChunkInfo] = []    # the look-ahead's chunks not started yet, in its order
        self.kept_wanted: dict[str, ChunkInfo] = {}  # the look-ahead's chunks the host tier keeps
        self.budget, self.ahead_bytes = staging_bytes, 0
        self.stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        self.row_bytes = store.settings.row_bytes  # fp8 rows carry their scales: the loader moves both
        self.staging = None
        if nbytes:  # reads deeper than the buffers wait for one to come back
            self.staging = Staging(nbytes, count, pin=pool.kv.is_cuda)

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        """Read ahead the chunks coming requests need (none in the pool), in that order: chunks in
        flight are skipped, those the host tier keeps are offered by `finished` (their loads read
        nothing), the rest start while the budget allows. A finished
        read no coming request needs any more (its request failed) gives its bytes back."""
        needed = {info.chunk_id for info in infos}
        for read in [r for cid, r in self.pending.items() if cid not in needed and r.future.done()]:
            del self.pending[read.info.chunk_id]
            self.ahead_bytes -= read.nbytes
            self._give_back(read)
        wanted, kept, seen = [], {}, set()
        for info in infos:
            cid = info.chunk_id
            if cid in seen or cid in self.pending:
                continue
            seen.add(cid)
            if cid in self.host.entries:  # a check, not a use: no LRU touch
                kept[cid] = info
            else:
                wanted.append(info)
        self.wanted, self.kept_wanted = wanted, kept
        self._start_wanted()

    def reading(self, chunk_id: str) -> bool:
        read = self.pending.get(chunk_id)
        return read is not None and not read.future.done()

    def queued(self, chunk_id: str) -> bool:
        return (any(info.chunk_id == chunk_id for info in self.wanted)
                and any(not read.future.done() for read in self.pending.values()))

    def finished(self) -> list[ChunkInfo]:
        done = [read.info for read in self.pending.values() if read.future.done()]
        return done + [info for cid, info in self.kept_wanted.items() if cid in self.host.entries]

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport:
        """Write the chunk's KV into `pages`; nothing waits for the copy until `after_copy`."""
        report = LoadReport()
        self.kept_wanted.pop(info.chunk_id, None)
        kept = self.host.get(info.chunk_id)
        if kept is not None:
            report.host_hit = True
            kept.copied = report.copied = self._to_pool(kept.kv, pages)
            host = kept.kv
        else:
            host, read = self._wait_read(info, report)
            from_device = read.on_device is not None
            try:
                report.copied = self._to_pool(read.on_device if from_device else host, pages)
            finally:
                if from_device:  # the next read into this buffer waits for the copy out of it
                    self.device_copies.give(read.copy, report.copied)
                    read.on_device = read.copy = None
            # a copy from the device copy leaves the buffer free: the reader thread already waited for its reads
            self._keep(info.chunk_id, host, read.buf, None if from_device else report.copied)
        report.bytes_to_gpu = host.numel() * host.element_size()
        self._start_wanted()  # a buffer may have come back
        return report

    def after_copy(self, copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            torch.cuda.current_stream().wait_event(copied)

    def settle(self, copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()

    def _to_pool(self, kv: torch.Tensor, pages: list[int]) -> torch.cuda.Event | None:
        """Copy into the pool (from the host, or from a copy on the device) on the copy stream; the
        copy's event."""
        if self.stream is None:
            self.pool.write_tokens(pages, kv)
            return None
        with torch.cuda.stream(self.stream):
            self.pool.write_tokens(pages, kv)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return copied

    def _start_wanted(self) -> None:
        """Start wanted reads, in order, while the bytes ahead stay within the budget (at least one
        read runs) and, on a GPU, a staging buffer is free."""
        started = 0
        for info in self.wanted:
            nbytes = info.padded_length * self.row_bytes
            if self.pending and self.ahead_bytes + nbytes > self.budget:
                break
            staged = self.staging is not None and nbytes <= self.staging.nbytes
            slot = self.staging.take() if staged else None
            if staged and slot is None:
                break  # every buffer holds a chunk not loaded yet (or one still being copied)
            read = self.pending[info.chunk_id] = _Read(info, slot, nbytes)
            read.future = self.reader.submit(self._read, read)
            self.ahead_bytes += nbytes
            started += 1
        del self.wanted[:started]

    def _read(self, read: _Read) -> torch.Tensor:
        shape = (read.info.padded_length, *self.store.settings.row_shape)
        dtype = rows_dtype(self.store.settings.kv_dtype)
        if read.slot is None:  # no staging buffer (none free, or none fits): read here, into pageable memory
            return self.store.read_kv(read.info, out=torch.empty(shape, dtype=dtype), whole=True)
        buf = read.buf = self.staging.writable(read.slot)
        on_device = self.check_on_device and read.info.checksum is not None

        def into_buffer(file, offset: int, nbytes: int) -> int | None:
            return self.process.read(buf, 0, file, offset, nbytes, checksum=not on_device)

        host = self.store.read_kv(read.info, out=buf.tensor[: read.nbytes].view(dtype).view(shape), whole=True,
                                  into_out=into_buffer, verify=not on_device)
        if on_device:
            self._check_on_device(read, host)
        return host

    def _check_on_device(self, read: _Read, host: torch.Tensor) -> None:
        """The chunk's bytes copied into a DeviceCopies buffer, their crc32c checked there
        (ChunkReadError when it is not the catalog's): read.on_device and read.copy. When no
        buffer is free, they are checked here and loaded from the host.
        A reader thread calls this."""
        raw = host.view(-1).view(torch.uint8)
        taken = self.device_copies.take() if self.device_copies is not None else None
        if taken is None:  # no buffer on the device
            self.store.check_crc(read.info, crc32c.crc32c(raw.numpy()))
            return
        index = taken[0]
        try:
            got = self._crc_on_device(raw, *taken)
        except BaseException:
            self.device_copies.give(index)
            raise
        if got != read.info.checksum:
            self.device_copies.give(index)
            self.store.check_crc(read.info, got)  # raises
        on_device = self.device_copies.buffer(index, raw.numel())
        read.on_device, read.copy = on_device.view(host.dtype).view(host.shape), index

    def _crc_on_device(self, raw: torch.Tensor, index: int, copied: torch.cuda.Event | None) -> int:
        """``raw`` copied into DeviceCopies buffer ``index`` once the copy out of it (``copied``) has
        run, on this thread's stream, and its crc32c taken there (allocating nothing); returns
        when both have run (the staging buffer may be written again)."""
        copies = self.device_copies
        with self._own_stream(self.pool.kv.device) as stream:
            if stream is not None and copied is not None:
                stream.wait_event(copied)  # the last load's copy out of this buffer
            copies.buffer(index, raw.numel()).copy_(raw, non_blocking=True)
            result = copies.crc32c(index, raw.numel())
            if stream is not None:
                stream.synchronize()
        return int(result) & 0xFFFFFFFF

    @contextlib.contextmanager
    def _own_stream(self, device: torch.device):
        """On a GPU, the calling thread's own stream made current (its copies and checks queue
        behind no other thread's) and yielded; elsewhere None."""
        if device.type != "cuda":
            yield None
            return
        stream = getattr(self._thread, "stream", None)
        if stream is None:
            stream = self._thread.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield stream

    def _wait_read(self, info: ChunkInfo, report: LoadReport) -> tuple[torch.Tensor, _Read]:
        """The chunk's KV read from the store (by the look-ahead, or now), and its read (staging
        buffer, copy on the device)."""
        cid = info.chunk_id
        self.wanted = [w for w in self.wanted if w.chunk_id != cid]
        read = self.pending.pop(cid, None)
        t = time.perf_counter()
        try:
            if read is None:
                staged = self.staging is not None and info.padded_length * self.row_bytes <= self.staging.nbytes
                read = _Read(info, self.staging.take() if staged else None, info.padded_length * self.row_bytes)
                host = self._read(read)
            else:
                report.read_ahead = True
                self.ahead_bytes -= read.nbytes
                host = read.future.result()  # a failed prefetch raises its error here, for this request
        except BaseException:
            self._give_back(read)
            raise
        report.read_wait_s = time.perf_counter() - t
        report.bytes_read = host.numel() * host.element_size()
        return host, read

    def _keep(self, chunk_id: str, host: torch.Tensor, buf: SharedBuffer | None,
              copied: torch.cuda.Event | None) -> None:
        """After a disk read: the host tier keeps the chunk where it has room, else its buffer goes back."""
        if buf is None:
            return  # read into pageable memory: the tier holds staging buffers only
        if self.host.budget < self.staging.nbytes:
            self.staging.give(buf, copied)
            return
        evicted = self.host.put(chunk_id, _Kept(host, buf, copied, self.staging.nbytes))
        for old in evicted:  # each the size of the buffer kept: one at most
            self.staging.give(old.buf, old.copied)
        if not evicted:
            self.staging.give(None)  # the tier grew by a buffer: staging pins a new one when it needs it

    def _give_back(self, read: _Read | None) -> None:
        """A failed or abandoned read's staging buffer (and copy on the device), which nothing was
        copied from."""
        if read is None:
            return
        if read.copy is not None:
            self.device_copies.give(read.copy)
            read.on_device = read.copy = None
        if read.slot is None:
            return
        self.staging.give(*((read.buf, None) if read.buf is not None else read.slot))

    def close(self) -> None:
        self.reader.shutdown(wait=True, cancel_futures=True)
        if self.staging is not None:
            for read in self.pending.values():
                self._give_back(read)
            for kept in self.host.entries.values():
                self.staging.give(kept.buf, kept.copied)
            self.staging.close()
        self.pending.clear()
        self.wanted = []
        self.host.entries.clear()
        if self.device_copies is not None:
            self.device_copies.close()
