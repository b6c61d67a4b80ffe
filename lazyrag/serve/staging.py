"""Host buffers that chunk reads land in on their way to the pool: SharedBuffers the reader
process writes (lazyrag/store/read_process.py), pinned on a GPU, kept for the process and
recycled from loader to loader, because pinning is slow."""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from lazyrag.store import Store
from lazyrag.store.read_process import SharedBuffer

Slot = tuple  # (staging buffer, or None: make one when first written; event of its last copy, or None)


class Staging:
    """Host buffers that chunk reads land in on their way to the pool, recycled: SharedBuffers the
    reader process writes, pinned on a GPU.

    Pinning memory is slow and does not run in parallel (about 0.2 s per 277 MB buffer on an H200
    machine, 1.6 s for 8 on 8 threads), so buffers are kept for the process (handed from loader to
    loader), and `answer` has the first ones pinned on a thread of their own while its model loads
    (`pin_staging_ahead`), each mapped by the reader process as soon as it is made. A reader thread
    that finds no buffer ready waits for that thread while it owes one; otherwise it makes its own.
    A buffer is written again only after its last copy to the GPU has run: the reader thread waits
    for that copy, not the engine.
    """

    # process-wide, by (size in bytes, pinned): the buffers ready, and those the pinning thread owes
    _spare: dict[tuple[int, bool], list[SharedBuffer]] = {}
    _owed: dict[tuple[int, bool], int] = {}
    _ready = threading.Condition()

    def __init__(self, nbytes: int, count: int, pin: bool):
        self.nbytes, self.pin = nbytes, pin
        self.key = (nbytes, pin)
        self.free: deque[Slot] = deque((None, None) for _ in range(count))

    @classmethod
    def pin_ahead(cls, nbytes: int, count: int, device: torch.device | None = None,
                  share: Callable[[SharedBuffer], None] | None = None) -> None:
        """Start pinning, on a thread of its own, as many buffers of ``nbytes`` as the process lacks
        to hold ``count``, each handed to ``share`` (the reader process, which maps it) once made."""
        key = (nbytes, True)
        with cls._ready:
            owed = count - len(cls._spare.get(key, [])) - cls._owed.get(key, 0)
            if owed <= 0:
                return
            cls._owed[key] = cls._owed.get(key, 0) + owed
        threading.Thread(target=cls._make, args=(key, owed, device, share), name="lazyrag-pin", daemon=True).start()

    @classmethod
    def _make(cls, key: tuple[int, bool], owed: int, device: torch.device | None,
              share: Callable[[SharedBuffer], None] | None) -> None:
        try:
            if device is not None and device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device.index)  # a pinning counts for the device current on its thread
            while owed:
                buf = SharedBuffer(*key)
                if share is not None:
                    share(buf)
                with cls._ready:
                    cls._spare.setdefault(key, []).append(buf)
                    cls._owed[key] -= 1
                    owed -= 1
                    cls._ready.notify_all()
        except BaseException:
            pass  # the reader threads make their own buffers, and the first that fails says why
        finally:
            with cls._ready:  # whatever is still owed never comes: nobody waits for it
                cls._owed[key] -= owed
                cls._ready.notify_all()

    def take(self) -> Slot | None:
        return self.free.popleft() if self.free else None

    def give(self, buf: SharedBuffer | None, copied: torch.cuda.Event | None = None) -> None:
        """A buffer back (None: one the host tier kept; a new one is made when needed)."""
        self.free.append((buf, copied))

    def writable(self, slot: Slot) -> SharedBuffer:
        """The slot's buffer once no copy reads it: a ready one, or the next one pinned, or made now
        if none is owed (a reader thread calls this)."""
        buf, copied = slot
        if copied is not None:
            copied.synchronize()
        if buf is None:
            with self._ready:
                self._ready.wait_for(lambda: self._spare.get(self.key) or not self._owed.get(self.key))
                spare = self._spare.get(self.key)
                buf = spare.pop() if spare else None
        return buf if buf is not None else SharedBuffer(self.nbytes, pin=self.pin)

    def close(self) -> None:
        while self.free:
            buf, copied = self.free.popleft()
            if buf is not None:
                if copied is not None:
                    copied.synchronize()
                with self._ready:
                    self._spare.setdefault(self.key, []).append(buf)


STAGING_BYTES = 4 << 30  # a loader's default budget of bytes read ahead and not loaded yet


def staging_shape(store: Store, staging_bytes: int = STAGING_BYTES) -> tuple[int, int]:
    """A loader's staging over ``store``: (bytes a buffer holds: the store's longest chunk, buffers);
    (0, 0) for an empty store."""
    chunk_bytes = store.max_padded_length() * store.settings.row_bytes  # fp8 rows carry their scales
    return (chunk_bytes, max(2, staging_bytes // chunk_bytes)) if chunk_bytes else (0, 0)


def wait_staging_pinned() -> None:
    """Return once the buffers pin_staging_ahead started are pinned (or have failed)."""
    with Staging._ready:
        Staging._ready.wait_for(lambda: not any(Staging._owed.values()))
