"""What `lazyrag answer` checks before the model loads: every option's range, the device, the
page pool against the machine's memory, and that --out may be written (not the queries file,
not inside a store, not a file of something else). A failure is one line and exit 3 (bad input)
or 5 (resources), and touches nothing."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from lazyrag.config import AnswerConfig, Mode
from lazyrag.errors import InputError, ResourceError
from lazyrag.models import ModelError
from lazyrag.models.loading import model_config
from lazyrag.serve.memory import available_bytes
from lazyrag.serve.recompute import Policy
from lazyrag.store import Store
from lazyrag.store.format import CATALOG_FILE


def check_options(cfg: AnswerConfig) -> None:
    """The options that need no store: InputError (exit 3) naming the option."""
    for name, value in (("--cache-gb", cfg.cache_gb),):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{name} must be a positive number of GiB, got {value:g}")
    if not (math.isfinite(cfg.host_cache_gb) and cfg.host_cache_gb >= 0):
        raise InputError(f"--host-cache-gb must be 0 (no host tier) or a positive number of GiB, got "
                         f"{cfg.host_cache_gb:g}")
    for name, value in (("--ape-temperature", cfg.ape_temperature), ("--ape-scale", cfg.ape_scale)):
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{name} must be a positive number (1 is off), got {value:g}")
    if cfg.mode is Mode.FULL and (cfg.ape_temperature, cfg.ape_scale) != (1.0, 1.0):
        raise InputError("--ape-temperature and --ape-scale apply to --mode lazy and block only")
    try:
        Policy(cfg.recompute_policy)
    except ValueError:
        raise InputError(f"--recompute-policy {cfg.recompute_policy!r}: choose "
                         f"{' or '.join(p.value for p in Policy)}") from None
    check_device(cfg.device)


def check_device(device: str) -> None:
    """--device cuda or cuda:N on a machine whose torch sees fewer GPUs: InputError."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = "no CUDA GPU" if not count else f"{count} CUDA GPU{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
        raise InputError(f"--device {device}: torch sees {seen}; use --device cpu or auto")


def check_pool_memory(cfg: AnswerConfig) -> None:
    """On the CPU the page pool lives in RAM: a --cache-gb the machine cannot hold is ResourceError."""
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()):
        return  # a GPU pool that does not fit fails at once, when it is allocated
    free = available_bytes(torch.device("cpu"))
    if free is not None and cfg.cache_gb * 2**30 > free:
        raise ResourceError(f"--cache-gb {cfg.cache_gb:g} is more than the {free / 2**30:.1f} GiB of memory free "
                            f"on this machine, where the page pool lives on the CPU; lower --cache-gb")


def check_against_store(cfg: AnswerConfig, store: Store) -> None:
    """The options whose range is the store's model: --recompute-layer and --max-new-tokens
    (read from the model's config, without its weights)."""
    layers = store.settings.num_layers
    if cfg.recompute_layer is not None and cfg.recompute_layer >= layers:
        raise InputError(f"--recompute-layer {cfg.recompute_layer} is past the last layer of the store's model "
                         f"({layers} layers: 0..{layers - 1})")
    try:
        context = model_config(cfg.model or store.settings.model, cfg.trust_remote_code).max_position_embeddings
    except (ModelError, OSError, ValueError):
        return  # the model load reports it
    if cfg.max_new_tokens >= context:
        raise InputError(f"--max-new-tokens {cfg.max_new_tokens:,} leaves no room for a prompt in the model's "
                         f"context of {context:,} tokens; ask for fewer")


def check_queries(cfg: AnswerConfig) -> None:
    """A queries file that cannot be opened: QueryError (exit 3), before anything is created."""
    from lazyrag.commands.queries import QueryError

    try:
        open(cfg.queries, "rb").close()
    except OSError as exc:
        raise QueryError(f"{cfg.queries}: cannot read the queries file ({exc.strerror})") from None


def check_out(cfg: AnswerConfig) -> None:
    """--out may be appended to: not the queries file, not inside a store, and if it exists an
    answers file of this tool (its first line an answer row). InputError otherwise, untouched."""
    out = Path(cfg.out)
    if out.exists() and Path(cfg.queries).exists() and os.path.samefile(out, cfg.queries):
        raise InputError(f"--out {out} is the queries file; name another file for the answers")
    store = _store_holding(out)
    if store is not None:
        raise InputError(f"--out {out} is inside the store {store}; name a file outside it")
    if out.is_file() and not _answers_or_empty(out):
        raise InputError(f"--out {out} exists and is not an answers file of `lazyrag answer` (its first line is "
                         "not an answer row); name another file, or remove it")


def _store_holding(path: Path) -> Path | None:
    """The store directory (zarr.json beside the catalog) `path` would be inside, if any."""
    for folder in Path(os.path.abspath(path)).parents:
        if (folder / "zarr.json").is_file() and (folder / CATALOG_FILE).exists():
            return folder
    return None


def _answers_or_empty(path: Path) -> bool:
    """Whether the file is empty or starts with an answer row (a JSON object with id and answer)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 20)
    except OSError:
        return True  # opening it for the run says why it cannot be written
    if not first.strip():
        return not first or os.path.getsize(path) == len(first)
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and isinstance(row.get("id"), str) and "answer" in row
