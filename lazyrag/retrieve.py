"""BM25 retrieval of chunks for queries that name no documents.

The index is built from the store's chunk texts when a query first needs it, and kept beside
the store (in `<store>/bm25/`, or beside the local catalog of a store on object storage; plain
numpy and JSON, loaded with allow_pickle=False, never unpickled). Its stamp names the chunks it
covers and the sha256 of each of its files: a stale index (the visible chunks changed) or a
damaged one (a file changed, missing or unreadable) is rebuilt from the catalog, never trusted.
On a store that cannot be written it lives in memory.

The corpus is laid out in a stable order, by document id then chunk index, and ties between
equal scores go to the earlier chunk in it: what a query retrieves depends only on the corpus,
not on the order in which the store was built, repaired or split between workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# bm25s runs a jax top-k at import when jax is installed, and jax then takes 75% of the GPU's
# memory for itself; lazyrag never uses jax, so where nothing chose a platform it stays on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import bm25s
import numpy as np

from lazyrag.store import Store
from lazyrag.store.integrity import Warn, warn_stderr

INDEX_DIR = "bm25"
STAMP_FILE = "stamp.json"
IDS_FILE = "chunk_ids.json"
STAMP_VERSION = 2  # version 1 stamps held no file digests: such an index is rebuilt, as stale


class IndexDamaged(Exception):
    """The saved index cannot be trusted; the message says which file and why."""


class IndexStale(IndexDamaged):
    """The saved index is whole but covers other chunks (the store changed since): rebuilt, no damage."""


@dataclass(frozen=True)
class RetrievalCorpus:
    """The chunks retrieval ranks, in the stable order (document id, chunk index), each once."""

    chunk_ids: list[str]
    texts: list[str]

    @classmethod
    def of(cls, store: Store) -> RetrievalCorpus:
        ids, texts = [], []
        for chunk_id, text in store.retrieval_chunks():
            ids.append(chunk_id)
            texts.append(text)
        return cls(ids, texts)

    def stamp(self) -> dict:
        # every id, not a count: a re-indexed document changes the set but maybe not its size
        return {"chunks": len(self.chunk_ids), "ids": hashlib.sha256("\n".join(self.chunk_ids).encode()).hexdigest()}


class Retriever:
    def __init__(self, bm25: bm25s.BM25, chunk_ids: list[str]):
        self.bm25, self.chunk_ids = bm25, chunk_ids

    @classmethod
    def for_store(cls, store: Store, warn: Warn = warn_stderr) -> Retriever:
        """The store's index as saved, or rebuilt from the catalog (and saved) when it is
        missing, stale or damaged; ``warn`` hears of a damaged one."""
        corpus = RetrievalCorpus.of(store)
        path = index_path(store)
        try:
            return load_index(path, corpus.stamp())
        except (IndexStale, FileNotFoundError):
            return rebuild_index(path, corpus)
        except IndexDamaged as e:
            warn(f"the retrieval index is damaged ({e}); rebuilt from the catalog")
            return rebuild_index(path, corpus)

    @classmethod
    def build(cls, corpus: RetrievalCorpus) -> Retriever:
        bm25 = bm25s.BM25()
        if corpus.texts:
            bm25.index(bm25s.tokenize(corpus.texts, show_progress=False), show_progress=False)
        return cls(bm25, corpus.chunk_ids)

    def scores(self, question: str) -> np.ndarray:
        """BM25 score of every chunk, in corpus order (zeros when no word of the question is indexed)."""
        tokens = bm25s.tokenize([question], return_ids=False, show_progress=False)[0]
        ids = self.bm25.get_tokens_ids(tokens) if tokens else []
        if not ids:
            return np.zeros(len(self.chunk_ids), dtype=np.float32)
        return np.asarray(self.bm25.get_scores_from_ids(ids), dtype=np.float32)

    def top_k(self, question: str, k: int) -> list[str]:
        """The k best chunks, ties to the earlier chunk in corpus order; those scoring 0 only when
        no chunk scores above it."""
        k = min(k, len(self.chunk_ids))
        if k == 0:
            return []
        scores = self.scores(question)
        best = stable_top(scores, k)
        positive = [i for i in best if scores[i] > 0]
        return [self.chunk_ids[int(i)] for i in (positive or best)]


def stable_top(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest scores, equal scores in position order. Only the scores at or
    above the k-th are sorted: a corpus of millions of chunks costs no full sort per question."""
    if k < len(scores):
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        candidates = np.flatnonzero(scores >= kth)
    else:
        candidates = np.arange(len(scores))
    return candidates[np.argsort(-scores[candidates], kind="stable")][:k]


def index_path(store: Store) -> Path:
    return store.local_dir / INDEX_DIR


def _digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def read_stamp(path: Path) -> dict:
    """The saved index's stamp; FileNotFoundError when there is no index, IndexDamaged when the
    stamp cannot be read."""
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise IndexDamaged(f"{path / STAMP_FILE} cannot be read ({e})") from None
    if not isinstance(stamp, dict):
        raise IndexDamaged(f"{path / STAMP_FILE} is not a JSON object")
    return stamp


def verify_files(path: Path, stamp: dict) -> None:
    """IndexDamaged unless each file the stamp lists is there with the digest it records."""
    files = stamp.get("files")
    if not isinstance(files, dict) or not files:
        raise IndexDamaged(f"{path / STAMP_FILE} lists no files")
    for name, digest in files.items():
        file = path / str(name)
        if file.is_symlink() or not file.is_file():
            raise IndexDamaged(f"{file} is missing")
        try:
            if _digest(file) != digest:
                raise IndexDamaged(f"{file} does not match its checksum")
        except OSError as e:
            raise IndexDamaged(f"{file} cannot be read ({e.strerror})") from None


def is_current(stamp: dict, corpus_stamp: dict) -> bool:
    """Whether a saved stamp covers exactly these chunks and records its files' digests."""
    return stamp.get("version") == STAMP_VERSION and stamp.get("corpus") == corpus_stamp


def load_index(path: Path, corpus_stamp: dict) -> Retriever:
    """The saved index for ``corpus_stamp``'s chunks; FileNotFoundError when there is none,
    IndexStale when it covers other chunks, IndexDamaged when it cannot be trusted."""
    stamp = read_stamp(path)
    if not is_current(stamp, corpus_stamp):
        raise IndexStale(f"{path} covers other chunks")
    verify_files(path, stamp)
    try:
        bm25 = bm25s.BM25.load(str(path), allow_pickle=False, show_progress=False)
        chunk_ids = json.loads((path / IDS_FILE).read_text())
    except Exception as e:  # whatever a damaged file raises inside bm25s or numpy
        raise IndexDamaged(f"{path} cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(chunk_ids, list) or len(chunk_ids) != corpus_stamp["chunks"]:
        raise IndexDamaged(f"{path / IDS_FILE} does not list the index's chunks")
    return Retriever(bm25, chunk_ids)


def rebuild_index(path: Path, corpus: RetrievalCorpus) -> Retriever:
    """A new index of ``corpus``, saved at ``path`` where the store can be written."""
    retriever = Retriever.build(corpus)
    try:
        save_index(path, retriever, corpus.stamp())
    except OSError:
        pass  # a read-only store: this run keeps the index in memory
    return retriever


def save_index(path: Path, retriever: Retriever, corpus_stamp: dict) -> None:
    """Write the index beside ``path`` and move it into place whole, its stamp written last."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if retriever.chunk_ids:
        retriever.bm25.save(str(tmp), allow_pickle=False, show_progress=False)
    (tmp / IDS_FILE).write_text(json.dumps(retriever.chunk_ids))
    files = {f.name: _digest(f) for f in sorted(tmp.iterdir())}
    (tmp / STAMP_FILE).write_text(json.dumps({"version": STAMP_VERSION, "corpus": corpus_stamp, "files": files}))
    if path.is_symlink() or path.is_file():
        path.unlink()  # a link or file in the index's place: replaced, never followed
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def index_problem(store: Store) -> str | None:
    """Why the store's saved retrieval index is damaged (for ``lazyrag check``), or None: absent
    or stale is no damage (it is built or rebuilt when a query needs it)."""
    path = index_path(store)
    if not path.exists():
        return None
    try:
        stamp = read_stamp(path)
        if stamp.get("version") != STAMP_VERSION:
            return None  # an older layout, rebuilt on use
        verify_files(path, stamp)
    except FileNotFoundError:
        return f"{path / STAMP_FILE} is missing"
    except IndexDamaged as e:
        return str(e)
    return None


def refresh_index(store: Store) -> bool:
    """Rebuild a saved index that is stale or damaged (``lazyrag index``); True when it did.
    A store with no saved index keeps none until a query needs it."""
    path = index_path(store)
    if not path.exists():
        return False
    corpus = RetrievalCorpus.of(store)
    try:
        load_index(path, corpus.stamp())
        return False
    except (IndexDamaged, FileNotFoundError):
        rebuild_index(path, corpus)
        return True
