"""Chunk I/O: getting a chunk's KV from the store (or the host tier) into pool pages.

Reads run on a thread pool so the look-ahead prefetch of coming queries overlaps the
GPU's work; they land in recycled pinned buffers, and host to GPU copies go on their
own CUDA stream. An optional pinned host-memory tier keeps recently read chunks, so a
chunk evicted from the pool comes back without the disk. What to load and when is the
chunk cache's business (lazyrag/serve/cache.py); this module only moves bytes and
reports what each load cost.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lazyrag.serve.paged import PagePool
from lazyrag.store import ChunkInfo, Store


@dataclass
class LoadReport:
    """What one load cost, for the cache's counters."""

    host_hit: bool = False    # served by the host tier, not the disk
    read_wait_s: float = 0.0  # waiting on the disk read (or a prefetch still in flight)
    bytes_read: int = 0       # from the store on disk
    bytes_to_gpu: int = 0     # copied into the pool


class Loader(Protocol):
    """What the chunk cache needs from its I/O."""

    def prefetch(self, infos: list[ChunkInfo]) -> None: ...

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport: ...

    def close(self) -> None: ...


@dataclass
class _HostTier:
    budget: int
    used: int = 0
    entries: OrderedDict = field(default_factory=OrderedDict)

    def get(self, chunk_id: str) -> torch.Tensor | None:
        t = self.entries.get(chunk_id)
        if t is not None:
            self.entries.move_to_end(chunk_id)
        return t

    def put(self, chunk_id: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.budget or chunk_id in self.entries:
            return
        while self.used + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        self.entries[chunk_id] = t
        self.used += size


class PinnedStaging:
    """Pinned host buffers that chunk reads land in on their way to the GPU, recycled.

    Pinning memory is slow (about 0.2 s per 64 MB on an H200 machine, long enough to stall
    chunk loads), so buffers are made once per process and handed from loader to loader.
    A buffer is written again only after its last copy to the GPU has run.
    """

    _spare: dict[int, list[torch.Tensor]] = {}  # process-wide, by size in bytes

    def __init__(self, nbytes: int, count: int):
        spare = self._spare.setdefault(nbytes, [])
        self.nbytes = nbytes
        self.free: deque = deque()
        for _ in range(count):
            buf = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.free.append((buf, None))

    def take(self) -> torch.Tensor | None:
        if not self.free:
            return None
        buf, copied = self.free.popleft()
        if copied is not None:
            copied.synchronize()
        return buf

    def give(self, buf: torch.Tensor, copied: torch.cuda.Event | None = None) -> None:
        self.free.append((buf, copied))

    def close(self) -> None:
        while self.free:
            self._spare[self.nbytes].append(self.take())


class ChunkLoader:
    """Reads chunks from the store into pool pages (the `Loader` the engine uses)."""

    def __init__(self, store: Store, pool: PagePool, host_cache_bytes: float = 0, read_threads: int = 4,
                 max_prefetch: int = 32, staging_bytes: int = 4 << 30):
        self.store, self.pool = store, pool
        self.host = _HostTier(int(host_cache_bytes))
        self.reader = ThreadPoolExecutor(read_threads, thread_name_prefix="lazyrag-read")
        self.pending: dict[str, tuple[Future, torch.Tensor | None]] = {}
        self.max_prefetch = max_prefetch
        self.stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        self.row_bytes = math.prod(store.settings.row_shape) * pool.kv.element_size()
        self.staging = None
        chunk_bytes = store.max_padded_length() * self.row_bytes
        if pool.kv.is_cuda and chunk_bytes:  # reads deeper than the buffers wait for one to come back
            self.staging = PinnedStaging(chunk_bytes, max(2, min(2 * read_threads, staging_bytes // chunk_bytes)))

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        """Start reading chunks a coming request will need (the caller passes only chunks not in
        the pool); chunks in flight or in the host tier are skipped."""
        for info in infos:
            if len(self.pending) >= self.max_prefetch:
                return
            cid = info.chunk_id
            if cid in self.pending or cid in self.host.entries:  # a check, not a use: no LRU touch
                continue
            buf = self._staging_buffer(info)
            if buf is None and self.staging is not None:
                return  # every buffer holds a chunk not yet loaded
            self.pending[cid] = (self.reader.submit(self._read, info, buf), buf)

    def load(self, info: ChunkInfo, pages: list[int]) -> LoadReport:
        """Write the chunk's KV into `pages`; compute waits only for this chunk's copy."""
        report = LoadReport()
        host, buf = self._host_copy(info, report)
        if self.stream is None:
            self.pool.write_tokens(pages, host)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.pool.write_tokens(pages, host)
            torch.cuda.current_stream().wait_stream(self.stream)
        if buf is not None:
            copied = torch.cuda.Event()
            copied.record(self.stream)
            self.staging.give(buf, copied)
        report.bytes_to_gpu = host.numel() * host.element_size()
        return report

    def _staging_buffer(self, info: ChunkInfo) -> torch.Tensor | None:
        if self.staging is None or info.padded_length * self.row_bytes > self.staging.nbytes:
            return None
        return self.staging.take()

    def _read(self, info: ChunkInfo, buf: torch.Tensor | None) -> torch.Tensor:
        shape = (info.padded_length, *self.store.settings.row_shape)
        dtype = self.pool.kv.dtype
        if buf is None:  # no staging buffer free (or none fits): pageable memory, a slower copy
            out = torch.empty(shape, dtype=dtype)
        else:
            out = buf[: info.padded_length * self.row_bytes].view(dtype).view(shape)
        return self.store.read_kv(info, out=out)

    def _host_copy(self, info: ChunkInfo, report: LoadReport) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's KV on the host, and the staging buffer holding it (to give back)."""
        cid = info.chunk_id
        host = self.host.get(cid)
        if host is not None:
            report.host_hit = True
            return host, None
        future, buf = self.pending.pop(cid, (None, None))
        t = time.perf_counter()
        try:
            if future is None:
                buf = self._staging_buffer(info)
                host = self._read(info, buf)
            else:
                host = future.result()  # a failed prefetch raises its error here, for this request
        except BaseException:
            if buf is not None:  # nothing was copied from it
                self.staging.give(buf)
            raise
        report.read_wait_s = time.perf_counter() - t
        report.bytes_read = host.numel() * host.element_size()
        if report.bytes_read <= self.host.budget:
            if buf is not None:  # the tier keeps its own pinned copy: the staging buffer is reused
                host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
            self.host.put(cid, host)
        return host, buf

    def close(self) -> None:
        self.reader.shutdown(wait=True, cancel_futures=True)
        if self.staging is not None:
            for _, buf in self.pending.values():
                if buf is not None:
                    self.staging.give(buf)
            self.pending.clear()
            self.staging.close()
