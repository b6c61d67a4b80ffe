"""What `lazyrag index` checks before the model loads: the corpus can be read and holds
documents, a chunk fits the model's context, and the disk can hold the store. A failure
then costs a second, not a model load, and leaves no store fixed to settings that fail."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import click

from lazyrag.commands.index_workers import worker_devices
from lazyrag.config import IndexConfig
from lazyrag.corpus import CorpusStats, read_corpus
from lazyrag.errors import ResourceError
from lazyrag.models.loading import model_config, resolve_dtype
from lazyrag.store import FP8_KV, Store, StoreError, kv_row_bytes
from lazyrag.store.format import read_root_attributes

# Text bytes per token: about 4 for the BPE vocabularies of real models, 1 for a byte-level
# vocabulary (the random presets'), which has no merges.
BYTES_PER_TOKEN = 4
BYTE_VOCAB = 512


@dataclass(frozen=True)
class CorpusScan:
    documents: int
    empty: int
    bad: int
    text_bytes: int


@dataclass(frozen=True)
class SizeEstimate:
    tokens: int
    kv_bytes: int          # the whole corpus's KV, page padding included
    kv_dtype: str          # the store's (torch's name)
    row_bytes: int         # KV bytes per token in it (StoreSettings.row_bytes)
    stored_bytes: int      # KV the store holds already (re-indexing adds only the rest)
    free_bytes: int | None  # on the filesystem that holds the store; None on object storage
    where: Path | None     # the directory whose filesystem holds the store

    @property
    def needed_bytes(self) -> int:
        return max(0, self.kv_bytes - self.stored_bytes)

    def line(self) -> str:
        """What `index` prints before it starts."""
        dtype = KV_DTYPE_OPTION.get(self.kv_dtype, self.kv_dtype)
        text = (f"about {size_text(self.kv_bytes)} of KV for ~{self.tokens:,} tokens ({dtype}, "
                f"{size_text(self.row_bytes)} per token)")
        if self.stored_bytes:
            text += f", {size_text(self.needed_bytes)} of it not stored yet"
        if self.free_bytes is not None:
            text += f"; {size_text(self.free_bytes)} free on {self.where}"
        return text


# `index` options a store records, and the --kv-dtype that names each stored dtype
STORE_OPTIONS = ("model", "chunk_tokens", "page_size", "dtype")
KV_DTYPE_OPTION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", FP8_KV: "fp8"}


def with_store_settings(cfg: IndexConfig, given: set[str]) -> IndexConfig:
    """``cfg`` with the existing store's own model, chunk size, page size and KV dtype in place of
    each of STORE_OPTIONS the command line did not give: re-indexing needs no options repeated,
    and one given that differs from the store is still refused (StoreMismatch). A store on object
    storage keeps the defaults (reading its settings would cost a replay of its manifests)."""
    if not isinstance(cfg.store, Path) or not (cfg.store / "zarr.json").exists():
        return cfg
    _, settings = read_root_attributes(cfg.store)
    stored = {"model": settings.model, "chunk_tokens": settings.chunking.get("chunk_tokens"),
              "page_size": settings.page_size, "dtype": KV_DTYPE_OPTION.get(settings.kv_dtype)}
    return replace(cfg, **{k: v for k, v in stored.items() if k not in given and v is not None})


def scan_corpus(cfg: IndexConfig) -> CorpusScan:
    """Read the corpus once without the model: a bad input raises CorpusError now (unless
    cfg.skip_bad; `index` reports those when it reads the corpus again)."""
    stats = CorpusStats()
    text_bytes = sum(len(doc.model_text.encode()) for doc in read_corpus(cfg.corpus, skip_bad=cfg.skip_bad,
                                                                          stats=stats))
    return CorpusScan(stats.documents, stats.empty_skipped, stats.bad_skipped, text_bytes)


def check_index(cfg: IndexConfig, scan: CorpusScan) -> SizeEstimate:
    """Refuse --chunk-tokens above the model's context and more --workers than GPUs (usage
    errors), and a store the disk cannot hold (ResourceError, unless cfg.force); returns the
    size estimate (without free space for a store on object storage: no local disk to fill)."""
    worker_devices(cfg.device, cfg.workers)
    if cfg.sync and not isinstance(cfg.store, Path):
        raise click.BadParameter("is not supported on object storage yet (its manifest log records no removal)",
                                 param_hint="'--sync'")
    if isinstance(cfg.store, Path) and not (cfg.store / "zarr.json").exists():
        where = _existing_ancestor(cfg.store)
        if not os.access(where, os.W_OK):  # says no on a read-only filesystem, even to root
            raise StoreError(f"cannot create a store at {cfg.store}: {where} cannot be written (a read-only "
                             "filesystem, or no write permission); choose another --store")
    mc = model_config(cfg.model, cfg.trust_remote_code)
    if cfg.chunk_tokens > mc.max_position_embeddings:
        raise click.BadParameter(f"{cfg.chunk_tokens} is above the context of {cfg.model} "
                                 f"({mc.max_position_embeddings} tokens); use at most that",
                                 param_hint="'--chunk-tokens'")
    dtype = str(resolve_dtype(cfg.dtype)).removeprefix("torch.")
    per_token = kv_row_bytes(dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim)
    tokens = -(-scan.text_bytes // (1 if mc.vocab_size <= BYTE_VOCAB else BYTES_PER_TOKEN))
    chunks = scan.documents + tokens // cfg.chunk_tokens
    kv_bytes = (tokens + chunks * cfg.page_size) * per_token  # each chunk pads up to a page
    if not isinstance(cfg.store, Path):  # object storage: no local disk to fill
        return SizeEstimate(tokens, kv_bytes, dtype, per_token, 0, None, None)
    where = _existing_ancestor(cfg.store)
    estimate = SizeEstimate(tokens, kv_bytes, dtype, per_token, _stored_kv_bytes(cfg.store),
                            shutil.disk_usage(where).free, where)
    if not cfg.force and estimate.needed_bytes > estimate.free_bytes:
        smaller = "" if dtype == FP8_KV else ", --kv-dtype fp8 (about half of bf16's bytes)"
        raise ResourceError(
            f"{cfg.store} needs about {size_text(estimate.needed_bytes)} for the KV of ~{tokens:,} tokens "
            f"({KV_DTYPE_OPTION[dtype]}, {size_text(per_token)} per token), but {where} has "
            f"{size_text(estimate.free_bytes)} free; free some space, choose another --store{smaller}, or pass --force")
    return estimate


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _stored_kv_bytes(path: Path) -> int:
    """KV already in the store at `path` (re-indexing adds only what is missing)."""
    if not (path / "zarr.json").exists():
        return 0
    with Store.open(path) as store:
        return store.summary()["kv_bytes"]


def size_text(n: float) -> str:
    """Bytes for people: 1.2 GiB, 310.5 MiB, 22.5 KiB, 512 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
