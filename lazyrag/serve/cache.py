"""The chunk cache: chunks' KV resident in the page pool, least recently used evicted.

A chunk is the unit of caching. It is pinned while any running request uses it;
eviction takes the least recently used unpinned chunks. Misses are filled from an
optional pinned host-memory tier, else from the store; reads run on a thread pool
so the look-ahead prefetch of coming queries overlaps the GPU's work, and host to
GPU copies go on their own CUDA stream.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from lazyrag.serve.paged import OutOfPages, PagePool
from lazyrag.store import ChunkInfo, Store


@dataclass
class CacheCounters:
    """Defined once, reported everywhere (answers, run log, stats)."""

    lookups: int = 0          # chunk references by requests
    hits: int = 0             # resident in the pool
    misses: int = 0           # had to be loaded
    lookup_tokens: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    host_hits: int = 0        # misses served by the host tier, not the disk
    bytes_read: int = 0       # from the store on disk
    bytes_to_gpu: int = 0     # copied into the pool
    evictions: int = 0
    read_wait_s: float = 0.0  # time the engine waited on chunk reads (from disk, or prefetched still in flight)
    peak_pages: int = 0
    pool_pages: int = 0
    page_bytes: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "hit_ratio": round(self.hit_ratio, 4), "token_hit_ratio": round(self.token_hit_ratio, 4)}


@dataclass
class Resident:
    info: ChunkInfo
    pages: list[int]
    pins: int = 0


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

    Pinning memory is slow (about 0.2 s per 64 MB on the H200 machine; a profile of
    scripts/bench_e2e.py found chunk loads waiting on it for most of a run), so buffers
    are made once per process and handed from cache to cache. A buffer is written again
    only after its last copy to the GPU has run.
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


class ChunkCache:
    def __init__(self, store: Store, pool: PagePool, host_cache_bytes: float = 0, read_threads: int = 4,
                 max_prefetch: int = 32, staging_bytes: int = 4 << 30):
        self.store, self.pool = store, pool
        self.resident: OrderedDict[str, Resident] = OrderedDict()  # LRU order: oldest first
        self.counters = CacheCounters(pool_pages=pool.num_pages, page_bytes=pool.bytes_per_page)
        self.host = _HostTier(int(host_cache_bytes))
        self.pinned = pool.kv.is_cuda
        self.reader = ThreadPoolExecutor(read_threads, thread_name_prefix="lazyrag-read")
        self.pending: dict[str, tuple[Future, torch.Tensor | None]] = {}
        self.max_prefetch = max_prefetch
        self.stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        self.row_bytes = math.prod(store.settings.row_shape) * pool.kv.element_size()
        self.staging = None
        chunk_bytes = store.max_padded_length() * self.row_bytes
        if self.pinned and chunk_bytes:  # reads deeper than the buffers wait for one to come back
            self.staging = PinnedStaging(chunk_bytes, max(2, min(2 * read_threads, staging_bytes // chunk_bytes)))

    # -- requests -------------------------------------------------------------------
    def acquire(self, info: ChunkInfo) -> Resident:
        """Pin a chunk in the pool, loading it if needed. May raise OutOfPages."""
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += info.length
        entry = self.resident.get(info.chunk_id)
        if entry is not None:
            c.hits += 1
            c.hit_tokens += info.length
            self.resident.move_to_end(info.chunk_id)
        else:
            pages = self.alloc(self.pool.pages_for(info.padded_length))
            try:
                self._load(info, pages)
            except BaseException:
                self.pool.release(pages)
                raise
            c.misses += 1
            c.miss_tokens += info.length
            entry = self.resident[info.chunk_id] = Resident(info, pages)
        entry.pins += 1
        return entry

    def reset_counters(self) -> None:
        """Start counting afresh (the resident chunks stay): benchmarks time a warmed cache."""
        self.counters = CacheCounters(pool_pages=self.pool.num_pages, page_bytes=self.pool.bytes_per_page)
        self.pool.peak_used = self.pool.used

    def release(self, entry: Resident) -> None:
        entry.pins -= 1

    def alloc(self, n: int) -> list[int]:
        """Pages for a chunk or a request, evicting LRU unpinned chunks to make room."""
        if n > self.pool.num_pages:
            raise OutOfPages(f"{n} pages asked for, but the pool holds {self.pool.num_pages}: raise --cache-gb")
        while len(self.pool.free_pages) < n:
            victim = next((e for e in self.resident.values() if e.pins == 0), None)
            if victim is None:
                raise OutOfPages(f"need {n} pages, {len(self.pool.free_pages)} free, all chunks pinned")
            self.evict(victim.info.chunk_id)
        pages = self.pool.alloc(n)
        self.counters.peak_pages = self.pool.peak_used
        return pages

    def evictable_pages(self, exclude: set[str] = frozenset()) -> int:
        return sum(len(e.pages) for cid, e in self.resident.items() if e.pins == 0 and cid not in exclude)

    def evict(self, chunk_id: str) -> None:
        entry = self.resident.pop(chunk_id)
        assert entry.pins == 0, "evicting a pinned chunk"
        self.pool.release(entry.pages)
        self.counters.evictions += 1

    # -- loading --------------------------------------------------------------------
    def prefetch(self, infos: list[ChunkInfo]) -> None:
        """Start reading chunks a coming request will need (not resident, not in flight)."""
        for info in infos:
            if len(self.pending) >= self.max_prefetch:
                return
            cid = info.chunk_id
            if cid in self.resident or cid in self.pending or cid in self.host.entries:  # a check, not a use: no LRU touch
                continue
            buf = self._staging_buffer(info)
            if buf is None and self.staging is not None:
                return  # every buffer holds a chunk not yet loaded
            self.pending[cid] = (self.reader.submit(self._read, info, buf), buf)

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

    def _host_copy(self, info: ChunkInfo) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's KV on the host, and the staging buffer holding it (to give back)."""
        cid = info.chunk_id
        host = self.host.get(cid)
        if host is not None:
            self.counters.host_hits += 1
            return host, None
        future, buf = self.pending.pop(cid, (None, None))
        t = time.perf_counter()
        if future is None:
            buf = self._staging_buffer(info)
            host = self._read(info, buf)
        else:
            host = future.result()
        self.counters.read_wait_s += time.perf_counter() - t
        self.counters.bytes_read += host.numel() * host.element_size()
        if host.numel() * host.element_size() <= self.host.budget:
            if buf is not None:  # the tier keeps its own pinned copy: the staging buffer is reused
                host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
            self.host.put(cid, host)
        return host, buf

    def _load(self, info: ChunkInfo, pages: list[int]) -> None:
        host, buf = self._host_copy(info)
        if self.stream is None:
            self.pool.write_tokens(pages, host)
        else:
            # the copy and the scatter run on the side stream; compute waits only for this chunk
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.pool.write_tokens(pages, host)
            torch.cuda.current_stream().wait_stream(self.stream)
        if buf is not None:
            copied = torch.cuda.Event()
            copied.record(self.stream)
            self.staging.give(buf, copied)
        self.counters.bytes_to_gpu += host.numel() * host.element_size()

    def close(self) -> None:
        self.reader.shutdown(wait=True, cancel_futures=True)
        if self.staging is not None:
            for _, buf in self.pending.values():
                if buf is not None:
                    self.staging.give(buf)
            self.pending.clear()
            self.staging.close()
