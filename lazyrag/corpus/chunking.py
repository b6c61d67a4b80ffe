"""Cutting a document into chunks of at most N tokens, at the best boundary in reach.

Chunks are consecutive runs of the document's tokens (tokenized once), so they
concatenate back to exactly the document's ids: no token is split or re-tokenized.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Recorded in a store's chunking settings: a store chunked by other rules is refused.
SPLITTER = "paragraph-sentence-v1"


class Tokenizer(Protocol):
    """What the chunker needs: a Hugging Face *fast* tokenizer satisfies it.

    ``tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)`` returns
    a mapping with ``input_ids`` (list of int) and ``offset_mapping`` (list of
    ``(start, end)`` character offsets into ``text``, one per token).
    """

    def __call__(self, text: str, *, add_special_tokens: bool, return_offsets_mapping: bool) -> Any: ...


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str  # the span of the document covered by the chunk's tokens


# Boundary strength of a cut placed just before a token.
_ANY, _LINE, _SENTENCE, _PARAGRAPH = 0, 1, 2, 3
_BLANK_LINE = re.compile(r"\n[^\S\n]*\n")
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
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    if len(ids) != len(offsets):
        raise ValueError("tokenizer returned a different number of ids and offsets")
    n = len(ids)
    if n == 0:
        return []
    if n <= chunk_tokens:
        return [_make_chunk(text, ids, offsets, 0, n)]

    # a cut only looks back from the end of its window, stopping at a paragraph: strengths are
    # computed as it asks for them (for every token, they were most of the time of chunking)
    @functools.cache
    def strength(i: int) -> int:
        return _strength_before(text, offsets[i][0], offsets[i][1]) if 0 < i < n else _ANY

    chunks = []
    start = 0
    while n - start > chunk_tokens:
        cut = _choose_cut(strength, offsets, start, chunk_tokens)
        chunks.append(_make_chunk(text, ids, offsets, start, cut))
        start = cut
    chunks.append(_make_chunk(text, ids, offsets, start, n))
    return chunks


def _choose_cut(strength: Callable[[int], int], offsets: Sequence[tuple[int, int]], start: int, chunk_tokens: int) -> int:
    """The index of the first token of the next chunk: in (start, start + chunk_tokens]."""
    limit = start + chunk_tokens
    earliest = start + (chunk_tokens + 1) // 2  # second half of the window only
    best_at, best = limit, -1
    for c in range(limit, max(earliest, start + 1) - 1, -1):
        if (s := strength(c)) > best:
            best_at, best = c, s
            if best == _PARAGRAPH:
                break
    if best > _ANY:
        return best_at
    # No preferred boundary: cut at the end of the window, unless that splits the
    # bytes of one character between two tokens (their offsets overlap).
    for c in range(limit, start, -1):
        if offsets[c][0] >= offsets[c - 1][1]:
            return c
    return limit


def _strength_before(text: str, start: int, end: int) -> int:
    # The whitespace around the cut: what precedes the token and what it begins with.
    j = start
    while j > 0 and start - j < _LOOKBACK and text[j - 1].isspace():
        j -= 1
    k = start
    while k < end and text[k].isspace():
        k += 1
    gap = text[j:k]
    if not gap:
        return _ANY
    if _BLANK_LINE.search(gap):
        return _PARAGRAPH
    p = j
    while p > 0 and j - p < _LOOKBACK and text[p - 1] in _CLOSERS:
        p -= 1
    if p > 0 and text[p - 1] in _SENTENCE_END:
        return _SENTENCE
    if "\n" in gap:
        return _LINE
    return _ANY


def _make_chunk(text: str, ids: list[int], offsets: list[tuple[int, int]], a: int, b: int) -> Chunk:
    lo = min(o[0] for o in offsets[a:b])
    hi = max(o[1] for o in offsets[a:b])
    return Chunk(token_ids=tuple(ids[a:b]), text=text[lo:hi])
