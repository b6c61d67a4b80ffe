"""fp8 stores: rows of e4m3 values with their fp32 scale packed after them, read back bit for bit as
one byte range per chunk; about half of bf16's bytes; refused for runs of another KV dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from store_samples import add_documents, make_chunks, settings

from lazyrag import kernels
from lazyrag.store import (FP8_KV, Store, StoreMismatch, kv_to_storage, pack_fp8_rows, rows_dtype, torch_dtype,
                           unpack_fp8_rows)


def fp8_rows(s, chunks, seed=0) -> np.ndarray:
    """Quantised random KV for ``chunks`` as an fp8 store keeps it (padding rows zero)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(sum(s.padded(len(c.token_ids)) for c in chunks), s.num_layers, 2, s.num_kv_heads, s.head_dim)
    kv.normal_(generator=g)
    return kv_to_storage(pack_fp8_rows(*kernels.quantize_fp8(kv)))


def test_packed_rows_hold_values_then_scale_and_unpack_exactly():
    values, scales = kernels.quantize_fp8(torch.randn(5, 3, 2, 64))
    rows = pack_fp8_rows(values, scales)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, 2, 68)
    assert torch.equal(rows[..., :64], values.view(torch.uint8))
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32).squeeze(-1), scales)
    back_values, back_scales = unpack_fp8_rows(rows)
    assert torch.equal(back_values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(back_scales, scales)


@pytest.mark.parametrize("head_dim,bar", [(128, 0.52), (64, 0.56)])
def test_fp8_rows_with_their_scales_take_about_half_of_bf16(tmp_path, head_dim, bar):
    """The bytes of the same chunks in an fp8 and a bf16 store: the KV the catalog counts and the
    segment files on disk (scales, shard index and markers included)."""
    sizes = {}
    for kv_dtype in (FP8_KV, "bfloat16"):
        s = settings(kv_dtype=kv_dtype, head_dim=head_dim, num_layers=4)
        chunks = make_chunks(s, "doc", [40, 16, 77])
        g = torch.Generator().manual_seed(1)
        kv = torch.randn(sum(s.padded(len(c.token_ids)) for c in chunks), 4, 2, s.num_kv_heads, head_dim, generator=g)
        rows = pack_fp8_rows(*kernels.quantize_fp8(kv)) if kv_dtype == FP8_KV else kv.to(torch.bfloat16)
        with Store.create_or_open(tmp_path / kv_dtype, s) as store:
            add_documents(store, chunks, kv_to_storage(rows))
            kv_bytes = store.summary()["kv_bytes"]
        on_disk = sum(f.stat().st_size for f in (tmp_path / kv_dtype / "segments").rglob("*") if f.is_file())
        sizes[kv_dtype] = (s.row_bytes, kv_bytes, on_disk)
    for fp8, bf16 in zip(sizes[FP8_KV], sizes["bfloat16"]):
        assert fp8 <= bar * bf16, (fp8, bf16)
    assert sizes[FP8_KV][0] == 4 * 2 * 2 * (head_dim + 4)  # e4m3 values and one fp32 scale per row


def test_fp8_chunks_read_back_bit_exact_as_packed_rows(tmp_path):
    s = settings(kv_dtype=FP8_KV)
    assert s.row_shape[-1] == s.head_dim + 4 and rows_dtype(FP8_KV) == torch.uint8
    assert torch_dtype(FP8_KV) == torch.float8_e4m3fn
    chunks = make_chunks(s, "doc", [5, 16, 33])
    kv = fp8_rows(s, chunks)
    with Store.create_or_open(tmp_path / "s.zarr", s) as store:
        add_documents(store, chunks, kv)
    with Store.open(tmp_path / "s.zarr") as store:
        start = 0
        for c in chunks:
            got = store.read_kv(store.chunk(c.chunk_id))
            assert got.dtype == torch.uint8 and got.shape == (s.padded(len(c.token_ids)), *s.row_shape)
            assert np.array_equal(got.numpy(), kv[start: start + got.shape[0]])
            start += got.shape[0]


def test_fp8_store_refuses_other_dtypes_and_they_refuse_it(tmp_path):
    for stored, other in ((FP8_KV, "bfloat16"), ("bfloat16", FP8_KV)):
        path = tmp_path / stored
        Store.create_or_open(path, settings(kv_dtype=stored)).close()
        with pytest.raises(StoreMismatch, match=f'kv_dtype: store has "{stored}", this run has "{other}"'):
            Store.create_or_open(path, settings(kv_dtype=other))
