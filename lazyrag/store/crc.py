"""crc32c arithmetic: what a run of zero bytes does to a crc, and crcs of concatenations.

A crc register is a polynomial over GF(2) modulo Castagnoli's; reading n zero bytes multiplies
it by x^(8n). These let pieces read on different threads combine into the chunk's crc32c (the
one the catalog records), and let the GPU's check (lazyrag/serve/device_checksums.py) build the
bit matrices it needs.
"""

from __future__ import annotations

from functools import lru_cache

# crc32c's polynomial, bit-reflected (Castagnoli)
_POLY = 0x82F63B78
_ONES = 0xFFFFFFFF


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial, both bit-reflected (x^0 is the top bit)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _powers()


@lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending nbytes zero bytes does to a crc."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of A followed by B, from crc32c(A), crc32c(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_shift(len_b), crc_a) ^ crc_b


def after_zeros(register: int, nbytes: int) -> int:
    """A crc register after it reads ``nbytes`` zero bytes."""
    return _multmodp(_shift(nbytes), register)


def byte_register(value: int) -> int:
    """The register after reading the one byte ``value`` from zero."""
    r = value
    for _ in range(8):
        r = (r >> 1) ^ _POLY if r & 1 else r >> 1
    return r


def conditioning(nbytes: int) -> int:
    """What turns the register read from zero over ``nbytes`` bytes into their crc32c (which starts
    from all ones and inverts the end): crc32c = register ^ conditioning(nbytes)."""
    return after_zeros(_ONES, nbytes) ^ _ONES
