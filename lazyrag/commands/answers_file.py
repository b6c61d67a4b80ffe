"""The answers JSONL that `lazyrag answer` appends to, and the errors JSONL beside it.

One writer at a time: the answers file is locked (flock) for the whole run, so two runs
cannot interleave rows. Each row is synced as it is written, so a killed run resumes where
it stopped; a torn last line such a kill can leave is cut away before anything is appended.
Queries that fail go to `<name>.errors.jsonl`, never into the answers, so the next run
retries them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

from lazyrag.errors import InputError, ResourceError


class AnswersFileError(Exception):
    """The answers file is held by another `answer` run."""


def errors_path(out: Path) -> Path:
    """Where the failed queries of a run writing `out` are listed (answers.jsonl -> answers.errors.jsonl)."""
    return _beside(out, "errors", out.suffix or ".jsonl")


def run_record_path(out: Path) -> Path:
    """Where a run writing `out` keeps its record when the store is read-only (answers.jsonl -> answers.run.json)."""
    return _beside(out, "run", ".json")


def _beside(out: Path, kind: str, suffix: str) -> Path:
    return out.with_name(f"{out.stem if out.suffix else out.name}.{kind}{suffix}")


class AnswersFile:
    """The answers file, locked and repaired on open. `done`: the ids already answered;
    `failed`: how many queries this run wrote to the errors file."""

    def __init__(self, path: Path, report: Callable[[str], None]):
        """`path` is a regular file or does not exist yet (the command line checks it)."""
        self.path = path
        self.errors = errors_path(path)
        self.failed = 0
        self._created = not path.exists()  # removed at close if the run wrote nothing to it
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # unbuffered, so a failed write leaves nothing queued to be written at close
            self._fh = open(path, "a+b", buffering=0)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise InputError(f"--out {path}: cannot write the answers file ({exc.strerror}); name a file "
                             "in a writable directory") from None
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            raise AnswersFileError(f"{path}: another answer run is writing this file; "
                                   "wait for it to end or give another --out") from None
        self.done = _repair_and_read(self._fh, path, report)
        self.errors.unlink(missing_ok=True)  # it lists this run's failures only
        self._errors_fh: BinaryIO | None = None

    def write(self, row: dict) -> None:
        _append(self._fh, row)

    def write_error(self, qid: str, error: str, line: int) -> None:
        if self._errors_fh is None:
            self._errors_fh = open(self.errors, "ab", buffering=0)
        _append(self._errors_fh, {"id": qid, "error": error, "line": line})
        self.failed += 1

    def close(self) -> None:
        if self._errors_fh is not None:
            self._errors_fh.close()
        if self._created and os.fstat(self._fh.fileno()).st_size == 0:
            self.path.unlink(missing_ok=True)  # no empty --out left by a run that answered nothing
        self._fh.close()  # releases the lock

    def __enter__(self) -> AnswersFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _append(fh: BinaryIO, row: dict) -> None:
    """Append one row and sync it; on a full disk, cut away what part of it was written and
    raise ResourceError: the rows before it stay whole."""
    data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    start = fh.seek(0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[fh.write(view):]
        os.fsync(fh.fileno())
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        fh.truncate(start)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(fh.name))).free
        raise ResourceError(f"{fh.name}: disk full writing a row of {len(data):,} bytes ({free:,} bytes free); "
                            "free some space and run again with the same --out: the rows written are kept "
                            "and the rest resumes") from None


def _answer_id(line: bytes) -> str | None:
    """The id of an answer row; None for anything else (a torn line, an error row)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or "error" in row or not isinstance(row.get("id"), str):
        return None
    return row["id"]


def _repair_and_read(fh: BinaryIO, path: Path, report: Callable[[str], None]) -> set[str]:
    """The ids answered in `fh`, after cutting away a last line that is not valid JSON: left
    there, the next row would be glued onto it and lost too."""
    fh.seek(0)
    lines = fh.read().split(b"\n")
    last = lines[-1] or (lines[-2] if len(lines) > 1 else b"")
    if last.strip():
        try:
            json.loads(last)
            if lines[-1]:  # a whole row missing only its newline
                fh.write(b"\n")
        except ValueError:
            size = fh.seek(0, os.SEEK_END)
            fh.truncate(size - len(last) - (0 if lines[-1] else 1))
            report(f"{path}: cut away a torn last line ({len(last)} bytes) left by an interrupted run")
    return {qid for qid in map(_answer_id, lines) if qid is not None}
