"""Reading documents and cutting them into token chunks."""

from .reading import Chunk, CorpusError, CorpusStats, Document, chunk_document, read_corpus

__all__ = ["Chunk", "CorpusError", "CorpusStats", "Document", "chunk_document", "read_corpus"]
