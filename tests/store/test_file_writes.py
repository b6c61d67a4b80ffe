"""Segment files written past the page cache: the file holds exactly the bytes given, whether the
array is aligned or not, its length a multiple of the alignment or not, and where the filesystem
refuses O_DIRECT."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from lazyrag.store import file_writes
from lazyrag.store.file_writes import ALIGN, aligned_empty, write_new_file


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("nbytes", [100, 3 * ALIGN, 5 * ALIGN + 17])
def test_the_file_holds_the_parts_back_to_back(tmp_path, monkeypatch, aligned, nbytes):
    monkeypatch.setattr(file_writes, "PIECE", 2 * ALIGN)  # several writes per file
    data = _bytes(nbytes, 0)
    if aligned:
        head = aligned_empty(nbytes)
        head[:] = data
        assert head.ctypes.data % ALIGN == 0
    else:
        head = aligned_empty(nbytes + 1)[1:]
        head[:] = data
    index = _bytes(40, 1).view("<u8")
    write_new_file(tmp_path / "shard", [head, index])
    assert (tmp_path / "shard").read_bytes() == data.tobytes() + index.tobytes()
    with pytest.raises(FileExistsError):  # never over an existing file
        write_new_file(tmp_path / "shard", [head])


def test_a_filesystem_without_o_direct_gets_the_same_bytes(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    data = _bytes(4 * ALIGN + 3, 2)
    write_new_file(tmp_path / "shard", [data, _bytes(16, 3)])
    assert (tmp_path / "shard").read_bytes() == data.tobytes() + _bytes(16, 3).tobytes()
