"""`lazyrag index`: corpus -> chunks -> model -> store.

Each chunk is encoded once, after the store's preamble, at chunk-local positions
(P .. P+L-1): it attends to the preamble and to itself. Its keys are stored rotated
at those positions, so the engine can later place it at any offset by shifting the
query's rotation instead of touching the keys. An fp8 store's chunks are encoded in the
model's own dtype and quantised once encoded. Many chunks share one forward pass; the
corpus is chunked as the batches need its chunks, and writer threads store finished batches
while the next batch runs. With `--workers N`
(lazyrag/commands/index_workers.py, which imports this module) N processes run this encode loop,
each over its share.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from lazyrag import kernels
from lazyrag.config import IndexConfig
from lazyrag.corpus import SPLITTER, CorpusStats, Document, chunk_documents, read_corpus
from lazyrag.models import LoadedModel, load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve.paged import Feed, PagedAttention, PagePool, StepInputs, page_rows, pages_for
from lazyrag.store import FP8_KV, NewChunk, Store, StoreSettings, chunk_id_for, kv_to_storage, pack_fp8_rows
from lazyrag.store.file_writes import aligned_empty

WriteBatch = Callable[[list[NewChunk], np.ndarray], None]  # a batch's chunks and KV rows (storage dtype)

ENCODING = {"attend": "preamble+self", "positions": "chunk-local after preamble"}


@dataclass
class IndexResult:
    store: str
    chunks_added: int
    chunks_total: int
    tokens_added: int
    tokens_total: int
    documents_total: int
    documents_empty: int
    bad_skipped: int
    seconds: float
    store_bytes: int = 0  # the store's size on disk (or on object storage) after the run
    chunks_repaired: int = 0  # damaged chunks (corrupt or missing data) encoded again
    documents_removed: list[str] = field(default_factory=list)  # --sync: no longer in the corpus
    retrieval_rebuilt: bool = False  # the saved BM25 index was stale or damaged and was built again
    write_wait_s: float = 0.0  # the model waited this long for writers (a free one, then the last writes)
    writer_copy_s: float = 0.0  # the writers' time copying KV off the GPU, summed over threads
    writer_store_s: float = 0.0  # and storing it (checksums, writes, fsync, catalog commit)

    def to_json(self) -> dict:
        return asdict(self)

    def removed_line(self, shown: int = 5) -> str:
        """What --sync removed, a few ids named."""
        ids = ", ".join(map(repr, self.documents_removed[:shown]))
        more = ", ..." if len(self.documents_removed) > shown else ""
        return (f"removed {len(self.documents_removed)} documents no longer in the corpus ({ids}{more}); "
                f"`lazyrag compact --store {self.store}` reclaims their chunks")


def store_settings(loaded: LoadedModel, name: str, chunk_tokens: int, page_size: int) -> StoreSettings:
    fmt = PromptFormat(loaded.tokenizer)
    cfg = loaded.cfg
    return StoreSettings(
        model=name, fingerprint=loaded.fingerprint, kv_dtype=str(loaded.kv_dtype).removeprefix("torch."),
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
        preamble_ids=tuple(fmt.preamble_ids()), rope=dict(cfg.rope),
        chunking={"chunk_tokens": chunk_tokens, "splitter": SPLITTER, "separator_ids": fmt.separator_ids()},
        encoding=ENCODING,
    )


TOKENIZED_AT_ONCE = 256  # documents a tokenizer call takes: a fast tokenizer spreads them over the cores


def stored_chunks(docs: Sequence[Document], tokenizer, settings: StoreSettings) -> list[list[NewChunk]]:
    """Each document's chunks as the store keeps them: separator appended, id from the content."""
    separator = tuple(settings.chunking["separator_ids"])
    texts = [doc.model_text for doc in docs]
    lists = []
    for doc, chunks in zip(docs, chunk_documents(texts, tokenizer, settings.chunking["chunk_tokens"])):
        lists.append([])
        for ordinal, chunk in enumerate(chunks):
            ids = tuple(chunk.token_ids) + separator
            lists[-1].append(NewChunk(chunk_id_for(settings, ids), doc.id, ordinal, ids, chunk.text))
    return lists


def chunk_groups(docs: Iterable[Document], tokenizer, settings: StoreSettings,
                 first: int | None = None) -> Iterator[dict[str, list[NewChunk]]]:
    """Documents' stored chunks by id, a group of documents a tokenizer call (a later document of an
    id replaces an earlier one within a group). Groups double from ``first`` documents (default:
    TOKENIZED_AT_ONCE) up to TOKENIZED_AT_ONCE, so a caller that pulls them as it goes can start
    on the first documents at once."""
    docs, size = iter(docs), first or TOKENIZED_AT_ONCE
    while batch := list(itertools.islice(docs, size)):
        yield {d.id: chunks for d, chunks in zip(batch, stored_chunks(batch, tokenizer, settings))}
        size = min(2 * size, TOKENIZED_AT_ONCE)


def chunk_corpus(docs: Iterable[Document], tokenizer, settings: StoreSettings) -> dict[str, list[NewChunk]]:
    """Every document's stored chunks by id (a later document of the same id replaces an earlier one),
    tokenized TOKENIZED_AT_ONCE documents a call."""
    chunked: dict[str, list[NewChunk]] = {}
    for group in chunk_groups(docs, tokenizer, settings):
        chunked.update(group)
    return chunked


def pages_per_batch(cfg: IndexConfig, settings: StoreSettings) -> int:
    """Pages one forward pass holds: cfg.batch_tokens, and at least one whole chunk."""
    longest = cfg.chunk_tokens + len(settings.chunking["separator_ids"])
    return max(cfg.batch_tokens, longest) // cfg.page_size + 1


class PageBatches:
    """Consecutive runs of chunks whose pages fit a batch (a longer chunk goes alone), in order.
    Batches grow from a quarter of batch_pages as the pages done grow, and shrink to half the pages
    left near the end: the first write starts sooner, and the writes left once the model is done
    are short. ``chunks`` may be a stream: it is pulled two batches ahead, as far as the shrink
    near the end looks, so the batches are those of the whole list."""

    def __init__(self, chunks: Iterable[NewChunk], batch_pages: int, page_size: int):
        self.batch_pages, self.page_size = batch_pages, page_size
        self._chunks = iter(chunks)
        self._ahead: deque[tuple[NewChunk, int]] = deque()  # pulled, not batched yet: (chunk, its pages)
        self.pages_ahead = 0
        self.exhausted = False

    def fill(self) -> int:
        """Pull chunks until two batches' pages are ahead, or none are left; the pages ahead."""
        while not self.exhausted and self.pages_ahead < 2 * self.batch_pages:
            chunk = next(self._chunks, None)
            if chunk is None:
                self.exhausted = True
                break
            n = pages_for(len(chunk.token_ids), self.page_size)
            self._ahead.append((chunk, n))
            self.pages_ahead += n
        return self.pages_ahead

    def __iter__(self) -> Iterator[list[NewChunk]]:
        done = 0
        while self.fill():
            # until the stream ends, at least two batches are ahead: the shrink does not apply yet
            left = self.pages_ahead if self.exhausted else 2 * self.batch_pages
            limit = max(self.batch_pages // 4, min(self.batch_pages, done, left // 2))
            batch, pages = [], 0
            while self._ahead and (not batch or pages + self._ahead[0][1] <= limit):
                chunk, n = self._ahead.popleft()
                batch.append(chunk)
                pages += n
            self.pages_ahead -= pages
            done += pages
            yield batch


class ChunkEncoder:
    """Runs the model over batches of chunks that all follow the preamble."""

    def __init__(self, loaded: LoadedModel, preamble_ids: list[int], page_size: int, batch_pages: int):
        self.loaded = loaded
        cfg = loaded.cfg
        self.preamble_len = len(preamble_ids)
        pre_pages = -(-self.preamble_len // page_size)
        # the pool holds the store's dtype, so a chunk's layers read its KV as answering will (a CPU model
        # computes in fp32 over bf16 pages); an fp8 store's chunks are encoded in the compute dtype and
        # quantised once encoded (stored_rows)
        pool_dtype = loaded.dtype if loaded.kv_dtype == kernels.FP8 else loaded.kv_dtype
        self.pool = PagePool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pre_pages + batch_pages, page_size,
                             pool_dtype, loaded.device)
        self.sm_scale = cfg.head_dim ** -0.5
        self.preamble = page_rows(self.pool.alloc(pre_pages), 0, self.preamble_len, 0, page_size)
        self._forward([Feed(self.preamble, 0, 0, 0, preamble_ids)])

    def _forward(self, feeds: list[Feed]) -> None:
        step = StepInputs.upload(feeds, self.pool.page_size, self.loaded.device)
        attention = PagedAttention(self.pool, step, self.loaded.model.inv_freq, self.sm_scale, lazy=True)
        self.loaded.model(step.tokens, step.positions, attention)

    def encode(self, token_lists: list[list[int]]) -> torch.Tensor:
        """KV of each chunk, pages concatenated: [sum of padded lengths, layers, 2, kv_heads, head_dim]."""
        ps = self.pool.page_size
        pages = [self.pool.alloc(self.pool.pages_for(len(t))) for t in token_lists]
        try:
            n = len(self.preamble)
            self._forward([Feed(np.concatenate([self.preamble, page_rows(p, self.preamble_len, len(t), 0, ps)]),
                                n, self.preamble_len, 0, t) for p, t in zip(pages, token_lists)])
            kv = self.pool.read_tokens([p for ps_ in pages for p in ps_])
            # zero each chunk's page padding: reused pages hold old tokens, and the store should
            # not depend on what ran before
            row = 0
            for p, t in zip(pages, token_lists):
                kv[row + len(t): row + len(p) * ps] = 0
                row += len(p) * ps
            return kv
        finally:
            for p in pages:
                self.pool.release(p)


def stored_rows(kv: torch.Tensor, settings: StoreSettings) -> torch.Tensor:
    """Encoded KV as the store keeps it: as computed, or for an fp8 store quantised per (token, KV head)
    row and packed with its scales."""
    if settings.kv_dtype == FP8_KV:
        return pack_fp8_rows(*kernels.quantize_fp8(kv))
    return kv


def aligned_host_copy(kv: torch.Tensor, buffer: np.ndarray) -> torch.Tensor:
    """``kv`` (on the CPU) copied into the page-aligned host ``buffer`` (at least its size), which a
    segment is written from straight to the disk (lazyrag/store/file_writes.py)."""
    host = torch.from_numpy(buffer[: kv.nbytes])
    return host.view(kv.dtype).view(kv.shape).copy_(kv)


BOUNCE_BYTES = 16 << 20  # each of a writer's two pinned buffers that its copies off the GPU pass through


class DeviceToHost:
    """A writer thread's copies off the GPU into its page-aligned host buffer, on a stream of its own
    and through two small pinned buffers: the GPU fills one while the host empties the other. A
    copy straight into pageable memory goes through the driver's own staging, and in a profiled fp8
    index run on an H200 none of those copies (631 ms in all) ran beside a kernel: the run took
    0.99 s longer than the same forward passes alone. A copy into pinned memory is asynchronous
    and can run on the copy engine beside the model's kernels."""

    def __init__(self, device: torch.device, piece: int = BOUNCE_BYTES):
        with torch.cuda.device(device):  # a new thread's current device is cuda:0, whichever GPU index runs on
            self.stream = torch.cuda.Stream()
            self.pinned = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.landed = [torch.cuda.Event(), torch.cuda.Event()]

    def copy(self, kv: torch.Tensor, buffer: np.ndarray, ready: torch.cuda.Event) -> torch.Tensor:
        """``kv`` copied into ``buffer`` once ``ready`` (recorded after the work that makes it) has run;
        returns when the bytes are there."""
        piece = self.pinned[0].numel()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            src = kv.contiguous().reshape(-1).view(torch.uint8)
            landing = None
            for i, start in enumerate(range(0, src.numel(), piece)):
                # pinned[i % 2] last held piece i - 2, which the host took before piece i - 1 was queued
                k, n = i % 2, min(piece, src.numel() - start)
                self.pinned[k][:n].copy_(src[start:start + n], non_blocking=True)
                self.landed[k].record(self.stream)
                if landing is not None:
                    self._take(buffer, *landing)
                landing = (k, start, n)
            if landing is not None:
                self._take(buffer, *landing)
        return torch.from_numpy(buffer[: kv.nbytes]).view(kv.dtype).view(kv.shape)

    def _take(self, buffer: np.ndarray, k: int, start: int, n: int) -> None:
        self.landed[k].synchronize()
        # numpy's copy: one thread, GIL released (torch's would start a thread team per writer)
        buffer[start:start + n] = self.pinned[k][:n].numpy()


WRITER_THREADS = 4  # segments written at once: the H200 machine's disk took more at 4 than at 3 (docs/benchmarks.md)
PREFAULT_PIECE = 64 << 20  # bytes of a writer's buffer touched between looks at its queue


@dataclass
class WriterTimes:
    """Where an index run's writes spent their time (IndexResult's write_* fields)."""
    wait_s: float = 0.0
    copy_s: float = 0.0
    store_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, wait_s: float = 0.0, copy_s: float = 0.0, store_s: float = 0.0) -> None:
        with self.lock:
            self.wait_s += wait_s
            self.copy_s += copy_s
            self.store_s += store_s


class BatchWriter:
    """Stores batches on writer threads behind a bounded queue, so compute never waits on
    disk. Each batch becomes its own segment, so several can be written at once: while one
    thread waits for fsync, another copies its batch off the GPU and writes."""

    def __init__(self, write: WriteBatch, threads: int | None = None, prefault_bytes: int = 0):
        threads = threads or WRITER_THREADS
        self.write = write
        self.queue: queue.Queue = queue.Queue(maxsize=threads)
        self.error: BaseException | None = None
        self.times = WriterTimes()
        self.prefault_bytes = prefault_bytes
        self.threads = [threading.Thread(target=self._run, name=f"lazyrag-writer-{i}", daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def _next(self, buffer: np.ndarray, touched: int) -> tuple[object, int]:
        """The next queue item; while none waits, the buffer's pages are touched a piece at a time
        (a batch that arrives meanwhile is taken at once: the first write starts no later)."""
        while touched < buffer.nbytes:
            try:
                return self.queue.get_nowait(), touched
            except queue.Empty:
                end = min(buffer.nbytes, touched + PREFAULT_PIECE)
                torch.from_numpy(buffer[touched:end]).zero_()
                touched = end
        return self.queue.get(), touched

    def _run(self) -> None:
        # One host buffer per thread, reused for every batch: a copy off the GPU into freshly
        # allocated memory runs at the speed its pages fault in (about 2 GB/s on the H200 machine),
        # into mapped memory several times faster. Touched while the model runs.
        off_gpu: DeviceToHost | None = None  # made at the first batch from a GPU
        buffer = aligned_empty(self.prefault_bytes)
        item, touched = self._next(buffer, 0)
        while item is not None:
            if self.error is None:
                try:
                    chunks, kv, ready = item
                    if buffer.nbytes < kv.nbytes:
                        buffer = aligned_empty(kv.nbytes)
                        touched = buffer.nbytes  # faulted in by this copy
                    t0 = time.perf_counter()
                    # off the compute thread, and on the writer's own stream: on the compute stream the
                    # copy would wait for the forward passes queued after this batch
                    if ready is None:
                        host = aligned_host_copy(kv, buffer)
                    else:
                        off_gpu = off_gpu or DeviceToHost(kv.device)
                        host = off_gpu.copy(kv, buffer, ready)
                    t1 = time.perf_counter()
                    self.write(chunks, kv_to_storage(host))  # synchronous: the buffer is free again after it
                    self.times.add(copy_s=t1 - t0, store_s=time.perf_counter() - t1)
                except BaseException as exc:  # reported on the main thread
                    self.error = exc
            item, touched = self._next(buffer, touched)

    def put(self, chunks: list[NewChunk], kv: torch.Tensor) -> None:
        self._check()
        ready = None
        if kv.is_cuda:  # the batch is ready once the work queued so far on this stream has run
            ready = torch.cuda.Event()
            ready.record()
        t0 = time.perf_counter()
        self.queue.put((chunks, kv, ready))
        self.times.add(wait_s=time.perf_counter() - t0)

    def close(self) -> None:
        t0 = time.perf_counter()
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()
        self.times.add(wait_s=time.perf_counter() - t0)  # the last batches' writes, after the model is done
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error


def encode_chunks(loaded: LoadedModel, settings: StoreSettings, chunks: Iterable[NewChunk], batch_pages: int,
                  write: WriteBatch, on_batch: Callable[[list[NewChunk]], None] = lambda batch: None) -> WriterTimes:
    """Encode ``chunks`` (a list, or a stream pulled as the batches need it) in forward passes of
    ``batch_pages`` pages and hand each batch's KV to ``write`` on writer threads; ``on_batch``
    hears of each batch once it is encoded."""
    batches = PageBatches(chunks, batch_pages, settings.page_size)
    if not batches.fill():
        return WriterTimes()
    encoder = ChunkEncoder(loaded, list(settings.preamble_ids), settings.page_size, batch_pages)
    # on a GPU the writers' buffers are touched while the first batch runs (capped at what the
    # chunks need: a small corpus should not map gigabytes); on the CPU the forward pass is the bound
    on_gpu = loaded.device.type == "cuda"
    prefault = min(batch_pages, batches.pages_ahead) * settings.page_size * settings.row_bytes if on_gpu else 0
    writer = BatchWriter(write, prefault_bytes=prefault)
    try:
        for batch in batches:
            writer.put(batch, stored_rows(encoder.encode([list(c.token_ids) for c in batch]), settings))
            on_batch(batch)
    finally:
        writer.close()
    return writer.times


class Plan:
    """What index encodes, as documents come: each document's chunk list recorded in the store
    (it becomes visible with its last chunk stored, replacing an older list), and the chunks to
    encode, each once: those not stored yet and the damaged ones. Damaged: chunks in missing or
    truncated segments, with ``verify`` also those whose data fails its checksum (reading every
    chunk back would cost a full read of the store each run)."""

    def __init__(self, store: Store, verify: bool):
        self.store = store
        self.damaged = store.check(verify=verify).damaged_chunk_ids
        self.documents: dict[str, list[NewChunk]] = {}
        self.todo: dict[str, NewChunk] = {}

    def add(self, documents: dict[str, list[NewChunk]]) -> list[NewChunk]:
        """Record these documents' chunk lists; return their chunks to encode that no earlier call returned."""
        new = []
        for chunks in documents.values():
            for c in chunks:
                # the same text elsewhere is stored once, referenced by both documents
                cid = c.chunk_id
                if cid not in self.todo and (cid in self.damaged or not self.store.has_chunk(cid)):
                    self.todo[cid] = c
                    new.append(c)
        self.store.put_documents([c for chunks in documents.values() for c in chunks])
        self.documents.update(documents)
        return new


def sync_documents(cfg: IndexConfig, store: Store, documents: dict[str, list[NewChunk]]) -> list[str]:
    """With --sync, the documents the corpus no longer holds leave the store's view (removed ids)."""
    return store.remove_missing_documents(documents.keys()) if cfg.sync else []


def build_index(cfg: IndexConfig, report=print, progress: bool = True, loaded: LoadedModel | None = None) -> IndexResult:
    """Index cfg.corpus into cfg.store in this process (`loaded`: an already loaded cfg.model, to
    skip loading); `index --workers N` goes through index_workers.index_corpus instead."""
    t0 = time.perf_counter()
    if cfg.workers > 1:
        raise ValueError("build_index runs in one process: index with workers through "
                         "lazyrag.commands.index_workers.index_corpus")
    loaded = loaded or load_model(cfg.model, cfg.device, cfg.dtype, cfg.trust_remote_code)
    settings = store_settings(loaded, cfg.model, cfg.chunk_tokens, cfg.page_size)
    with Store.create_or_open(cfg.store, settings) as store:
        # The corpus is chunked as the model needs its chunks, between batches: the host is ahead of
        # the GPU there, so the model starts on the first documents and never waits for the rest.
        stats = CorpusStats()
        plan = Plan(store, cfg.verify)
        bar = ProgressBar(progress)
        docs = read_corpus(cfg.corpus, skip_bad=cfg.skip_bad, report=bar.around(report), stats=stats)

        def planned() -> Iterator[NewChunk]:
            for group in chunk_groups(docs, loaded.tokenizer, settings, first=1):
                new = plan.add(group)
                bar.expect(len(new))
                yield from new
            bar.expect(0, last=True)

        try:
            times = encode_chunks(loaded, settings, planned(), pages_per_batch(cfg, settings),
                                  lambda chunks, kv: store.append(chunks, kv, replace=plan.damaged), bar.update)
        finally:
            bar.close()
        removed = sync_documents(cfg, store, plan.documents)
        return index_result(cfg, store, plan.todo, plan.damaged, stats, t0, times, removed)


def refresh_retrieval(store: Store) -> bool:
    """Rebuild a saved BM25 index that no longer matches the store or is damaged (True when it
    did): `check` reports a damaged one and says that `index` repairs it."""
    if not (store.local_dir / "bm25").exists():
        return False  # none saved yet: the first query that needs retrieval builds it
    from lazyrag.retrieve import refresh_index  # bm25s loads only when there is an index to refresh

    return refresh_index(store)


def index_result(cfg: IndexConfig, store: Store, todo: dict[str, NewChunk], damaged: set[str], stats: CorpusStats,
                 t0: float, times: WriterTimes | None = None, removed: list[str] | None = None) -> IndexResult:
    """The run's numbers; the last step of every index run, so it also refreshes the retrieval index."""
    retrieval_rebuilt = refresh_retrieval(store)
    summary = store.summary()
    times = times or WriterTimes()
    return IndexResult(
        store=str(cfg.store), chunks_added=len(todo), chunks_total=summary["chunks"],
        tokens_added=sum(len(c.token_ids) for c in todo.values()), tokens_total=summary["tokens"],
        documents_total=summary["documents"], documents_empty=stats.empty_skipped, bad_skipped=stats.bad_skipped,
        seconds=round(time.perf_counter() - t0, 3), store_bytes=summary["bytes"], chunks_repaired=len(damaged & todo.keys()),
        retrieval_rebuilt=retrieval_rebuilt, documents_removed=removed or [],
        write_wait_s=round(times.wait_s, 3), writer_copy_s=round(times.copy_s, 3),
        writer_store_s=round(times.store_s, 3),
    )


class ProgressBar:
    """tqdm over chunks, with tokens/s beside it (stderr; silent when progress is off). The corpus is
    chunked as the run goes, so the bar counts chunks without a total (no percentage it cannot
    know) until the last document is chunked."""

    def __init__(self, enabled: bool):
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.enabled = enabled
        self.expected = 0
        self.tqdm = None  # made at the first chunk to encode: a run that adds none shows no bar

    def expect(self, chunks: int, last: bool = False) -> None:
        """``chunks`` more to encode; ``last``: no more will come, the total is known."""
        self.expected += chunks
        if self.tqdm is None and self.expected:
            from tqdm import tqdm

            self.tqdm = tqdm(total=None, unit="chunk", desc="index", disable=not self.enabled, dynamic_ncols=True)
        if self.tqdm is not None and last:
            self.tqdm.total = self.expected
            self.tqdm.refresh()

    def around(self, report: Callable[[str], None]) -> Callable[[str], None]:
        """``report`` writing with the bar cleared and drawn again after (a line skipped mid-run)."""
        def write(message: str) -> None:
            if self.tqdm is None:
                report(message)
                return
            with self.tqdm.external_write_mode():
                report(message)
        return write

    def update(self, chunks: list[NewChunk]) -> None:
        self.tokens += sum(len(c.token_ids) for c in chunks)
        self.tqdm.set_postfix_str(f"{self.tokens / (time.perf_counter() - self.t0):,.0f} tok/s", refresh=False)
        self.tqdm.update(len(chunks))

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
