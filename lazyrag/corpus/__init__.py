"""Reading documents and cutting them into token chunks."""

from .chunking import SPLITTER, Chunk, Tokenizer, chunk_document, chunk_documents
from .reading import CorpusError, CorpusStats, Document, read_corpus

__all__ = ["SPLITTER", "Chunk", "CorpusError", "CorpusStats", "Document", "Tokenizer", "chunk_document",
           "chunk_documents", "read_corpus"]
