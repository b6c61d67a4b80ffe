"""The reader process (see read_process.py): reads byte ranges of files into shared buffers.

Run as a plain script, importing neither lazyrag nor torch, so it starts in milliseconds. Its
one argument is the number of the AF_UNIX SOCK_SEQPACKET socket it talks on; its second the
reads it runs at once. Messages are JSON objects, one a packet:

  {"op": "buffer", "id": B}  + one file descriptor: a memfd to map as buffer B
  {"op": "read", "id": R, "buffer": B, "at": A, "path": P, "offset": O, "nbytes": N, "piece": S,
   "crc": true|false}

A read goes to the threads as pieces of S bytes (the last one shorter), queued together behind
the reads asked for before it, so the threads share it and the read asked for first lands first.
Once every piece has stopped writing, the read is answered once: {"id": R, "crcs": [C, ...]} (each
piece's crc32c in order, or nulls when the read asked for none: the GPU checks the bytes) or
{"id": R, "error": "..."}, the failure of the first piece in the range that failed. The process
ends when the socket closes.
"""

import json
import mmap
import os
import queue
import socket
import sys
import threading

import crc32c

MAX_MESSAGE = 1 << 16


PIECE = 4 << 20  # bytes read, then checksummed while they are still in the CPU's cache


def read_range(path: str, view: memoryview, offset: int, checksum: bool = True) -> int | None:
    """Read len(view) bytes of the file at offset into view; their crc32c (when ``checksum``), taken
    piece by piece as they land (one pass over memory fewer than checksumming the whole range after)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done, crc = 0, 0
        while done < len(view):
            piece = view[done: done + PIECE]
            got = 0
            while got < len(piece):
                n = os.preadv(fd, [piece[got:]], offset + done + got)
                if n <= 0:
                    raise EOFError(f"the file ends at byte {offset + done + got}, inside the range read")
                got += n
            if checksum:
                crc = crc32c.crc32c(piece, crc)
            piece.release()
            done += got
        return crc if checksum else None
    finally:
        os.close(fd)


class Read:
    """One read's pieces in flight: what each returned or why it failed, how many are left."""

    def __init__(self, msg: dict, pieces: int):
        self.msg, self.left = msg, pieces
        self.crcs: list = [None] * pieces
        self.errors: dict[int, str] = {}
        self.lock = threading.Lock()

    def done(self, k: int, crc, error: str | None) -> bool:
        """Piece k's outcome; True for the last piece to finish."""
        with self.lock:
            self.crcs[k] = crc
            if error is not None:
                self.errors[k] = error
            self.left -= 1
            return self.left == 0

    def answer(self) -> dict:
        """The read's answer: each piece's crc32c, or the failure of the first piece that failed (in
        the range's order, whichever finished first: a file that ends inside the range is reported
        where it ends)."""
        if self.errors:
            return {"id": self.msg["id"], "error": self.errors[min(self.errors)]}
        return {"id": self.msg["id"], "crcs": self.crcs}


def pieces(msg: dict) -> list[tuple[int, int]]:
    """A read's pieces: (first byte of the range, bytes); one empty piece for an empty range."""
    n, size = msg["nbytes"], msg.get("piece") or msg["nbytes"] or 1
    return [(start, min(size, n - start)) for start in range(0, n, size)] or [(0, 0)]


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    threads = int(sys.argv[2])
    buffers: dict[int, mmap.mmap] = {}
    work: queue.Queue = queue.Queue()
    send_lock = threading.Lock()

    def reply(message: dict) -> None:
        with send_lock:
            sock.send(json.dumps(message).encode())

    def read_piece(read: Read, k: int, start: int, n: int) -> None:
        msg, crc, error = read.msg, None, None
        try:
            view = memoryview(buffers[msg["buffer"]])[msg["at"] + start: msg["at"] + start + n]
            try:
                crc = read_range(msg["path"], view, msg["offset"] + start, msg.get("crc", True))
            finally:
                view.release()
        except OSError as e:
            error = f"{e.strerror or e}: {msg['path']}"
        except Exception as e:  # noqa: BLE001 - any failure is that read's, reported to the parent
            error = f"{type(e).__name__}: {e}"
        if read.done(k, crc, error):
            reply(read.answer())

    def run() -> None:
        while (job := work.get()) is not None:
            read_piece(*job)

    workers = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        while True:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                break
            msg = json.loads(data)
            if msg["op"] == "buffer":
                size = os.fstat(fds[0]).st_size
                # every page mapped now: a first read faulting them in one by one ran at half the rate
                buffers[msg["id"]] = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                os.close(fds[0])
            else:
                parts = pieces(msg)
                read = Read(msg, len(parts))
                for k, (start, n) in enumerate(parts):
                    work.put((read, k, start, n))
    except (ConnectionError, OSError):
        pass  # the parent is gone
    for _ in workers:
        work.put(None)


if __name__ == "__main__":
    main()
