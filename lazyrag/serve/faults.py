"""Which errors fail one request only, what the errors file says about them, and the test hook
that injects an out-of-memory error into chosen requests.

An error raised while one request is placed or stepped concerns that request (out of memory, a
chunk that cannot be read, a bad token id) unless it says the store, the model or the device
is gone: those concern every request and end the run.
"""

from __future__ import annotations

import os

import torch

from lazyrag.store import ChunkReadError, StoreError

# Test hook: `LAZYRAG_INJECT_OOM=ID[:prefill|:decode],...` makes every step holding request ID
# (its prefill, or its decode steps) raise torch.OutOfMemoryError before it runs, alone or
# batched, as a device would; read at each step, so tests set it per run.
INJECT_OOM_VAR = "LAZYRAG_INJECT_OOM"

# Words of an error that mean the device or its context is gone (every later step would fail too).
_DEVICE_GONE = ("device-side assert", "illegal memory access", "unspecified launch failure", "no CUDA GPUs",
                "CUDA driver", "device not ready", "ECC error", "NVML", "cudaErrorDevicesUnavailable")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), MemoryError, or the CPU allocator's RuntimeError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def concerns_request(exc: BaseException) -> bool:
    """Whether `exc`, raised for one request, fails that request only (the run goes on)."""
    if not isinstance(exc, Exception) or device_gone(exc):
        return False
    if isinstance(exc, StoreError):  # the store itself (other than one chunk) concerns every request
        return isinstance(exc, ChunkReadError)
    return is_out_of_memory(exc) or isinstance(exc, (IndexError, BadTokens, UnicodeError))


def device_gone(exc: BaseException) -> bool:
    text = str(exc)
    return any(words in text for words in _DEVICE_GONE) or type(exc).__name__ == "AcceleratorError"


def reason(exc: BaseException) -> str:
    """The one-line reason the errors file gives for a request that failed."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if is_out_of_memory(exc):
        return (f"out of memory for this request ({text[:200]}); lower --max-prompt-tokens or --batch-size, "
                "or free memory")
    if isinstance(exc, (ChunkReadError, BadTokens)):
        return text
    return f"{type(exc).__name__}: {text[:300]}"


class BadTokens(ValueError):
    """A request feeds token ids outside the model's vocabulary (checked on the host: on a GPU the
    embedding would raise a device-side assert, which ends the process's CUDA context)."""


def check_tokens(ids: list[int], vocab: int, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise BadTokens(f"{what} holds token id {bad}, outside the model's vocabulary of {vocab}; re-index the store")


def injected(ids: list[str], phase: str) -> None:
    """Raise torch.OutOfMemoryError when INJECT_OOM_VAR names one of `ids` for `phase`."""
    spec = os.environ.get(INJECT_OOM_VAR)
    if not spec:
        return
    for item in spec.split(","):
        rid, _, when = item.partition(":")
        if rid in ids and (when or "prefill") == phase:
            raise torch.OutOfMemoryError(f"injected out of memory ({INJECT_OOM_VAR}) for request {rid} at {phase}")
