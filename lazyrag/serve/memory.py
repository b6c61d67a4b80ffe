"""What one request's prefill needs in working memory, and what the machine has free, so that a
request that cannot fit is refused before it is attempted; and pinned host memory and device
memory made before the step loop needs them."""

from __future__ import annotations

from pathlib import Path

import torch

from lazyrag.models import ModelConfig

CGROUP = Path("/sys/fs/cgroup")
# Pinned blocks of each size torch's caching host allocator rounds to (powers of two), made when
# the first engine starts: many small ones, and a few up to a large step's packed inputs.
PINNED_SMALL, PINNED_SMALL_EACH = 1 << 20, 8
PINNED_LARGEST, PINNED_LARGE_EACH = 32 << 20, 2
_pinned_warm = False


def prefill_bytes(cfg: ModelConfig, slice_tokens: int, keys: int, device_type: str) -> int:
    """Working memory of one prefill step of `slice_tokens` tokens attending over `keys` keys:
    the layer's activations (fp32, a few copies of the hidden and MLP widths), and on the CPU the
    reference attention's fp32 scores [heads, slice, keys] with the queries it rotates per page
    (about three such tensors at once). The GPU's kernels keep scores on chip."""
    activations = slice_tokens * (8 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.vocab_size) * 4
    if device_type != "cpu":
        return activations
    return activations + 3 * cfg.num_heads * slice_tokens * keys * 4


def available_bytes(device: torch.device) -> int | None:
    """Memory free for working tensors now: on a GPU what the driver has free plus what torch holds
    unused; on the CPU MemAvailable, within the cgroup's limit where one is set; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    avail = _meminfo_available()
    room = _cgroup_room()
    if avail is None:
        return room
    return avail if room is None else min(avail, room)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max less memory.current of this process's cgroup, if limited."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        group = CGROUP / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        return None


def warm_pinned_memory() -> None:
    """Fill torch's pinned host allocator with blocks of every size a step's inputs and outputs
    round to, once per process. Pinning memory is an implicitly synchronising CUDA call: in the
    step loop it would wait for every copy in flight, a cold run's chunk copies included."""
    global _pinned_warm
    if _pinned_warm or not torch.cuda.is_available():
        return
    blocks, size = [], 1
    while size <= PINNED_LARGEST:
        for _ in range(PINNED_SMALL_EACH if size <= PINNED_SMALL else PINNED_LARGE_EACH):
            blocks.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        size *= 2
    del blocks  # back to the allocator, which keeps them for the process
    _pinned_warm = True


def reserve_step_memory(cfg: ModelConfig, step_tokens: int, device: torch.device) -> None:
    """Have torch's caching allocator hold the working memory of a prefill step of
    ``step_tokens`` tokens (within a quarter of what is free) as one block cached for the
    current stream, which later steps' tensors are cut from. A device allocation is implicitly
    synchronising: in a cold run's first steps it would wait for every chunk copy in flight."""
    room = available_bytes(device)
    if device.type != "cuda" or room is None:
        return
    nbytes = min(prefill_bytes(cfg, step_tokens, 0, device.type), room // 4)
    if nbytes > 0:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del block  # back into the allocator's cache, whole
