"""A chunk's crc32c computed where its bytes are: on the GPU, over the copy the loader made there.

Checked on the host, every byte read costs a crc32c pass on a CPU core, beside the copy out of
the page cache that the same cores make; on the GPU the pass costs a fraction of a millisecond
per chunk. A crc register is linear over GF(2) in the bits it reads: each 64-byte row's register
(read from zero) is its 512 bits times one 512 x 32 matrix, and the register of 16 consecutive
units is their 16 registers' bits times another, so a chunk's crc32c is one kernels.bit_rows
launch per level of that tree (7 for an 8B model's 264 MB chunk). Leading zero bytes leave a
register read from zero at zero, so each level pads its input at the front to whole rows.
"""

from __future__ import annotations

import crc32c
import torch

from lazyrag import kernels
from lazyrag.store.crc import after_zeros, byte_register, conditioning

ROW = 64   # bytes a bit_rows row reads
FOLD = 16  # registers (int32) in a row: what each level after the first folds into one
# each level's words start 64-byte aligned in the working memory: the kernel is compiled for
# 16-byte aligned pointers, and a level at another offset would compile a second variant mid-run
LEVEL_ALIGN = 16

_matrices: dict[tuple[int, str], torch.Tensor] = {}


def level_matrix(level: int, device: torch.device) -> torch.Tensor:
    """[512, 32] fp16 0/1, row 8 * byte + bit: at level 0, what each bit of a 64-byte row adds to
    the row's register; above, what each bit of a row of 16 registers (each of the bytes of
    64 * 16**(level - 1)) adds to the register of all their bytes."""
    key = (level, str(device))
    if key not in _matrices:
        words = []
        for i in range(8 * ROW):
            byte, bit = divmod(i, 8)
            if level == 0:
                words.append(after_zeros(byte_register(1 << bit), ROW - 1 - byte))
            else:  # the row's byte `byte` is byte byte % 4 of register byte // 4 (little-endian)
                unit = ROW * FOLD ** (level - 1)
                words.append(after_zeros(1 << (8 * (byte % 4) + bit), unit * (FOLD - 1 - byte // 4)))
        bits = [[(w >> c) & 1 for c in range(32)] for w in words]
        _matrices[key] = torch.tensor(bits, dtype=torch.float16, device=device)
    return _matrices[key]


def device_crc32c(data: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """crc32c of a contiguous uint8 vector's bytes, computed on its device: a one-element int32
    tensor there holding its 32 bits (``int(t) & 0xFFFFFFFF`` on the host). Queued on the current
    stream; nothing waits for it. ``scratch``: an int32 vector of at least ``scratch_words(n)``
    elements on that device that every level writes into (the result is a view of it), so that
    the check allocates nothing: an allocation on a reader thread's stream makes a device segment
    of its own, and making one waits for every copy in flight."""
    n = data.numel()
    if n == 0:
        return torch.zeros(1, dtype=torch.int32, device=data.device)
    level, x, used = 0, data, 0
    while True:
        rows = -(-x.numel() // ROW)
        last = rows == 1
        out = None if scratch is None else scratch[used: used + rows]
        x = kernels.bit_rows(x, rows * ROW - x.numel(), level_matrix(level, data.device),
                             conditioning(n) if last else 0, out=out)
        if last:
            return x
        x, level, used = x.view(torch.uint8), level + 1, used + aligned_words(rows)


def level_rows(nbytes: int) -> list[int]:
    """The registers each level of the crc32c of ``nbytes`` bytes makes (one bit_rows launch each)."""
    rows = [-(-nbytes // ROW)]
    while rows[-1] > 1:
        rows.append(-(-rows[-1] // FOLD))
    return rows


def levels(nbytes: int) -> int:
    """bit_rows launches (tree levels) for the crc32c of ``nbytes`` bytes."""
    return len(level_rows(nbytes))


def scratch_words(nbytes: int) -> int:
    """The int32 words device_crc32c's levels take for ``nbytes`` bytes (each level's start
    aligned): about one per 60 bytes, a fifteenth of their size. Give it memory that starts
    aligned too (a new tensor does)."""
    rows = level_rows(nbytes)
    return sum(aligned_words(r) for r in rows[:-1]) + rows[-1]


def aligned_words(words: int) -> int:
    """``words`` rounded up to whole LEVEL_ALIGN: where the next aligned level (or buffer) starts."""
    return -(-words // LEVEL_ALIGN) * LEVEL_ALIGN


def device_checks_work(device: torch.device, largest: int = 0) -> str | None:
    """Compile the kernel (one variant serves every size), build the matrices of every level a
    range of ``largest`` bytes needs, and check known bytes' crc32c on ``device`` against the
    host's, so that the first chunk read waits for none of it and a device that computes them
    wrongly (or cannot run the kernel) never fails sound chunks as corrupt. None when they agree,
    else why not."""
    gen = torch.Generator().manual_seed(0)
    try:
        for n in (1, ROW * FOLD + 1, ROW * FOLD * FOLD + 3):  # one, three and four levels
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            scratch = torch.empty(scratch_words(n), dtype=torch.int32, device=device)  # as the loader's checks
            got, want = int(device_crc32c(data.to(device), scratch)) & 0xFFFFFFFF, crc32c.crc32c(data.numpy())
            if got != want:
                return f"the crc32c of {n} known bytes on {device} came out {got:#010x}, not {want:#010x}"
        for level in range(levels(largest)):
            level_matrix(level, device)
    except Exception as e:  # a kernel that does not compile or run here: the host checks instead
        return f"crc32c on {device} failed ({type(e).__name__}: {e})"
    return None
