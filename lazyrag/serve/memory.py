"""What one request's prefill needs in working memory, and what the machine has free, so that a
request that cannot fit is refused before it is attempted."""

from __future__ import annotations

from pathlib import Path

import torch

from lazyrag.models import ModelConfig

CGROUP = Path("/sys/fs/cgroup")


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
