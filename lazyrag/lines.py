"""JSONL input read line by line, each line decoded on its own: a line that is not UTF-8, or
too long, costs only itself and is reported as `file:line: reason`."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Callable, Iterator


def text_lines(fh: BinaryIO, path: Path, report: Callable[[str], None],
               max_bytes: int | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of `fh` (the file at `path`), a first-line
    byte order mark removed. A line over max_bytes is reported and skipped without being held
    in memory."""
    for n, raw in _bounded_lines(fh, max_bytes):
        if raw is None:
            report(f"{path}:{n}: line is over {max_bytes >> 20} MiB, longer than any question can be")
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            report(f"{path}:{n}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})")
            continue
        if n == 1:
            line = line.removeprefix("\ufeff")
        if line.strip():
            yield n, line


def surrogate_field(obj: dict, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` whose string (or a string in its list) holds an unpaired surrogate:
    JSON's "\\ud800" escapes decode to one, and no tokenizer, catalog or file can take it."""
    for key in keys:
        value = obj.get(key)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return key
    return None


def _bounded_lines(fh: BinaryIO, max_bytes: int | None) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; None for a line over max_bytes, whose rest is read and
    dropped in bounded pieces."""
    if max_bytes is None:
        yield from enumerate(fh, start=1)
        return
    n = 0
    while raw := fh.readline(max_bytes + 1):
        n += 1
        if len(raw) <= max_bytes or raw.endswith(b"\n"):
            yield n, raw
            continue
        while (rest := fh.readline(max_bytes)) and not rest.endswith(b"\n"):
            pass
        yield n, None
