"""Chunks read as pieces on several threads: exactly the stored bytes, the pieces' checksums
combined into the chunk's, a corrupt piece anywhere caught as the whole-chunk check catches it."""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest
from store_samples import add_documents, make_chunks, random_kv, rows_of, settings

from lazyrag.errors import InputError
from lazyrag.failures import classify
from lazyrag.store import ChunkReadError, SegmentReader, Store, StoreError
from lazyrag.store.crc import crc32c_combine
from lazyrag.store.parallel_reads import READ_THREADS_VAR, ParallelReads, default_threads


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (5, 0), (0, 7), (1, 1), (4096, 13), (100_003, 65_536)])
def test_combined_checksums_equal_the_checksum_of_the_whole(len_a, len_b):
    rng = np.random.default_rng(len_a + len_b)
    a, b = rng.bytes(len_a), rng.bytes(len_b)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len_b) == crc32c.crc32c(a + b)


def test_pieces_fill_the_whole_view_and_return_its_checksum():
    source = np.random.default_rng(0).bytes(10_007)
    asked = []

    def read_into(view, offset):
        asked.append((offset, len(view)))
        view[:] = source[offset: offset + len(view)]

    out = bytearray(len(source) - 7)
    reads = ParallelReads(threads=3, piece_bytes=1000)
    assert reads.read(read_into, memoryview(out), 7) == crc32c.crc32c(source[7:])
    assert bytes(out) == source[7:]
    assert sorted(asked) == [(7 + s, min(1000, 10_000 - s)) for s in range(0, 10_000, 1000)]
    reads.close()


def test_a_failing_piece_raises_after_every_piece_has_stopped():
    done = []

    def read_into(view, offset):
        if offset == 3000:
            raise StoreError("the segment file ends at byte 3000, inside the chunk")
        view[:] = bytes(len(view))
        done.append(offset)

    reads = ParallelReads(threads=2, piece_bytes=1000)
    with pytest.raises(StoreError, match="ends at byte 3000"):
        reads.read(read_into, memoryview(bytearray(8000)), 0)
    assert sorted(done) == [0, 1000, 2000, 4000, 5000, 6000, 7000]
    reads.close()


def _store(path):
    s = settings()
    chunks = make_chunks(s, "a", [40, 17, 33], seed=3)
    kv = random_kv(s, chunks, 3)
    with Store.create_or_open(path, s) as st:
        add_documents(st, chunks, kv)
        infos = [st.chunk(c.chunk_id) for c in chunks]
    return s, chunks, kv, infos


def test_a_chunk_read_in_pieces_is_the_bytes_written(tmp_path):
    path = tmp_path / "s.zarr"
    s, chunks, kv, infos = _store(path)
    assert infos[0].padded_length * s.row_bytes > 10 * 1000  # many pieces, cut mid-row
    reader = SegmentReader(path, s, reads=ParallelReads(threads=3, piece_bytes=1000))
    for i, info in enumerate(infos):
        np.testing.assert_array_equal(reader.read_kv(info).numpy(), rows_of(kv, s, chunks, i))
        np.testing.assert_array_equal(reader.read_kv(info, whole=True).numpy(), rows_of(kv, s, chunks, i))
    reader.close()


def test_a_corrupt_byte_in_a_middle_piece_fails_the_chunk_read(tmp_path):
    path = tmp_path / "s.zarr"
    s, chunks, kv, infos = _store(path)
    bad = infos[0]
    shard = next(p for p in (path / "segments" / bad.segment / "c").rglob("*") if p.is_file())
    with open(shard, "r+b") as f:  # in the sixth 1000-byte piece of the first chunk
        f.seek(bad.offset * s.row_bytes + 5_321)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    reader = SegmentReader(path, s, reads=ParallelReads(threads=3, piece_bytes=1000))
    with pytest.raises(ChunkReadError, match=f"chunk {bad.chunk_id} .*checksum does not match") as err:
        reader.read_kv(bad)
    with pytest.raises(ChunkReadError, match="checksum does not match"):
        reader.read_kv(bad, whole=True)  # in one piece, checked the same
    assert err.value.corrupt and classify(err.value).code == 4  # `lazyrag` exits 4, as for any damaged chunk
    np.testing.assert_array_equal(reader.read_kv(infos[1]).numpy(), rows_of(kv, s, chunks, 1))  # the rest reads
    reader.close()


def test_read_threads_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(READ_THREADS_VAR, "3")
    assert default_threads() == 3
    monkeypatch.setenv(READ_THREADS_VAR, "none")
    with pytest.raises(InputError, match=f"{READ_THREADS_VAR} must be a whole number"):
        default_threads()
    monkeypatch.delenv(READ_THREADS_VAR)
    assert 1 <= default_threads() <= 16
