"""What the command line says when a command fails: one line and an exit code by class.

2 usage (click's), 3 bad input, 4 store damaged or incompatible, 5 resources (disk,
memory, a cache too small), 1 anything else. Only an unexpected error points at
LAZYRAG_DEBUG=1, which prints its traceback; the others say all there is to say.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import traceback
from dataclasses import dataclass

from lazyrag.errors import InputError, ResourceError, WorkerFailed

DEBUG_VAR = "LAZYRAG_DEBUG"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Failure:
    code: int
    message: str  # one line


def classify(exc: BaseException) -> Failure:
    """The exit code and the one-line message of an exception that ended a command."""
    from lazyrag.commands.answers_file import AnswersFileError
    from lazyrag.models import ModelError
    from lazyrag.serve.paged import OutOfPages
    from lazyrag.store import StoreError

    text = one_line(str(exc))
    if isinstance(exc, WorkerFailed):  # classified in the worker already
        return Failure(exc.code, text)
    if isinstance(exc, InputError):
        return Failure(3, text)
    if isinstance(exc, StoreError):
        return Failure(4, text)
    if isinstance(exc, sqlite3.DatabaseError):  # the catalog file itself is damaged or unreadable
        return Failure(4, f"cannot read the store's catalog ({text}); if the store is damaged, rebuild it with "
                          "`lazyrag index` into a new --store")
    if isinstance(exc, ResourceError):
        return Failure(5, text)
    if isinstance(exc, OutOfPages):
        return Failure(5, f"the KV cache is too small: {text}")
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or _cpu_allocator_failed(exc):
        return Failure(5, f"out of memory ({_short(text) or type(exc).__name__}); lower --cache-gb, --batch-size "
                          "or --max-prompt-tokens")
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        return Failure(5, f"disk full{_os_where(exc)}; free some space and run again (finished work is kept)")
    if isinstance(exc, (ModelError, AnswersFileError)):
        return Failure(1, text)
    if isinstance(exc, OSError):
        return Failure(1, f"{exc.strerror or text}{_os_where(exc)} ({hint()})")
    return Failure(1, f"{type(exc).__name__}: {text} ({hint()})")


def _cpu_allocator_failed(exc: BaseException) -> bool:
    """torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _short(text: str) -> str:
    """The allocator's sentence without its C++ source location."""
    if "DefaultCPUAllocator" in text:
        return text[text.index("DefaultCPUAllocator"):].split(". Error code")[0]
    return text


def one_line(message: str) -> str:
    """A message of several lines as one."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def hint() -> str:
    return f"run with {DEBUG_VAR}=1 for the traceback"


def debug_traceback() -> None:
    """The traceback of the exception being handled, on stderr, when LAZYRAG_DEBUG is set."""
    if os.environ.get(DEBUG_VAR, "") not in ("", "0"):
        traceback.print_exc()


def _os_where(exc: OSError) -> str:
    return f": {exc.filename}" if exc.filename else ""
