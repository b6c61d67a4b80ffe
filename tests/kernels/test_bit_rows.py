"""bit_rows (the GPU's crc32c building block) against its PyTorch reference and a plain Python
GF(2) product, and device_crc32c against the crc32c library, on fresh random bytes of odd sizes."""

import crc32c
import pytest
import torch

from lazyrag import kernels
from lazyrag.serve.device_checksums import device_crc32c


def python_bit_rows(data: bytes, pad: int, matrix: torch.Tensor, xor: int) -> list[int]:
    rows = -(-(pad + len(data)) // 64)
    padded = bytes(pad) + data + bytes(rows * 64 - pad - len(data))
    cols = [[int(matrix[i, c]) for i in range(512)] for c in range(32)]
    out = []
    for r in range(rows):
        bits = [(padded[64 * r + i // 8] >> (i % 8)) & 1 for i in range(512)]
        word = sum((sum(b & m for b, m in zip(bits, col)) & 1) << c for c, col in enumerate(cols)) ^ xor
        out.append(word - (1 << 32) if word >= 1 << 31 else word)
    return out


def reference_rows(data, pad, matrix, xor):
    out = torch.empty(-(-(pad + data.numel()) // 64), dtype=torch.int32)
    kernels.reference.bit_rows(data, pad, matrix, xor, out)
    return out


def random_case(gen, n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    matrix = torch.randint(0, 2, (512, 32), generator=gen).to(torch.float16)
    pad = int(torch.randint(0, 64, (1,), generator=gen))
    xor = int(torch.randint(0, 1 << 32, (1,), generator=gen, dtype=torch.int64))
    return data, pad, matrix, xor


def test_reference_is_the_gf2_product_row_by_row():
    gen = torch.Generator().manual_seed(1)
    for n in (1, 64, 130):
        data, pad, matrix, xor = random_case(gen, n)
        got = reference_rows(data, pad, matrix, xor)
        assert got.dtype == torch.int32
        assert got.tolist() == python_bit_rows(bytes(data.tolist()), pad, matrix, xor)


def test_kernel_matches_reference_on_odd_sizes_pads_and_top_bits(interp):
    gen = torch.Generator().manual_seed(2)
    for n in (1, 63, 64, 65, 4000, 64 * 64 * 2 + 17):  # the last spans three programs, the third partly
        data, pad, matrix, xor = random_case(gen, n)
        want = reference_rows(data, pad, matrix, xor)
        assert torch.equal(kernels.bit_rows(data, pad, matrix, xor), want)
        assert (want < 0).any() or n < 1000  # words with bit 31 set come back as negative int32
        out = torch.full_like(want, 7)
        assert kernels.bit_rows(data, pad, matrix, xor, out=out) is out and torch.equal(out, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_device_crc32c_is_the_crc32c_of_the_bytes(request, backend):
    if backend == "triton":
        request.getfixturevalue("interp")  # CPU tensors through the Triton interpreter from here on
    gen = torch.Generator().manual_seed(3)
    # one level (<= 64 bytes), two, three, and five (past 64 * 16**3 bytes)
    for n in (0, 1, 5, 64, 65, 1024, 1025, 16_385, 64 * 16**3 + 4_099):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        assert int(device_crc32c(data)) & 0xFFFFFFFF == crc32c.crc32c(data.numpy().tobytes()), n


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_device_crc32c_in_given_working_memory_allocates_no_level(request, backend, monkeypatch):
    from lazyrag.serve import device_checksums

    if backend == "triton":
        request.getfixturevalue("interp")
    real, outs = kernels.bit_rows, []
    monkeypatch.setattr(kernels, "bit_rows", lambda *a, out=None: outs.append(out) or real(*a, out=out))
    gen = torch.Generator().manual_seed(6)
    for n in (1, 65, 16_385, 64 * 16**3 + 4_099):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        scratch = torch.full((device_checksums.scratch_words(n),), -1, dtype=torch.int32)
        outs.clear()
        got = device_checksums.device_crc32c(data, scratch)
        assert int(got) & 0xFFFFFFFF == crc32c.crc32c(data.numpy().tobytes()), n
        assert len(outs) == device_checksums.levels(n) and all(o is not None for o in outs)
        start, end = scratch.data_ptr(), scratch.data_ptr() + 4 * scratch.numel()
        assert all(start <= o.data_ptr() < end for o in outs) and start <= got.data_ptr() < end
        # each level 64-byte aligned: the kernel's one compiled variant takes 16-byte aligned pointers
        assert all((o.data_ptr() - start) % 64 == 0 for o in outs)
        with pytest.raises(ValueError, match="out must be"):  # a word short: the last level has no room
            device_checksums.device_crc32c(data, scratch[:-1])


def test_a_changed_byte_changes_the_crc():
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    before = int(device_crc32c(data))
    data[77_777] ^= 1
    assert int(device_crc32c(data)) != before


def test_bad_arguments_are_refused():
    matrix = torch.zeros(512, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="uint8"):
        kernels.bit_rows(torch.zeros(8, dtype=torch.int32), 0, matrix)
    with pytest.raises(ValueError, match="512, 32"):
        kernels.bit_rows(torch.zeros(8, dtype=torch.uint8), 0, matrix[:, :16].contiguous())
    with pytest.raises(ValueError, match="pad"):
        kernels.bit_rows(torch.zeros(8, dtype=torch.uint8), 64, matrix)
    with pytest.raises(ValueError, match="out must be a contiguous int32 vector of 2"):
        kernels.bit_rows(torch.zeros(65, dtype=torch.uint8), 0, matrix, out=torch.zeros(1, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_crc32c_of_an_8b_chunk_and_odd_sizes():
    gen = torch.Generator().manual_seed(5)
    for n in (3, 1_000_003, 264 * 2**20 + 4_097):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        got = device_crc32c(data.cuda())
        assert int(got) & 0xFFFFFFFF == crc32c.crc32c(data.numpy().tobytes()), n
        small = data[: 200_000].cuda()
        assert torch.equal(kernels.bit_rows(small, 5, torch.ones(512, 32, dtype=torch.float16, device="cuda")).cpu(),
                           reference_rows(small.cpu(), 5, torch.ones(512, 32, dtype=torch.float16), 0))


def test_the_self_check_builds_every_level_the_largest_chunk_needs_and_passes(monkeypatch):
    from lazyrag.serve import device_checksums

    assert [device_checksums.levels(n) for n in (1, 64, 65, 1024, 1025, 16384, 16385, 264 << 20)] == [
        1, 1, 2, 2, 3, 3, 4, 7]  # an 8B model's 264 MB chunk: 7 launches
    real, launches = kernels.bit_rows, []
    monkeypatch.setattr(kernels, "bit_rows", lambda *a, **k: launches.append(1) or real(*a, **k))
    for n in (65, 16385, 1_000_003):  # what levels() counts is what device_crc32c launches
        launches.clear()
        device_checksums.device_crc32c(torch.zeros(n, dtype=torch.uint8))
        assert len(launches) == device_checksums.levels(n), n
    device_checksums._matrices.clear()
    assert device_checksums.device_checks_work(torch.device("cpu"), largest=264 << 20) is None
    assert set(device_checksums._matrices) == {(level, "cpu") for level in range(7)}
