"""A small real store (four documents indexed with a given model) and requests over it."""

from __future__ import annotations

import json
from pathlib import Path

from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.serve import Engine, Request, Sequence
from lazyrag.store import Store

DOCS = {
    "nile": "The Nile is about 6,650 kilometres long. It flows north into the Mediterranean Sea.",
    "iron": "Iron has the symbol Fe and atomic number 26. Most of Earth's core is iron.",
    "tokyo": "Tokyo became the capital of Japan in 1868, when the emperor moved there from Kyoto.",
    "bach": "Johann Sebastian Bach was born in Eisenach in 1685 and worked in Leipzig.",
}


def make_store(tmp_path: Path, model: str, chunk_tokens: int = 16, dtype: str = "fp32") -> Store:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()))
    build_index(IndexConfig(corpus=corpus, store=tmp_path / "s.zarr", model=model, device="cpu", dtype=dtype,
                            chunk_tokens=chunk_tokens), progress=False)
    return Store.open(tmp_path / "s.zarr")


def request(store, fmt, rid, docs, question, max_new_tokens=6) -> Request:
    chunks = [c for d in docs for c in store.doc_chunks(d)]
    return Request(rid, chunks, fmt.question_ids(question), max_new_tokens)


def place(engine: Engine, requests: list[Request]) -> list[Sequence]:
    """Place requests as the scheduler would, without running them."""
    seqs = [Sequence(r) for r in requests]
    for seq in seqs:
        seq.placement = engine.mode.place(seq, engine.cache)
    return seqs


def step_logits(loaded, store, mode, requests: list[Request], **engine_kw):
    """The prefill logits of the requests' last prompt tokens, then a decode step's after each
    takes its greedy token."""
    engine = Engine(loaded, store, mode, cache_bytes=8 << 20, batch_size=4, **engine_kw)
    seqs = place(engine, requests)
    prefill = engine.runner.prefill(seqs)
    for s, t in zip(seqs, prefill.argmax(-1).tolist()):
        s.generated.append(t)
    decode = engine.runner.decode(seqs)
    engine.close()
    return prefill, decode
