"""BM25 retrieval of chunks for queries that name no documents.

The index is built once from the store's chunk texts and kept beside it (in
`<store>/bm25/`, or beside the local catalog of a store on object storage; plain numpy and
JSON, no pickle); it is rebuilt when the store's set of visible chunks changes. On a store
that cannot be written it lives in memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import bm25s

from lazyrag.store import Store


class Retriever:
    def __init__(self, store: Store):
        self.path = store.local_dir / "bm25"
        chunks = list(store.iter_chunks())
        self.chunk_ids = [c.chunk_id for c in chunks]
        # every id, not a count: a re-indexed document changes the set but maybe not its size
        stamp = {"chunks": len(chunks), "ids": hashlib.sha256("\n".join(self.chunk_ids).encode()).hexdigest()}
        stamp_file = self.path / "stamp.json"
        if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
            self.bm25 = bm25s.BM25.load(str(self.path), allow_pickle=False, show_progress=False)
            self.chunk_ids = json.loads((self.path / "chunk_ids.json").read_text())
            return
        self.bm25 = bm25s.BM25()
        if chunks:
            self.bm25.index(bm25s.tokenize([c.text for c in chunks], show_progress=False), show_progress=False)
        try:
            self._save(stamp)
        except OSError:
            pass  # a read-only store: this run keeps the index in memory

    def _save(self, stamp: dict) -> None:
        tmp = self.path.with_name("bm25.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.bm25.save(str(tmp), allow_pickle=False, show_progress=False)
        (tmp / "chunk_ids.json").write_text(json.dumps(self.chunk_ids))
        (tmp / "stamp.json").write_text(json.dumps(stamp))
        shutil.rmtree(self.path, ignore_errors=True)
        tmp.rename(self.path)

    def top_k(self, question: str, k: int) -> list[str]:
        k = min(k, len(self.chunk_ids))
        if k == 0:
            return []
        tokens = bm25s.tokenize([question], show_progress=False)
        docs, scores = self.bm25.retrieve(tokens, k=k, show_progress=False)
        return [self.chunk_ids[int(i)] for i, s in zip(docs[0], scores[0]) if s > 0] or \
               [self.chunk_ids[int(i)] for i in docs[0]]
