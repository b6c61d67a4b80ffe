"""rows_to_pages (a chunk's store rows into pool pages) against its PyTorch reference and a plain
loop over tokens, on fresh random rows of odd sizes, scattered page ids and every pool dtype;
pages not named are left as they were."""

import pytest
import torch

from lazyrag import kernels

FP8 = getattr(torch, "float8_e4m3fn", None)


def random_rows(gen, tokens, layers, unit, dtype):
    bits = torch.randint(-(1 << 15), 1 << 15, (tokens, layers, 2, *unit), dtype=torch.int32, generator=gen)
    if dtype == FP8:  # any byte but NaN's (0x7f, 0xff), so equality holds
        return (bits & 0x7E).to(torch.uint8).view(FP8)
    return bits.to(dtype) if dtype.is_floating_point else bits


def looped(rows, pool, pages):
    out = pool.clone()
    page_size = pool.shape[3]
    for i, page in enumerate(pages.tolist()):
        for j in range(page_size):
            out[:, :, page, j] = rows[i * page_size + j].transpose(0, 1)
    return out


CASES = [  # (pages in the pool, page ids written, page size, layers, unit of one (layer, kv) piece, dtype)
    (9, [7, 0, 3], 4, 3, (2, 5), torch.bfloat16),
    (5, [4], 1, 1, (1,), torch.float32),
    (12, [2, 11, 5, 6], 3, 2, (3,), torch.float32),  # fp8 rows' scales: one float per head
    (6, [1, 3], 8, 4, (3, 7), FP8),
    (40, list(range(39, 2, -3)), 5, 2, (4, 6), torch.float16),  # thirteen pages, backwards
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_rows_land_in_their_pages_and_nowhere_else(request, backend, case):
    if backend == "triton":
        request.getfixturevalue("interp")
    num_pages, ids, page_size, layers, unit, dtype = CASES[case]
    if dtype is None:
        pytest.skip("this torch has no float8_e4m3fn")
    gen = torch.Generator().manual_seed(case)
    pages = torch.tensor(ids)
    rows = random_rows(gen, len(ids) * page_size, layers, unit, dtype)
    pool = random_rows(gen, num_pages * page_size, layers, unit, dtype).view(num_pages, page_size, layers, 2, *unit)
    pool = pool.permute(3, 2, 0, 1, *range(4, 4 + len(unit))).contiguous()  # [2, layers, pages, page_size, *unit]
    want = looped(rows, pool, pages)
    kernels.rows_to_pages(rows, pool, pages)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))


def test_a_page_longer_than_a_program_is_written_whole(interp):
    gen = torch.Generator().manual_seed(9)
    rows = random_rows(gen, 2 * 70, 1, (3, 41), torch.bfloat16)  # 70 * 123 = 8,610 elements a page: 3 programs
    pool = torch.zeros(2, 1, 4, 70, 3, 41, dtype=torch.bfloat16)
    pages = torch.tensor([3, 1])
    want = looped(rows, pool, pages)
    kernels.rows_to_pages(rows, pool, pages)
    assert torch.equal(pool, want)


def test_rows_that_do_not_fit_the_pool_are_refused():
    pool = torch.zeros(2, 2, 4, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="shape"):
        kernels.rows_to_pages(torch.zeros(8, 2, 2, 4), pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32"):
        kernels.rows_to_pages(torch.zeros(8, 2, 2, 3, dtype=torch.bfloat16), pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        kernels.rows_to_pages(torch.zeros(8, 2, 2, 3), pool, torch.tensor([0.0, 1.0]))
