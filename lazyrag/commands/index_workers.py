"""`lazyrag index --workers N`: the corpus split between N encoding processes.

Documents go to workers by a stable hash of their id. Each worker (a spawned process, one per
GPU, or on the CPU one with its share of the threads) loads the model, chunks its documents
and sends their chunk lists; the parent, the store's one writer, records every document's list
and assigns each chunk to encode to one worker (chunks already stored are not encoded again,
and a chunk that documents of several workers share goes to one of them). Workers then run
the encode loop of lazyrag/commands/index.py and write their own segments, durable; the parent
commits each segment a worker reports, as a single process's append would. A run killed at any
point leaves only uncommitted segments, which the next open deletes. Only plain data (lists,
dicts, numbers, strings) crosses between the processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import signal
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait

import click
import torch

from lazyrag.commands.index import (IndexResult, Plan, ProgressBar, chunk_corpus, encode_chunks, index_result,
                                    pages_per_batch, store_settings, sync_documents)
from lazyrag.commands.index import build_index
from lazyrag.config import IndexConfig
from lazyrag.corpus import CorpusStats, Document, read_corpus
from lazyrag.errors import WorkerFailed
from lazyrag.failures import classify, debug_traceback
from lazyrag.models import load_model, resolve_device
from lazyrag.store import NewChunk, Store, StoreSettings
from lazyrag.store.location import store_location
from lazyrag.store.store import WrittenSegment, write_chunks

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_devices(device: str, workers: int) -> list[str]:
    """Each worker's device: cuda:0..N-1 when indexing on GPUs, else the CPU N times. A usage
    error when there are fewer GPUs than workers or --device names one GPU for several."""
    if workers == 1:
        return [device]
    dev = resolve_device(device)
    if dev.type != "cuda":
        return [str(dev)] * workers
    if dev.index is not None:
        raise click.BadParameter(f"--device {device} names one GPU; with --workers {workers} pass --device cuda "
                                 "(worker i runs on cuda:i)", param_hint="'--workers'")
    gpus = torch.cuda.device_count()
    if workers > gpus:
        raise click.BadParameter(f"{workers} workers need {workers} GPUs, one each, and this machine shows {gpus}; "
                                 f"use --workers {gpus} or fewer, or --device cpu", param_hint="'--workers'")
    return [f"cuda:{i}" for i in range(workers)]


def worker_of(doc_id: str, workers: int) -> int:
    """The worker a document goes to: the same in every run (Python's own hash is salted per process)."""
    return zlib.crc32(doc_id.encode()) % workers


def index_corpus(cfg: IndexConfig, report=print, progress: bool = True) -> IndexResult:
    """`lazyrag index`: with cfg.workers above 1 in that many processes, each loading its own
    model, else in this one (build_index)."""
    if cfg.workers > 1:
        return index_with_workers(cfg, report, progress, time.perf_counter())
    return build_index(cfg, report, progress)


def index_with_workers(cfg: IndexConfig, report, progress: bool, t0: float) -> IndexResult:
    devices = worker_devices(cfg.device, cfg.workers)
    stats = CorpusStats()
    order: list[str] = []
    shards: list[list[list]] = [[] for _ in devices]
    for doc in read_corpus(cfg.corpus, skip_bad=cfg.skip_bad, report=report, stats=stats):
        order.append(doc.id)
        shards[worker_of(doc.id, len(devices))].append([doc.id, doc.text, doc.title, doc.source])
    with Workers(cfg, devices, shards) as workers:
        settings, chunked, owner = workers.chunked()
        documents = {doc_id: chunked[doc_id] for doc_id in order}
        with Store.create_or_open(cfg.store, settings) as store:
            plan = Plan(store, cfg.verify)
            plan.add(documents)
            damaged, todo = plan.damaged, plan.todo
            removed = sync_documents(cfg, store, documents)
            workers.assign(todo, owner, store, pages_per_batch(cfg, settings))
            bar = ProgressBar(progress)
            bar.expect(len(todo), last=True)
            try:
                for written in workers.segments(todo):
                    store.commit(written)
                    bar.update([c for c, *_ in written.placed])
            finally:
                bar.close()
            return index_result(cfg, store, todo, damaged, stats, t0, removed=removed)


class Workers:
    """The worker processes and the parent's end of each one's pipe; leaving the context waits
    for them, or kills them when the run failed."""

    def __init__(self, cfg: IndexConfig, devices: list[str], shards: list[list[list]]):
        self.cfg, self.devices, self.shards = cfg, devices, shards
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []

    def __enter__(self) -> Workers:
        cfg = self.cfg
        options = {"model": cfg.model, "dtype": cfg.dtype, "trust_remote_code": cfg.trust_remote_code,
                   "chunk_tokens": cfg.chunk_tokens, "page_size": cfg.page_size,
                   "threads": max(1, torch.get_num_threads() // len(self.devices))}
        ctx = multiprocessing.get_context("spawn")  # a forked child would inherit torch's threads and CUDA state
        try:
            for i, device in enumerate(self.devices):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=run_worker, args=(device, options, theirs), name=f"lazyrag-index-{i}",
                                   daemon=True)
                self.conns.append(mine)
                proc.start()
                theirs.close()  # the worker's end: its exit then reads as the pipe's end here
                self.procs.append(proc)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        for proc in self.procs:
            if exc_type is not None:
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()

    def chunked(self) -> tuple[StoreSettings, dict[str, list[NewChunk]], dict[str, int]]:
        """Send each worker its documents and return their chunk lists: the store's settings (from the
        model the workers loaded), each document's chunks, and the worker that will encode each chunk
        (the first that lists it)."""
        # through the pipe, not as the process's arguments: a worker that dies before reading those
        # leaves Process.start blocked for good
        for i, docs in enumerate(self.shards):
            self._send(i, docs)
        replies = {i: message for i, message in self._messages(until="chunked")}
        documents: dict[str, list[NewChunk]] = {}
        owner: dict[str, int] = {}
        for i in range(len(self.procs)):
            _, _settings, lists = replies[i]
            for doc_id, rows in lists.items():
                documents[doc_id] = [NewChunk(cid, doc_id, ordinal, tuple(ids), text)
                                     for cid, ordinal, ids, text in rows]
                for cid, *_ in rows:
                    owner.setdefault(cid, i)
        return StoreSettings.from_json(replies[0][1]), documents, owner

    def assign(self, todo: dict[str, NewChunk], owner: dict[str, int], store: Store, batch_pages: int) -> None:
        """Send each worker the chunks it encodes and what it needs to write them as segments."""
        first, n = store.next_segment_seq(), len(self.procs)
        for i in range(n):
            self._send(i, {"chunk_ids": [cid for cid in todo if owner[cid] == i], "batch_pages": batch_pages,
                           "store": str(store.path), "store_id": store.store_id, "first_seq": first + i,
                           "seq_step": n})

    def segments(self, todo: dict[str, NewChunk]) -> Iterator[WrittenSegment]:
        """The segments the workers write, as each is reported, until every worker is done."""
        for _, message in self._messages(until="done"):
            if message[0] == "segment":
                entry = message[1]
                placed = [(todo[cid], offset, padded, crc) for cid, offset, padded, crc in entry["placed"]]
                yield WrittenSegment(entry["name"], placed, entry["rows"], entry["nbytes"])

    def _send(self, i: int, message) -> None:
        try:
            self.conns[i].send(message)
        except OSError:
            raise self._ended(i) from None

    def _messages(self, until: str) -> Iterator[tuple[int, tuple]]:
        """(worker, message) as they come, until each worker has sent an ``until`` message (yielded
        too); WorkerFailed as soon as one reports a failure or ends."""
        waiting = {conn: i for i, conn in enumerate(self.conns)}
        while waiting:
            for conn in wait(list(waiting)):
                i = waiting[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise self._ended(i) from None
                if message[0] == "failed":
                    _, code, text = message
                    raise WorkerFailed(code, f"index worker {i} on {self.devices[i]} failed: {text}; the chunks "
                                             "stored so far are kept, and the same command resumes")
                if message[0] == until:
                    del waiting[conn]
                yield i, message

    def _ended(self, i: int) -> WorkerFailed:
        proc = self.procs[i]
        proc.join(timeout=10)
        code = proc.exitcode
        how = ("stopped answering" if code is None else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        return WorkerFailed(1, f"index worker {i} on {self.devices[i]} {how} before it finished; the chunks stored "
                               "so far are kept: run the same command again to resume")


def run_worker(device: str, options: dict, conn: Connection) -> None:
    """A worker: load the model, chunk its documents and send their chunk lists; then encode the
    chunks the parent assigns, write them as segments and send each segment's entry."""
    _die_with_parent()
    try:
        docs = conn.recv()
        torch.set_num_threads(options["threads"])
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # the Triton kernels launch on the current device
        loaded = load_model(options["model"], device, options["dtype"], options["trust_remote_code"])
        settings = store_settings(loaded, options["model"], options["chunk_tokens"], options["page_size"])
        chunks: dict[str, NewChunk] = {}
        lists = {}
        documents = chunk_corpus((Document(*doc) for doc in docs), loaded.tokenizer, settings)
        for doc_id, doc_chunks in documents.items():
            lists[doc_id] = [[c.chunk_id, c.ordinal, list(c.token_ids), c.text] for c in doc_chunks]
            for c in doc_chunks:
                chunks.setdefault(c.chunk_id, c)
        conn.send(("chunked", settings.to_json(), lists))
        job = conn.recv()
        seqs = itertools.count(job["first_seq"], job["seq_step"])  # names stay unique across the workers
        sending = threading.Lock()  # the writer threads share the pipe

        def write(batch: list[NewChunk], kv) -> None:
            written = write_chunks(store_location(job["store"]), settings, job["store_id"], next(seqs), batch, kv)
            entry = {"name": written.name, "rows": written.rows, "nbytes": written.nbytes,
                     "placed": [[c.chunk_id, offset, padded, crc] for c, offset, padded, crc in written.placed]}
            with sending:
                conn.send(("segment", entry))

        encode_chunks(loaded, settings, [chunks[cid] for cid in job["chunk_ids"]], job["batch_pages"], write)
        conn.send(("done",))
    except BaseException as exc:  # told to the parent, which ends the run with it
        failure = classify(exc)
        debug_traceback()
        with contextlib.suppress(OSError):
            conn.send(("failed", failure.code, failure.message))


def _die_with_parent() -> None:
    """Have Linux kill this worker when the index process dies, even by SIGKILL: the worker would
    only write segments no one commits, on a GPU the next run needs."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # died before the request above
        sys.exit(1)
