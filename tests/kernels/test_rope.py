"""The PyTorch RoPE: a step's table applied to any rows is, to the bit, the rotate-half formula
at each row's position (what the model's keys and the reference kernels' queries rest on)."""

import torch

from lazyrag.kernels.rope import apply_rope, rope, rope_table


def formula(x, pos, inv_freq):
    half = x.shape[-1] // 2
    ang = pos.float()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def test_rope_table_rotates_to_the_bit_as_the_formula():
    gen = torch.Generator().manual_seed(0)
    for rows, heads, dim in ((1, 1, 64), (37, 3, 128), (300, 8, 64)):
        x = torch.randn(rows, heads, dim, generator=gen) * 5
        pos = torch.randint(0, 200_000, (rows,), generator=gen, dtype=torch.int32)
        inv_freq = 1.0 / (500_000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        want = formula(x, pos, inv_freq)
        assert torch.equal(rope(x, pos, inv_freq), want)
        table = rope_table(pos, inv_freq)
        assert torch.equal(apply_rope(x, table), want)
        assert torch.equal(apply_rope(x[:, :1], table), want[:, :1])  # one table serves any heads
