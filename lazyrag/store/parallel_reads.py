"""One chunk read as pieces on a pool of threads, each piece checksummed as it lands.

A single pread of a large chunk (256 MB for an 8B model's 2,048 tokens) runs on one core at
the speed of one memory copy plus one crc32c pass. Split into pieces of a few MB, the copies
and checksums run on every core (both release the GIL), and the pieces' crc32c combine into
the whole chunk's, the one the catalog records, so the store's format is unchanged.

Threads: ``$LAZYRAG_READ_THREADS``, else the CPU count (at most MAX_THREADS).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import crc32c

from lazyrag.errors import InputError

from .crc import crc32c_combine

READ_THREADS_VAR = "LAZYRAG_READ_THREADS"
MAX_THREADS = 16        # the default's cap; $LAZYRAG_READ_THREADS may ask for more
PIECE_BYTES = 4 << 20   # the largest piece: small next to an 8B chunk, large next to a hand-off (~20 us)
MIN_PIECE_BYTES = 1 << 20
PIECES_PER_THREAD = 4   # so that one slow piece does not leave the other threads idle at the end

ReadInto = Callable[[memoryview, int], None]  # fill the view from a byte offset of one file

def default_threads() -> int:
    """$LAZYRAG_READ_THREADS, else the CPU count up to MAX_THREADS."""
    raw = os.environ.get(READ_THREADS_VAR, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(f"{READ_THREADS_VAR} must be a whole number of threads, at least 1; got {raw!r}")
        return n
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


class ParallelReads:
    """Reads byte ranges as pieces on ``threads`` threads (1: in the caller): pieces of at most
    ``piece_bytes``, smaller (down to MIN_PIECE_BYTES) where that gives each thread PIECES_PER_THREAD.
    Pieces of several ranges read at once queue in the order the ranges were asked for, so the
    first range asked for finishes first. Safe to use from several threads."""

    def __init__(self, threads: int | None = None, piece_bytes: int = PIECE_BYTES):
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        self.threads = threads or default_threads()
        self.piece_bytes = piece_bytes
        self._pool = (ThreadPoolExecutor(self.threads, thread_name_prefix="lazyrag-read-piece")
                      if self.threads > 1 else None)

    def read(self, read_into: ReadInto, view: memoryview, offset: int) -> int:
        """Fill ``view`` with ``read_into(piece, piece_offset)`` over its pieces; return the crc32c
        of all of ``view``. The first error of any piece is raised once every piece has stopped
        (none is still writing into ``view``)."""
        n = len(view)
        size = min(self.piece_bytes, max(MIN_PIECE_BYTES, -(-n // (PIECES_PER_THREAD * self.threads))))
        if self._pool is None or n <= size:
            read_into(view, offset)
            return crc32c.crc32c(view)
        starts = range(0, n, size)
        futures = [self._pool.submit(_read_piece, read_into, view[s: s + size], offset + s) for s in starts]
        wait(futures)
        crc = 0
        for s, f in zip(starts, futures):
            crc = crc32c_combine(crc, f.result(), min(size, n - s))
        return crc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _read_piece(read_into: ReadInto, piece: memoryview, offset: int) -> int:
    read_into(piece, offset)
    return crc32c.crc32c(piece)  # on the thread that read it, while its bytes are warm in cache


_shared: ParallelReads | None = None
_shared_lock = threading.Lock()


def shared_reads() -> ParallelReads:
    """The process's readers (default_threads()), made on first use and kept: every store open in
    a process shares them, so the threads and the cores they compete for are counted once."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ParallelReads()
        return _shared
