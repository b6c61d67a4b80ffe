"""The reader process (see read_process.py): reads byte ranges of files into shared buffers.

Run as a plain script, importing neither lazyrag nor torch, so it starts in milliseconds. Its
one argument is the number of the AF_UNIX SOCK_SEQPACKET socket it talks on; its second the
reads it runs at once. Messages are JSON objects, one a packet:

  {"op": "buffer", "id": B}  + one file descriptor: a memfd to map as buffer B
  {"op": "read", "id": R, "buffer": B, "at": A, "path": P, "offset": O, "nbytes": N, "crc": true|false}

and each read is answered {"id": R, "crc": C} (the crc32c of the N bytes now at A in buffer B, or
null when the read asked for none: the GPU checks them) or {"id": R, "error": "..."}. The
process ends when the socket closes.
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


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    threads = int(sys.argv[2])
    buffers: dict[int, mmap.mmap] = {}
    work: queue.Queue = queue.Queue()
    send_lock = threading.Lock()

    def reply(message: dict) -> None:
        with send_lock:
            sock.send(json.dumps(message).encode())

    def run() -> None:
        while (msg := work.get()) is not None:
            try:
                buf = buffers[msg["buffer"]]
                view = memoryview(buf)[msg["at"]: msg["at"] + msg["nbytes"]]
                reply({"id": msg["id"], "crc": read_range(msg["path"], view, msg["offset"], msg.get("crc", True))})
                view.release()
            except OSError as e:
                reply({"id": msg["id"], "error": f"{e.strerror or e}: {msg['path']}"})
            except Exception as e:  # noqa: BLE001 - any failure is that read's, reported to the parent
                reply({"id": msg["id"], "error": f"{type(e).__name__}: {e}"})

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
                work.put(msg)
    except (ConnectionError, OSError):
        pass  # the parent is gone
    for _ in workers:
        work.put(None)


if __name__ == "__main__":
    main()
