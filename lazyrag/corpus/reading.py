"""Reading documents and cutting them into token chunks.

A corpus is a directory (searched recursively for ``.txt``, ``.md`` and ``.jsonl``
files, in sorted order) or a single file. JSONL lines are objects
``{"id", "text", "title"?}``; a ``.txt``/``.md`` file is one document whose id is its
path relative to the corpus directory.

Bad input (a file that is not UTF-8, a malformed JSONL line, a duplicate document id)
raises :class:`CorpusError` with a ``file:line: reason`` message, unless ``skip_bad``
is set, in which case the message goes to ``report`` and reading continues.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CORPUS_SUFFIXES = (".txt", ".md", ".jsonl")
SPLITTER_NAME = "paragraph-sentence-v1"


class CorpusError(Exception):
    """Bad corpus input. The message starts with ``file:line: ``."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str | None
    source: str  # "path" for a whole file, "path:line" for a JSONL line

    @property
    def model_text(self) -> str:
        """The text the model sees: the title on its own line, then the text."""
        return document_model_text(self.text, self.title)


def document_model_text(text: str, title: str | None) -> str:
    return f"{title}\n{text}" if title else text


@dataclass
class CorpusStats:
    """Counts filled in by :func:`read_corpus` as it reads."""

    documents: int = 0  # documents yielded
    empty_skipped: int = 0  # documents whose text was empty or whitespace only
    bad_skipped: int = 0  # bad files, bad lines and duplicates skipped under skip_bad
    files: int = 0  # files opened


def read_corpus(
    path: str | Path,
    *,
    skip_bad: bool = False,
    report: Callable[[str], None] | None = None,
    stats: CorpusStats | None = None,
) -> Iterator[Document]:
    """Yield the documents of a corpus directory or file, in a deterministic order.

    Pass a :class:`CorpusStats` as ``stats`` to get the counts; it is updated while
    the generator runs and complete once it is exhausted. Files and directories whose
    name starts with a dot are ignored when walking a directory.
    """
    root = Path(path)
    stats = stats if stats is not None else CorpusStats()
    if root.is_dir():
        files = sorted(
            (p for p in root.rglob("*") if _is_corpus_file(p, root)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        base = root
    elif root.is_file():
        if root.suffix.lower() not in CORPUS_SUFFIXES:
            raise CorpusError(
                f"{root}:1: unsupported file type {root.suffix!r} "
                f"(expected a directory or a {', '.join(CORPUS_SUFFIXES)} file)"
            )
        files = [root]
        base = root.parent
    else:
        raise CorpusError(f"{root}:1: no such file or directory")

    seen: dict[str, str] = {}  # doc id -> source where first seen

    def bad(message: str) -> None:
        if not skip_bad:
            raise CorpusError(message)
        stats.bad_skipped += 1
        if report is not None:
            report(message)

    for file in files:
        stats.files += 1
        if file.suffix.lower() == ".jsonl":
            docs = _read_jsonl(file, bad)
        else:
            docs = _read_text_file(file, file.relative_to(base).as_posix(), bad)
        for doc in docs:
            if not doc.text.strip():
                stats.empty_skipped += 1
                continue
            first = seen.get(doc.id)
            if first is not None:
                bad(
                    f"{_with_line(doc.source)}: duplicate document id {doc.id!r} "
                    f"(first seen at {first})"
                )
                continue
            seen[doc.id] = doc.source
            stats.documents += 1
            yield doc


def _is_corpus_file(p: Path, root: Path) -> bool:
    if p.suffix.lower() not in CORPUS_SUFFIXES or not p.is_file():
        return False
    return not any(part.startswith(".") for part in p.relative_to(root).parts)


def _with_line(source: str) -> str:
    """``path`` -> ``path:1``; ``path:line`` stays."""
    head, sep, tail = source.rpartition(":")
    return source if sep and tail.isdigit() else f"{source}:1"


def _read_text_file(file: Path, doc_id: str, bad: Callable[[str], None]) -> Iterator[Document]:
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        bad(f"{file}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})")
        return
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    yield Document(id=doc_id, text=text, title=None, source=str(file))


def _read_jsonl(file: Path, bad: Callable[[str], None]) -> Iterator[Document]:
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{file}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
                continue
            problem = _check_record(obj)
            if problem:
                bad(f"{where}: {problem}")
                continue
            title = obj.get("title")
            yield Document(id=str(obj["id"]), text=obj["text"], title=title or None, source=where)


def _check_record(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("id", "text"):
        if key not in obj:
            return f'missing "{key}"'
    doc_id = obj["id"]
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        return f'"id" must be a string or an integer, got {json.dumps(doc_id)[:40]}'
    if isinstance(doc_id, str) and not doc_id:
        return '"id" is empty'
    if not isinstance(obj["text"], str):
        return f'"text" must be a string, got {type(obj["text"]).__name__}'
    title = obj.get("title")
    if title is not None and not isinstance(title, str):
        return f'"title" must be a string, got {type(title).__name__}'
    return None


# ---------------------------------------------------------------------------
# Chunking


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

    strength = _boundary_strengths(text, offsets)
    chunks = []
    start = 0
    while n - start > chunk_tokens:
        cut = _choose_cut(strength, offsets, start, chunk_tokens)
        chunks.append(_make_chunk(text, ids, offsets, start, cut))
        start = cut
    chunks.append(_make_chunk(text, ids, offsets, start, n))
    return chunks


def _choose_cut(strength: Sequence[int], offsets: Sequence[tuple[int, int]], start: int, chunk_tokens: int) -> int:
    """The index of the first token of the next chunk: in (start, start + chunk_tokens]."""
    limit = start + chunk_tokens
    earliest = start + (chunk_tokens + 1) // 2  # second half of the window only
    best_at, best = limit, -1
    for c in range(limit, max(earliest, start + 1) - 1, -1):
        if strength[c] > best:
            best_at, best = c, strength[c]
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


def _boundary_strengths(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """strength[i]: how good a place to cut just before token i is."""
    out = [_ANY] * (len(offsets) + 1)
    for i in range(1, len(offsets)):
        out[i] = _strength_before(text, offsets[i][0], offsets[i][1])
    return out


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
