"""Cutting a document into chunks of at most N tokens, at the best boundary in reach.

Chunks are consecutive runs of the document's tokens (tokenized once), so they
concatenate back to exactly the document's ids: no token is split or re-tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# Recorded in a store's chunking settings: a store chunked by other rules is refused.
SPLITTER = "paragraph-sentence-v1"


class Tokenizer(Protocol):
    """What the chunker needs: a Hugging Face *fast* tokenizer satisfies it.

    ``tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)``, given a list of
    texts, returns a mapping with ``input_ids`` (a list of ints per text) and ``offset_mapping``
    (a list of ``(start, end)`` character offsets into its text per text, one per token).
    """

    def __call__(self, texts: list[str], *, add_special_tokens: bool, return_offsets_mapping: bool) -> Any: ...


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str  # the span of the document covered by the chunk's tokens


# Boundary strength of a cut placed just before a token.
_ANY, _LINE, _SENTENCE, _PARAGRAPH = 0, 1, 2, 3
_SENTENCE_END = ".!?…"
_CLOSERS = "\"')]}»”’"
_LOOKBACK = 64  # how far back to look for whitespace and sentence ends, in characters


def chunk_document(text: str, tokenizer: Tokenizer, chunk_tokens: int) -> list[Chunk]:
    """Cut ``text`` into chunks of at most ``chunk_tokens`` tokens.

    The text is tokenized once, without special tokens; chunks are consecutive runs
    of those tokens, so their token ids concatenate to exactly the document's ids
    (no token is ever split or re-tokenized).

    Where to cut: the window is the next ``chunk_tokens`` tokens. The cut goes at
    the last paragraph boundary (before a token that follows a blank line) in the
    window; failing that at the last sentence end (``.``, ``!``, ``?`` or ``…``,
    maybe followed by closing quotes or brackets, then whitespace); failing that at
    the last line break; failing that after the window's last token (avoiding a cut
    between two tokens of one character where possible). A boundary is only taken if
    it lies in the second half of the window, so no chunk except a document's last
    is shorter than ``chunk_tokens // 2`` tokens. A document of at most
    ``chunk_tokens`` tokens is one chunk.
    """
    return chunk_documents([text], tokenizer, chunk_tokens)[0]


def chunk_documents(texts: Sequence[str], tokenizer: Tokenizer, chunk_tokens: int) -> list[list[Chunk]]:
    """Each text's chunks, as ``chunk_document`` cuts them; the texts are tokenized in one call,
    which a fast tokenizer spreads over the cores."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if not texts:
        return []
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return [_cut(text, list(map(int, ids)), np.asarray(offsets, dtype=np.int64).reshape(-1, 2), chunk_tokens)
            for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True)]


def _cut(text: str, ids: list[int], offsets: np.ndarray, chunk_tokens: int) -> list[Chunk]:
    if len(ids) != len(offsets):
        raise ValueError("tokenizer returned a different number of ids and offsets")
    n = len(ids)
    if n == 0:
        return []
    if n <= chunk_tokens:
        return [_make_chunk(text, ids, offsets, 0, n)]

    strength = _boundary_strengths(text, offsets)
    chunks = []
    start = 0
    while n - start > chunk_tokens:
        cut = _choose_cut(strength, offsets, start, chunk_tokens)
        chunks.append(_make_chunk(text, ids, offsets, start, cut))
        start = cut
    chunks.append(_make_chunk(text, ids, offsets, start, n))
    return chunks


def _choose_cut(strength: np.ndarray, offsets: np.ndarray, start: int, chunk_tokens: int) -> int:
    """The index of the first token of the next chunk: in (start, start + chunk_tokens]."""
    limit = start + chunk_tokens
    earliest = max(start + (chunk_tokens + 1) // 2, start + 1)  # second half of the window only
    window = strength[earliest: limit + 1]
    best = int(window.max())
    if best > _ANY:  # the strongest boundary, the last of them
        return limit - int(np.argmax(window[::-1] == best))
    # No preferred boundary: cut at the end of the window, unless that splits the
    # bytes of one character between two tokens (their offsets overlap).
    clean = offsets[start + 1: limit + 1, 0] >= offsets[start: limit, 1]
    return limit - int(np.argmax(clean[::-1])) if clean.any() else limit


def _boundary_strengths(text: str, offsets: np.ndarray) -> np.ndarray:
    """The strength of a cut just before each token, for all of them at once (int8; the first
    token's is _ANY). The whitespace around a cut is what precedes the token (at most _LOOKBACK
    characters) and what it begins with; two newlines in it make a paragraph break, a sentence end
    before it (maybe followed by closers, at most _LOOKBACK of them) a sentence break, one newline
    a line break."""
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    distinct, inverse = np.unique(chars, return_inverse=True)

    def char_class(test) -> np.ndarray:  # asked once per distinct character
        return np.array([test(chr(c)) for c in distinct], dtype=bool)[inverse].reshape(chars.shape)

    space, closer = char_class(str.isspace), char_class(_CLOSERS.__contains__)
    ender = char_class(_SENTENCE_END.__contains__)
    newlines = np.concatenate([[0], np.cumsum(chars == ord("\n"))])
    begin, end = offsets[:, 0], offsets[:, 1]
    # j: where the whitespace before the token begins; k: where the token's own leading whitespace ends
    j = np.maximum(_run_start(space)[begin], np.maximum(begin - _LOOKBACK, 0))
    k = np.maximum(begin, np.minimum(_run_end(space)[begin], end))
    p = np.maximum(_run_start(closer)[j], np.maximum(j - _LOOKBACK, 0))
    lines = newlines[k] - newlines[j]
    sentence = (p > 0) & ender[np.maximum(p - 1, 0)]
    strength = np.where(lines >= 2, _PARAGRAPH, np.where(sentence, _SENTENCE, np.where(lines == 1, _LINE, _ANY)))
    strength[j == k] = _ANY  # no whitespace at all: inside a word
    strength[0] = _ANY
    return strength.astype(np.int8)


def _run_start(member: np.ndarray) -> np.ndarray:
    """For each position p (0..len): where the run of members ending just before p begins."""
    at = np.arange(len(member) + 1)
    last_other = np.concatenate([[0], np.where(member, 0, at[1:])])  # p's value: 1 + last non-member before p
    return np.maximum.accumulate(last_other)


def _run_end(member: np.ndarray) -> np.ndarray:
    """For each position p (0..len): the first non-member at or after p (len if none)."""
    size = len(member)
    at = np.where(member, size, np.arange(size))
    return np.concatenate([np.minimum.accumulate(at[::-1])[::-1], [size]])


def _make_chunk(text: str, ids: list[int], offsets: np.ndarray, a: int, b: int) -> Chunk:
    return Chunk(token_ids=tuple(ids[a:b]), text=text[int(offsets[a:b, 0].min()): int(offsets[a:b, 1].max())])
