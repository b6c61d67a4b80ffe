"""Keeping Python's full garbage collections out of the step loop.

A full collection walks every object alive. Start-up (the model, the tokenizer, the store, their
imports) leaves hundreds of thousands, and a walk over them takes 100-200 ms: a step stalled
that long, where a warm 8B run of 200 requests lasts under a second. Frozen while an engine
runs (gc.freeze), they are left out of the walks; what the run makes is collected as before, and
the frozen objects go back to the collector when the last running engine ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_running = 0  # engines inside objects_frozen (an engine thread per GPU may run beside another)


@contextlib.contextmanager
def objects_frozen():
    global _running
    with _lock:
        if _running == 0:
            gc.freeze()
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0:
                gc.unfreeze()
