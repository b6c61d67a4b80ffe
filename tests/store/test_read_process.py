"""The reader process: byte ranges land in shared buffers with their crc32c; failures name the
file; a process that dies fails the reads in flight and the next read starts a new one."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pytest

from lazyrag.store.format import StoreError
from lazyrag.store.read_process import ReadProcess, SharedBuffer


@pytest.fixture
def reads():
    process = ReadProcess(threads=3)
    yield process
    process.close()


def test_ranges_land_where_asked_with_their_crc32c(tmp_path, reads):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "segment"
    path.write_bytes(data)
    # (place in the buffer, first byte of the file, bytes), not overlapping in the buffer
    ranges = [(0, 0, 1000), (1000, 5, 1 << 20), (2 << 20, 12345, len(data) - 12345), (1500_000, 999_999, 1)]
    buf = SharedBuffer(6 << 20)
    buf.tensor.fill_(7)
    with ThreadPoolExecutor(4) as pool:  # several threads at once, each waiting for its own answer
        crcs = list(pool.map(lambda r: reads.read(buf, r[0], path, r[1], r[2]), ranges))
    expected = bytearray([7]) * buf.nbytes
    for (at, offset, n), crc in zip(ranges, crcs):
        assert crc == crc32c.crc32c(data[offset: offset + n])
        expected[at: at + n] = data[offset: offset + n]
    assert bytes(buf.tensor.numpy()) == bytes(expected)


def test_a_missing_file_or_a_short_one_is_a_store_error_naming_it(tmp_path, reads):
    buf = SharedBuffer(4096)
    with pytest.raises(StoreError, match="missing-segment"):
        reads.read(buf, 0, tmp_path / "missing-segment", 0, 100)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    with pytest.raises(StoreError, match="ends at byte 100"):
        reads.read(buf, 0, short, 50, 100)
    with pytest.raises(ValueError, match="outside"):
        reads.read(buf, 4000, short, 0, 100)
    assert reads.read(buf, 0, short, 0, 100) == crc32c.crc32c(b"x" * 100)  # the process is still there


def test_a_dead_process_fails_the_reads_in_flight_and_the_next_read_starts_another(tmp_path, reads):
    buf = SharedBuffer(4096)
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def blocked_read():
        try:
            reads.read(buf, 0, fifo, 0, 10)
        except StoreError as e:
            errors.append(e)

    t = threading.Thread(target=blocked_read)
    t.start()
    while reads._child is None or not reads._child.waiting:
        threading.Event().wait(0.01)
    first = reads._child.proc
    first.kill()
    t.join(timeout=30)
    assert not t.is_alive() and len(errors) == 1 and "ended" in str(errors[0])
    data = tmp_path / "data"
    data.write_bytes(b"abc" * 100)
    assert reads.read(buf, 10, data, 0, 300) == crc32c.crc32c(b"abc" * 100)  # a new process, the buffer sent again
    assert reads._child.proc.pid != first.pid
    assert bytes(buf.tensor[10:310].numpy()) == b"abc" * 100


def test_a_range_read_in_pieces_lands_whole_with_the_crc32c_of_all_of_it(tmp_path, reads, monkeypatch):
    from lazyrag.store import read_process

    monkeypatch.setattr(read_process, "PIECE_BYTES", 64 * 1024 + 3)  # odd, so pieces end mid-page
    data = os.urandom(1 << 20)
    path = tmp_path / "segment"
    path.write_bytes(data)
    buf = SharedBuffer(2 << 20)
    assert reads.read(buf, 5, path, 1000, len(data) - 1000) == crc32c.crc32c(data[1000:])
    assert bytes(buf.tensor[5: 5 + len(data) - 1000].numpy()) == data[1000:]
    short = tmp_path / "short"
    short.write_bytes(data[: 200_000])  # the first pieces read, a later one runs off the end
    with pytest.raises(StoreError, match="ends at byte 200000"):
        reads.read(buf, 0, short, 0, 300_000)


def test_a_read_of_many_pieces_is_one_message_each_way(tmp_path, reads, monkeypatch):
    from lazyrag.store import read_process

    monkeypatch.setattr(read_process, "PIECE_BYTES", 4096)
    data = os.urandom(100 * 4096 + 5)  # 101 pieces, the last of 5 bytes
    path = tmp_path / "segment"
    path.write_bytes(data)
    buf = SharedBuffer(len(data))
    child = reads._running()
    sent, answered = [], []
    real_send, real_set = child.send, read_process.Future.set_result
    monkeypatch.setattr(child, "send", lambda msg, fds=(): sent.append(msg["op"]) or real_send(msg, fds))
    monkeypatch.setattr(read_process.Future, "set_result", lambda f, r: answered.append(r) or real_set(f, r))
    assert reads.read(buf, 0, path, 0, len(data)) == crc32c.crc32c(data)
    assert sent == ["buffer", "read"] and len(answered) == 1 and len(answered[0]["crcs"]) == 101
    assert bytes(buf.tensor.numpy()) == data


def test_the_process_cuts_a_read_into_pieces_of_the_size_asked():
    import importlib.util

    from lazyrag.store import read_process

    spec = importlib.util.spec_from_file_location("read_process_child", read_process.CHILD)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    assert child.pieces({"nbytes": 10, "piece": 4}) == [(0, 4), (4, 4), (8, 2)]
    assert child.pieces({"nbytes": 8, "piece": 4}) == [(0, 4), (4, 4)]
    assert child.pieces({"nbytes": 0, "piece": 4}) == [(0, 0)]
    assert child.pieces({"nbytes": 7}) == [(0, 7)]  # no piece size: the range whole
    read = child.Read({"id": 3}, 3)  # pieces finishing out of order, two of them failing
    assert not read.done(2, None, "EOFError: the file ends at byte 300")
    assert not read.done(0, 11, None)
    assert read.done(1, None, "EOFError: the file ends at byte 250")
    assert read.answer() == {"id": 3, "error": "EOFError: the file ends at byte 250"}  # the first in the range
    read = child.Read({"id": 4}, 2)
    read.done(1, 22, None)
    read.done(0, 11, None)
    assert read.answer() == {"id": 4, "crcs": [11, 22]}


def test_a_read_without_a_checksum_lands_the_same_bytes_and_returns_none(tmp_path, reads):
    data = os.urandom(40 << 20)  # several 16 MB pieces
    path = tmp_path / "segment"
    path.write_bytes(data)
    buf = SharedBuffer(len(data))
    assert reads.read(buf, 0, path, 0, len(data), checksum=False) is None
    assert bytes(buf.tensor.numpy()) == data
    assert reads.read(buf, 0, path, 0, len(data)) == crc32c.crc32c(data)


def resident_kib(pid: int, size: int) -> int | None:
    """The resident KiB of process ``pid``'s staging mapping of ``size`` bytes (None: not mapped)."""
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()
        if "lazyrag-staging" in line and int(head[0].split("-")[1], 16) - int(head[0].split("-")[0], 16) == size:
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    return None


def test_a_buffer_shared_ahead_is_mapped_whole_before_any_read(reads):
    # every page mapped at once: a first read that faulted them in one by one ran 5x slower
    buf = SharedBuffer(8 << 20)
    buf.tensor.fill_(1)  # the pages exist, as a pinned buffer's do
    reads.share(buf)
    pid = reads._running().proc.pid
    deadline = time.monotonic() + 5
    while resident_kib(pid, buf.nbytes) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident_kib(pid, buf.nbytes) == buf.nbytes >> 10
