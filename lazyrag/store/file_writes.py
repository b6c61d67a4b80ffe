"""Writing a new file of KV at the disk's speed, durably.

Through the page cache, a segment is first copied into memory and only reaches the disk at its
fsync, so the copy and the disk take turns (and the copy competes with the encoder for cores).
Written with O_DIRECT, as `dd oflag=direct` writes, the bytes go from the array to the disk with
no copy, a piece at a time. O_DIRECT needs memory addresses, file offsets and lengths aligned to
ALIGN: the aligned head of the bytes goes that way (through a small aligned buffer when the array
itself is not aligned: ``aligned_empty`` makes arrays that are), the rest and every file on a
filesystem without O_DIRECT go through the page cache. One fsync makes it all durable.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

ALIGN = 4096          # O_DIRECT's alignment of memory, file offsets and lengths on common filesystems
PIECE = 64 << 20      # bytes per O_DIRECT write


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose first byte is ALIGN-aligned."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes]


def write_new_file(path: Path, parts: list[np.ndarray]) -> None:
    """Create ``path`` (it must not exist) holding the bytes of the contiguous arrays ``parts`` back to
    back, and fsync it. The first part's aligned head is written with O_DIRECT where the filesystem
    takes it."""
    head = memoryview(parts[0]).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        offset = _write_direct(path, parts[0], head)
        for view in [head[offset:]] + [memoryview(p).cast("B") for p in parts[1:]]:
            _pwrite_all(fd, view, offset)
            offset += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_direct(path: Path, array: np.ndarray, view: memoryview) -> int:
    """Write the ALIGN-multiple head of ``view`` (the bytes of ``array``) at the start of ``path`` with
    O_DIRECT; the bytes written, 0 where the filesystem does not take O_DIRECT."""
    n = len(view) // ALIGN * ALIGN
    if not n or not hasattr(os, "O_DIRECT"):
        return 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:  # tmpfs and some network filesystems
            return 0
        raise
    bounce = None if array.ctypes.data % ALIGN == 0 else memoryview(aligned_empty(min(PIECE, n)))
    done = 0
    try:
        while done < n:
            piece = view[done: done + min(PIECE, n - done)]
            if bounce is not None:
                bounce[: len(piece)] = piece
                piece = bounce[: len(piece)]
            written = os.pwrite(fd, piece, done)
            done += written
            if written % ALIGN:
                break  # a short write leaves the rest unaligned: the page cache takes it
    except OSError as e:
        if e.errno != errno.EINVAL:  # an alignment this filesystem refuses: the page cache takes the rest
            raise
    finally:
        os.close(fd)
    return done


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
