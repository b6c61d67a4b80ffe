"""The store's locks (flock on files in the store directory).

``write.lock``: one process at a time may append or compact. ``read.lock``: every reader
holds it shared for as long as its store is open; compaction, which moves chunks between
segments, takes it exclusively, so it never runs under a reader's feet.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .format import LOCK_FILE, READ_LOCK_FILE, StoreBusy


def take_write_lock(path: Path) -> int:
    """The store's writer lock, held by the returned descriptor; StoreBusy if another process has it."""
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    return _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, f"{path} is being written by another process (lazyrag "
                  "index or compact); wait for it to finish")


def take_read_lock(path: Path, create: bool = True) -> int | None:
    """A reader's shared lock; StoreBusy while the store is being compacted. Without ``create`` (a
    store this process cannot write) a missing lock file is not made and no lock is taken (None):
    compaction creates the file, and nothing can compact a store on a read-only filesystem."""
    fd = _open_read_lock(path, create)
    if fd is None:
        return None
    return _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB,
                  f"{path} is being compacted (lazyrag compact); run again when it has finished")


def take_exclusive_read_lock(path: Path, wait: bool) -> int:
    """The read lock, exclusively: no reader has the store open. Waits for readers to close it
    when ``wait``; otherwise StoreBusy while any reader has it."""
    fd = _open_read_lock(path)
    if fd is None:
        raise StoreBusy(f"{path}: cannot create its {READ_LOCK_FILE}; is the store on a read-only disk?")
    return _flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), f"{path} is open for reading (an answer "
                  "or stats run); wait for it to finish, or pass --wait to wait for it")


def _flock(fd: int, operation: int, busy: str) -> int:
    """``fd`` locked with ``operation``; closed, and StoreBusy(busy), when another process holds it."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        os.close(fd)
        raise StoreBusy(busy) from None
    return fd


def _open_read_lock(path: Path, create: bool = True) -> int | None:
    if create:
        try:
            return os.open(path / READ_LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            pass  # cannot be created here; the file may still be there to lock
    try:  # a shared flock needs no write access to the file
        return os.open(path / READ_LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
