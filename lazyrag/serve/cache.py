"""The chunk cache: which chunks' KV is resident in the page pool, and the pool's allocator.

A chunk is the unit of caching. It is pinned while any running request uses it;
eviction takes the least recently used unpinned chunks. A chunk whose look-ahead read has
finished is loaded into free pages at once, before any request asks for it, so its copy to the
GPU overlaps the steps before it (its first use still counts as a miss). The pages selective recompute wrote for
a chunk after a given run of leading chunks (lazyrag/serve/recompute.py) are entries of the same
LRU, one per choice of pages under that context, pinned and evicted the same way. The cache is the only thing
that hands out and takes back pool pages (chunk pages, a request's own pages, block
mode's private copies), so it can evict to make room. Moving bytes in (disk, host
tier, prefetch) is the loader's job (lazyrag/serve/loader.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable

from lazyrag.serve.loader import LoadReport, Loader
from lazyrag.serve.paged import OutOfPages, PagePool
from lazyrag.store import ChunkInfo


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
    read_ahead: int = 0       # misses served by a read the look-ahead had started (done or not)
    bytes_read: int = 0       # from the store on disk
    bytes_to_gpu: int = 0     # copied into the pool
    evictions: int = 0
    recomputed_tokens: int = 0  # chunk tokens recomputed (selective recompute)
    reused_tokens: int = 0      # recomputed chunk tokens taken from the cache instead
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

    @property
    def reuse_ratio(self) -> float:
        """Share of the recomputed tokens requests read that were reused, not computed."""
        total = self.recomputed_tokens + self.reused_tokens
        return self.reused_tokens / total if total else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "hit_ratio": round(self.hit_ratio, 4), "token_hit_ratio": round(self.token_hit_ratio, 4),
                "reuse_ratio": round(self.reuse_ratio, 4)}


@dataclass
class Resident:
    """A chunk in the pool: its pages, and how many placed requests use it."""
    info: ChunkInfo
    pages: list[int]
    pins: int = 0
    copied: object = None  # the event of its copy into the pool, until compute is ordered after it
    used: bool = True      # False while loaded ahead of the request that will use it

    @property
    def key(self) -> str:
        return self.info.chunk_id


@dataclass
class Recomputed:
    """The pages selective recompute wrote for one chunk after one run of leading chunks (its
    `context`): `selection` names which of the chunk's pages they replace, in order (it may be
    empty)."""
    context: str
    selection: tuple[int, ...]
    pages: list[int]
    tokens: int = 0  # the chunk tokens they hold
    pins: int = 0

    @property
    def key(self) -> str:
        return f"{self.context}:{','.join(map(str, self.selection))}"


class ChunkCache:
    # entries of recomputed pages that hold none (a chunk none of whose pages was chosen) cost no
    # pages, so nothing evicts them: the oldest go past this many
    MAX_EMPTY_RECOMPUTED = 100_000

    def __init__(self, pool: PagePool, loader: Loader):
        self.pool, self.loader = pool, loader
        self._resident: OrderedDict[str, Resident | Recomputed] = OrderedDict()  # LRU order: oldest first
        self._empty: OrderedDict[str, None] = OrderedDict()  # keys of Recomputed entries without pages
        self._choices: dict[str, list[str]] = {}  # a context -> keys of its Recomputed entries, last used last
        self.counters = CacheCounters(pool_pages=pool.num_pages, page_bytes=pool.bytes_per_page)

    # -- chunks ---------------------------------------------------------------------
    def is_resident(self, chunk_id: str) -> bool:
        """Whether the chunk is in the pool (a check, not a use: no LRU touch)."""
        return chunk_id in self._resident

    def acquire(self, info: ChunkInfo) -> Resident:
        """Pin a chunk in the pool, loading it if needed. May raise OutOfPages."""
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += info.length
        entry = self._resident.get(info.chunk_id)
        if entry is not None and entry.used:
            c.hits += 1
            c.hit_tokens += info.length
            self._resident.move_to_end(info.chunk_id)
        else:
            if entry is None:
                entry = self._load(info, self.alloc(self.pool.pages_for(info.padded_length)))
            else:  # loaded ahead: this is the use it was loaded for
                self._resident.move_to_end(info.chunk_id)
            entry.used = True
            c.misses += 1
            c.miss_tokens += info.length
        self.loader.after_copy(entry.copied)  # compute is ordered after it from now on
        entry.copied = None
        entry.pins += 1
        return entry

    def _load(self, info: ChunkInfo, pages: list[int], used: bool = True) -> Resident:
        """Load a chunk into `pages` (from alloc) and make it resident, unpinned."""
        try:
            report = self.loader.load(info, pages)
        except BaseException:
            self.free(pages)
            raise
        self._count_load(report)
        entry = self._resident[info.chunk_id] = Resident(info, pages, copied=report.copied, used=used)
        return entry

    def release(self, entry: Resident) -> None:
        """Unpin: the chunk stays resident, evictable once no request uses it."""
        entry.pins -= 1

    def evict(self, key: str) -> None:
        entry = self._resident.pop(key)
        assert entry.pins == 0, "evicting a pinned chunk"
        if isinstance(entry, Resident):
            self.loader.settle(entry.copied)  # loaded ahead, never used: its copy may still be writing
        self._empty.pop(key, None)
        if isinstance(entry, Recomputed):
            choices = self._choices[entry.context]
            choices.remove(key)
            if not choices:
                del self._choices[entry.context]
        self.pool.release(entry.pages)
        self.counters.evictions += isinstance(entry, Resident)

    # -- recomputed pages -------------------------------------------------------------
    def find_recomputed(self, context: str, value: Callable[[tuple[int, ...]], float | None]) -> Recomputed | None:
        """Pin and return the recomputed pages kept for `context` whose selection `value` rates
        highest (None: of no use to the caller; ties go to the last used), if any. Every entry
        under a context holds exactly what recomputing its selection after that context gives."""
        choices = self._choices.get(context, [])
        best, best_value = None, None
        for key in reversed(choices):
            v = value(self._resident[key].selection)
            if v is not None and (best_value is None or v > best_value):
                best, best_value = key, v
        if best is None:
            return None
        entry = self._resident[best]
        self._resident.move_to_end(best)
        choices.remove(best)
        choices.append(best)
        entry.pins += 1
        self.counters.reused_tokens += entry.tokens
        return entry

    def keep_recomputed(self, context: str, selection: tuple[int, ...], pages: list[int], tokens: int) -> Recomputed:
        """Hand `pages` (from alloc, about to be recomputed: `tokens` chunk tokens) to the cache
        as the choice `selection` for `context`, pinned for the caller; a later request finds them
        with find_recomputed."""
        self.counters.recomputed_tokens += tokens
        entry = Recomputed(context, tuple(selection), pages, tokens, pins=1)
        assert entry.key not in self._resident, "a choice kept twice: find_recomputed would have found it"
        self._resident[entry.key] = entry
        self._choices.setdefault(context, []).append(entry.key)
        if not pages:
            self._empty[entry.key] = None
            if len(self._empty) > self.MAX_EMPTY_RECOMPUTED:
                oldest = next((k for k in self._empty if self._resident[k].pins == 0), None)
                if oldest is not None:
                    self.evict(oldest)
        return entry

    def drop_recomputed(self, entry: Recomputed) -> None:
        """Forget an entry whose pages were never computed (its step failed): unpin and evict it."""
        entry.pins -= 1
        if self._resident.get(entry.key) is entry and entry.pins == 0:
            self.evict(entry.key)

    def prefetch(self, infos: list[ChunkInfo]) -> None:
        """Read ahead the chunks coming requests need that are not in the pool, in the order given
        (the order the scheduler wants them read); replaces the previous call's list. Chunks whose loads
        wait for nothing (reads finished, or kept by the host tier) are loaded into free pages now
        (never evicting anything for them)."""
        self.loader.prefetch([info for info in infos if info.chunk_id not in self._resident])
        for info in self.loader.finished():
            n = self.pool.pages_for(info.padded_length)
            if self.pool.num_free < n:
                break
            try:
                self._load(info, self.alloc(n), used=False)
            except Exception:  # its request's own acquire reads it again and fails alone
                continue

    def is_loading(self, chunk_id: str) -> bool:
        """Whether the chunk is on its way to the pool: its read is under way, or waits its turn
        behind reads that are (acquiring it now would wait for it)."""
        return chunk_id not in self._resident and (self.loader.reading(chunk_id) or self.loader.queued(chunk_id))

    # -- pages ----------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Pages for a chunk or a request, evicting LRU unpinned chunks to make room."""
        if n > self.pool.num_pages:
            raise OutOfPages(f"{n} pages asked for, but the pool holds {self.pool.num_pages}: raise --cache-gb")
        while self.pool.num_free < n:
            victim = next((e for e in self._resident.values() if e.pins == 0 and e.pages), None)
            if victim is None:
                raise OutOfPages(f"need {n} pages, {self.pool.num_free} free, all chunks pinned")
            self.evict(victim.key)
        pages = self.pool.alloc(n)
        self.counters.peak_pages = self.pool.peak_used
        return pages

    def free(self, pages: list[int]) -> None:
        """Give back pages from `alloc` (a request's own pages and copies; not a chunk's)."""
        self.pool.release(pages)

    def available_pages(self, keep: set[str] = frozenset()) -> int:
        """Pages `alloc` could hand out now: free ones, plus those of unpinned chunks not in `keep`."""
        evictable = sum(len(e.pages) for cid, e in self._resident.items() if e.pins == 0 and cid not in keep)
        return self.pool.num_free + evictable

    # -- counters -------------------------------------------------------------------
    def _count_load(self, load: LoadReport) -> None:
        c = self.counters
        c.host_hits += load.host_hit
        c.read_ahead += load.read_ahead
        c.read_wait_s += load.read_wait_s
        c.bytes_read += load.bytes_read
        c.bytes_to_gpu += load.bytes_to_gpu

    def reset_counters(self) -> None:
        """Start counting afresh (the resident chunks stay): benchmarks time a warmed cache."""
        self.counters = CacheCounters(pool_pages=self.pool.num_pages, page_bytes=self.pool.bytes_per_page)
        self.pool.peak_used = self.pool.used

    def close(self) -> None:
        self.loader.close()
