"""Sample settings, chunks and KV shared by the store's tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lazyrag.store import NewChunk, StoreSettings, chunk_id_for, kv_to_storage, storage_dtype

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 16


def settings(**changes) -> StoreSettings:
    base = StoreSettings(
        model="random:tiny",
        fingerprint="f" * 8 + "0123",
        kv_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        preamble_ids=(1, 2, 3),
        rope={"theta": 10000.0},
        chunking={"chunk_tokens": 64, "splitter": "paragraph-sentence-v1"},
        encoding={"attend": "preamble+self"},
    )
    return dataclasses.replace(base, **changes)


def make_chunks(s: StoreSettings, doc_id: str, lengths, seed: int = 0) -> list[NewChunk]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = tuple(int(t) for t in rng.integers(0, 50_000, size=n))
        out.append(NewChunk(chunk_id_for(s, ids), doc_id, i, ids, f"{doc_id} chunk {i}"))
    return out


def random_kv(s: StoreSettings, chunks, seed: int = 0) -> np.ndarray:
    """Random KV in the storage dtype; padding rows zero, as an indexer makes them."""
    rng = np.random.default_rng(seed)
    parts = []
    for c in chunks:
        rows = np.zeros((s.padded(len(c.token_ids)), *s.row_shape), dtype=storage_dtype(s.kv_dtype))
        n = len(c.token_ids)
        if s.kv_dtype == "bfloat16":
            rows[:n] = rng.integers(0, 2**16, size=(n, *s.row_shape), dtype=np.uint16)  # every bit pattern
        else:
            rows[:n] = rng.standard_normal((n, *s.row_shape)).astype(rows.dtype)
        parts.append(rows)
    return np.concatenate(parts)


def rows_of(kv: np.ndarray, s: StoreSettings, chunks, i: int) -> np.ndarray:
    start = sum(s.padded(len(c.token_ids)) for c in chunks[:i])
    return kv[start : start + s.padded(len(chunks[i].token_ids))]


def as_bits(t: torch.Tensor) -> np.ndarray:
    return kv_to_storage(t).view(np.uint8)


def add_documents(store, chunks, kv: np.ndarray) -> None:
    """Record the documents of ``chunks`` and store their KV, as ``lazyrag index`` does."""
    store.put_documents(chunks)
    store.append(chunks, kv)
