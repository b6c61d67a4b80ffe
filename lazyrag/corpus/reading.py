"""Reading a corpus into documents.

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
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazyrag.errors import InputError
from lazyrag.lines import surrogate_field, text_lines

CORPUS_SUFFIXES = (".txt", ".md", ".jsonl")


class CorpusError(InputError):
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
        return f"{self.title}\n{self.text}" if self.title else self.text


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
        if not _utf8_name(file):
            # its name could not become a document id, nor be stored or printed as it is
            bad(f"{printable_path(file)}:1: the file name is not valid UTF-8; rename the file")
            continue
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


def _utf8_name(path: Path) -> bool:
    try:
        str(path).encode("utf-8")
        return True
    except UnicodeEncodeError:  # os.fsdecode made surrogates of the bytes that are not UTF-8
        return False


def printable_path(path: Path) -> str:
    """``path`` with the bytes of its name that are not UTF-8 written as escapes (``\\xff``)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _is_corpus_file(p: Path, root: Path) -> bool:
    if p.suffix.lower() not in CORPUS_SUFFIXES or not p.is_file():
        return False
    return not any(part.startswith(".") for part in p.relative_to(root).parts)


def _with_line(source: str) -> str:
    """``path`` -> ``path:1``; ``path:line`` stays."""
    head, sep, tail = source.rpartition(":")
    return source if sep and tail.isdigit() else f"{source}:1"


def _read_text_file(file: Path, doc_id: str, bad: Callable[[str], None]) -> Iterator[Document]:
    try:
        data = file.read_bytes()
    except OSError as e:
        bad(f"{file}:1: cannot read ({e.strerror})")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        bad(f"{file}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})")
        return
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    yield Document(id=doc_id, text=text, title=None, source=str(file))


def _read_jsonl(file: Path, bad: Callable[[str], None]) -> Iterator[Document]:
    try:
        f = open(file, "rb")
    except OSError as e:
        bad(f"{file}:1: cannot read ({e.strerror})")
        return
    with f:
        for lineno, line in text_lines(f, file, bad):
            where = f"{file}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
                continue
            except RecursionError:
                bad(f"{where}: invalid JSON: nested too deep")
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
    if key := surrogate_field(obj, ("id", "text", "title")):
        return f'"{key}" holds an unpaired surrogate escape (such as \\ud800): not valid Unicode'
    return None
