"""The store's format: settings, compat key, chunk ids, KV dtypes, refusing other settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from store_samples import HEAD_DIM, HEADS, LAYERS, settings

from lazyrag.store import Store, StoreError, StoreMismatch, StoreSettings, chunk_id_for, kv_to_storage, torch_dtype


def test_kv_to_storage_bf16_bits():
    t = torch.randn(4, 3, dtype=torch.float32).to(torch.bfloat16)
    bits = kv_to_storage(t)
    assert bits.dtype == np.uint16
    assert torch.equal(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), t)


def test_dtypes_and_row_bytes():
    expected = [torch.bfloat16, torch.float16, torch.float32]
    assert [torch_dtype(d) for d in ("bfloat16", "float16", "float32")] == expected
    with pytest.raises(StoreError, match="unsupported kv_dtype"):
        torch_dtype("int8")
    assert settings(kv_dtype="bfloat16").row_bytes == LAYERS * 2 * HEADS * HEAD_DIM * 2
    assert settings(kv_dtype="float32").row_bytes == LAYERS * 2 * HEADS * HEAD_DIM * 4


def test_mismatch_refused_with_both_fingerprints(tmp_path):
    path = tmp_path / "s.zarr"
    Store.create_or_open(path, settings()).close()
    other = settings(fingerprint="abcdef987654", model="other-model")
    with pytest.raises(StoreMismatch) as e:
        Store.create_or_open(path, other)
    msg = str(e.value)
    assert settings().fingerprint in msg and "abcdef987654" in msg and "--store" in msg
    with pytest.raises(StoreMismatch, match="chunking"):
        Store.create_or_open(path, settings(chunking={"chunk_tokens": 128, "splitter": "paragraph-sentence-v1"}))
    changes = ({"kv_dtype": "float16"}, {"page_size": 32}, {"preamble_ids": (1, 2)}, {"encoding": {"attend": "self"}})
    for change in changes:
        with pytest.raises(StoreMismatch):
            Store.create_or_open(path, settings(**change))
    # the display name and informational rope parameters do not block reuse
    Store.create_or_open(path, settings(model="renamed", rope={"theta": 10000.0, "note": "x"})).close()


def test_chunk_id_stable_and_content_addressed():
    s = settings()
    ids = (5, 6, 7)
    cid = chunk_id_for(s, ids)
    assert len(cid) == 24 and int(cid, 16) >= 0
    assert cid == chunk_id_for(settings(), [5, 6, 7])  # same content, same id
    assert cid == chunk_id_for(settings(model="renamed"), ids)
    assert chunk_id_for(s, (5, 6, 8)) != cid
    assert chunk_id_for(s, (5, 6)) != chunk_id_for(s, (5, 6, 0))
    assert chunk_id_for(settings(fingerprint="beef"), ids) != cid
    assert chunk_id_for(settings(chunking={"chunk_tokens": 32}), ids) != cid
    assert chunk_id_for(settings(encoding={"attend": "self"}), ids) != cid
    # pinned value: if this changes, every existing store's chunk ids change with it
    # (bump FORMAT_VERSION when that is intended)
    assert cid == "58603fa1a1a7ae6696454266"
    assert s.compat_key() == StoreSettings.from_json(json.loads(json.dumps(s.to_json()))).compat_key()


def test_settings_json_round_trip():
    s = settings()
    d = json.loads(json.dumps(s.to_json()))
    assert StoreSettings.from_json(d) == s
    with pytest.raises(StoreError):
        settings(kv_dtype="int8")


@pytest.mark.parametrize("change, says", [
    ({"page_size": None}, "'page_size' is null, expected an integer"),
    ({"num_layers": True}, "'num_layers' is a boolean, expected an integer"),
    ({"chunking": []}, "'chunking' is a list, expected an object"),
    ({"preamble_ids": [1, 2.5]}, "'preamble_ids' is a list, expected a list of integers"),
    ({"fingerprint": ...}, "'fingerprint' is missing"),
])
def test_settings_from_json_name_a_missing_or_mistyped_setting(change, says):
    d = {**settings().to_json(), **change}
    d = {k: v for k, v in d.items() if v is not ...}
    with pytest.raises(StoreError, match=says):
        StoreSettings.from_json(d)
