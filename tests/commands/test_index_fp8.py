"""`index` into an fp8 store: each chunk's KV is the model's own (computed as an fp32 store's is),
quantised per (token, KV head) row and packed with its scales."""

import json

import torch

from lazyrag import kernels
from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.store import Store, pack_fp8_rows

DOCS = {"a": "The Nile is about 6,650 kilometres long. It flows north into the Mediterranean Sea.",
        "b": "Iron has the symbol Fe and atomic number 26. Most of Earth's core is iron."}


def test_fp8_store_holds_the_fp32_kv_quantised_row_by_row(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    stores = {}
    for dtype in ("fp32", "fp8"):
        build_index(IndexConfig(corpus=corpus, store=tmp_path / dtype, model="random:tiny", device="cpu", dtype=dtype,
                                chunk_tokens=16), progress=False)
        stores[dtype] = Store.open(tmp_path / dtype)
    assert stores["fp8"].settings.kv_dtype == "float8_e4m3fn"
    assert stores["fp8"].settings.fingerprint != stores["fp32"].settings.fingerprint
    for doc in DOCS:
        pairs = list(zip(stores["fp32"].doc_chunks(doc), stores["fp8"].doc_chunks(doc), strict=True))
        assert len(pairs) > 1
        for full, fp8 in pairs:
            want = pack_fp8_rows(*kernels.quantize_fp8(stores["fp32"].read_kv(full)))
            assert torch.equal(stores["fp8"].read_kv(fp8), want)
    for store in stores.values():
        store.close()
