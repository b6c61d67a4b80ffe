"""Chunk reads in a process of their own, into host buffers it shares with this one.

Reader threads in the serving process, even ones that spend all their time in pread and crc32c
with the GIL released, slowed the step loop's CUDA launches 1.5x on an H200 machine; the same
reads in another process left them alone (scripts/bench_read_contention.py). So the loader's
staging buffers are SharedBuffers: memfd memory mapped here (and pinned on a GPU machine) and in
the reader process (read_process_child.py, started once per process), which fills them with
pread and returns each range's crc32c (unless the caller checks the bytes on the GPU). A range
goes as pieces its threads share, so the chunk needed first lands first. Messages are JSON over
a Unix socket, no pickle.
"""

from __future__ import annotations

import atexit
import itertools
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import torch

from .format import StoreError
from .crc import crc32c_combine

CHILD = Path(__file__).with_name("read_process_child.py")
MAX_MESSAGE = 1 << 16
PIECE_BYTES = 16 << 20  # a read's pieces: 16 for an 8B model's 2,048-token chunk


class SharedBuffer:
    """``nbytes`` of host memory the reader process can write (a memfd mapped in both), as a uint8
    tensor; pinned (registered with CUDA) when ``pin``, so copies from it to the GPU are async."""

    _ids = itertools.count()

    def __init__(self, nbytes: int, pin: bool = False):
        self.id = next(self._ids)
        self.nbytes = nbytes
        self.fd = os.memfd_create("lazyrag-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if pin:
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if err != 0:
                raise StoreError(f"cannot pin a {nbytes:,}-byte staging buffer for reads (CUDA error {err})")
            self.pinned = True


class _Child:
    """One run of the reader process: its socket, the reads it owes answers to, the buffers it maps."""

    def __init__(self, threads: int):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, str(CHILD), str(theirs.fileno()), str(threads)],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.waiting: dict[int, Future] = {}
        self.buffers: set[int] = set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict, fds: tuple[int, ...] = ()) -> None:
        try:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
        except OSError:
            pass  # the process died: its answer thread fails what waits

    def share(self, buffer: SharedBuffer) -> None:
        if buffer.id not in self.buffers:
            self.send({"op": "buffer", "id": buffer.id}, (buffer.fd,))
            self.buffers.add(buffer.id)

    def stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the answer thread; the process sees the end
        except OSError:
            pass
        self.proc.wait()


class ReadProcess:
    """The reader process: ``read`` fills part of a SharedBuffer with a file's byte range there.

    Safe to call from several threads; each call waits for its own answer. A process that dies
    fails the reads in flight (StoreError) and is started again, buffers and all, by the next."""

    def __init__(self, threads: int):
        self.threads = threads
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._child: _Child | None = None

    def read(self, buffer: SharedBuffer, at: int, path: str | Path, offset: int, nbytes: int,
             checksum: bool = True) -> int | None:
        """Read ``nbytes`` of ``path`` from ``offset`` into ``buffer`` at ``at``; their crc32c (None
        without ``checksum``).
        StoreError (naming the file) when the read fails. The process reads the range as pieces of
        at most PIECE_BYTES, queued together: its threads share it, so the ranges asked for first
        finish first (whole ranges on one thread each would all finish late together). One message
        each way a read, whatever its pieces, so that this process's threads take the GIL less."""
        if at < 0 or at + nbytes > buffer.nbytes:
            raise ValueError(f"bytes {at}..{at + nbytes} are outside the {buffer.nbytes}-byte buffer")
        piece = PIECE_BYTES
        with self._lock:
            child = self._running()
            child.share(buffer)
            rid = next(self._ids)
            child.waiting[rid] = done = Future()
            child.send({"op": "read", "id": rid, "buffer": buffer.id, "at": at, "path": str(path), "offset": offset,
                        "nbytes": nbytes, "piece": piece, "crc": checksum})
        answer = done.result()  # every piece has stopped writing before the process answers
        if "error" in answer:
            raise StoreError(f"the reader process could not read {nbytes:,} bytes at {offset:,}: {answer['error']}")
        if not checksum:
            return None
        crc = 0
        for k, piece_crc in enumerate(answer["crcs"]):
            crc = crc32c_combine(crc, int(piece_crc), min(piece, nbytes - k * piece))
        return crc

    def share(self, buffer: SharedBuffer) -> None:
        """Map ``buffer`` in the process now, as its first read would. The process maps a buffer's
        pages all at once, about twice as fast as a first read faulting them in one by one, and
        done ahead it leaves that read only its copy (`scripts/bench_store.py --bounds`)."""
        with self._lock:
            self._running().share(buffer)

    def start(self) -> None:
        """Start the process now (the first read would), before the GPU is busy."""
        with self._lock:
            self._running()

    def close(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.stop()

    def _running(self) -> _Child:
        if self._child is None or not self._child.alive():
            self._child = _Child(self.threads)
            threading.Thread(target=self._answers, args=(self._child,), name="lazyrag-read-answers",
                             daemon=True).start()
        return self._child

    def _answers(self, child: _Child) -> None:
        while True:
            try:
                data = child.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            answer = json.loads(data)
            with self._lock:
                done = child.waiting.pop(answer["id"], None)
            if done is not None:
                done.set_result(answer)
        code = child.proc.wait()  # gone (or closed): nothing in flight will be answered
        with self._lock:
            lost, child.waiting = list(child.waiting.values()), {}
        for done in lost:
            done.set_result({"error": f"the reader process ended (exit code {code}) before answering"})
        child.sock.close()


_shared: ReadProcess | None = None
_shared_lock = threading.Lock()


def shared_read_process(threads: int) -> ReadProcess:
    """The process's reader process, made on first use and kept (``threads``: its reads at once, as
    first asked)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ReadProcess(threads)
            atexit.register(_shared.close)
        return _shared
