"""Batch answering: continuous batching over the paged pool, in one of three modes.

The engine composes the parts: the page pool and the chunk cache that allocates it
(lazyrag/serve/cache.py, with its loader), the mode that places each request
(lazyrag/serve/modes.py), the scheduler that picks each step's batch, the runner
that runs the model, and the sampler. Its loop runs the scheduler's steps and hands
each finished request back to the caller.

While a batch only decodes, the loop launches the next step before it reads the tokens of the
one before: the sampled ids feed the next step on the device, and the host takes them, and
builds the step after, while the GPU runs (otherwise the GPU waits for the host at every step).
A request that stops at a stop token has then run one step too many: that token is dropped.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Iterator

import torch

from lazyrag import kernels
from lazyrag.config import Mode
from lazyrag.eval.fidelity import mean_logprob
from lazyrag.models import LoadedModel
from lazyrag.serve import faults
from lazyrag.serve.cache import ChunkCache
from lazyrag.serve.frozen import objects_frozen
from lazyrag.serve.loader import ChunkLoader
from lazyrag.serve.modes import select_mode
from lazyrag.serve.paged import PagePool
from lazyrag.serve.recompute import Recompute
from lazyrag.serve.request import Request, Sequence
from lazyrag.serve.runner import Runner
from lazyrag.serve.sampler import Sampler, Sampling
from lazyrag.serve.scheduler import OnError, Scheduler, StepCounts
from lazyrag.serve.sharing import ChunkMajor
from lazyrag.store import Store, StoreMismatch, torch_dtype


class Sampled:
    """A step's sampled ids on the device, and their copy to the host, started at once so that
    reading them later waits for that step only (not for the steps launched after it)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._host = ids.to("cpu", non_blocking=True)  # pinned memory, for a CUDA source
        self._ready = torch.cuda.Event() if ids.is_cuda else None
        if self._ready is not None:
            self._ready.record()

    def read(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class Engine:
    def __init__(self, loaded: LoadedModel, store: Store, mode: Mode | str, cache_bytes: float, batch_size: int,
                 sampling: Sampling = Sampling(), host_cache_bytes: float = 0, stop_at_eos: bool = True,
                 cuda_graphs: bool = True, recompute: Recompute = Recompute(),
                 ape: tuple[float, float] = (1.0, 1.0), shared_attention: bool = True):
        """ape: APE's (temperature, scale) on the attention from each request's own tokens to
        its chunk pages, lazy and block only; (1, 1) is off. shared_attention: in lazy mode, each
        step reads each chunk page once for every request of the step that uses it (chunk-major
        attention, lazyrag/serve/sharing.py), fp8 pools included; otherwise per request."""
        mode_class = select_mode(mode)
        kernels.check_ape(*ape)
        if Mode(mode) is Mode.FULL and kernels.ape_enabled(*ape):
            raise ValueError("APE's temperature and scale apply to lazy and block only: in full the chunks are "
                             "the request's own tokens")
        self.ranking_layer = recompute.ranking_layer(loaded.cfg.num_layers) if recompute.needs_scores else 0
        s = store.settings
        if torch_dtype(s.kv_dtype) != loaded.kv_dtype:
            raise StoreMismatch(f"the store's KV is {s.kv_dtype} but the model was loaded for "
                                f"{str(loaded.kv_dtype).removeprefix('torch.')} KV; load it with the store's dtype")
        self.batch_size, self.device = batch_size, loaded.device
        self.pool = PagePool.for_bytes(cache_bytes, s.num_layers, s.num_kv_heads, s.head_dim, s.page_size,
                                       loaded.kv_dtype, loaded.device)
        self.cache = ChunkCache(self.pool, ChunkLoader(store, self.pool, host_cache_bytes))
        chunk_major = None
        if shared_attention and mode_class.shares_chunks:
            cfg = loaded.cfg
            chunk_major = ChunkMajor(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, loaded.device)
        self.runner = Runner(loaded, self.pool, mode_class.rotate_queries, ape, chunk_major)
        self.mode = mode_class(s.preamble_ids, s.page_size, self.runner.rotate_copy, recompute, namespace=s.fingerprint)
        self.sampler = Sampler(sampling)
        self.stop_ids = loaded.eos_ids if stop_at_eos else set()  # benchmarks fix the answer length
        self.steps = StepCounts()  # every run's steps, for benchmarks
        preamble = self.mode.place_preamble(self.cache)
        if preamble is not None:  # its queries sit at their own positions: no per-page rotation
            self.runner.forward([preamble], rotate_queries=False)
        if cuda_graphs and self.device.type == "cuda":
            self.runner.capture_graphs(batch_size, pad_page=self.cache.alloc(1)[0])

    def run(self, requests: Iterable[Request | None], on_finish: Callable[[Sequence], None], lookahead: int | None = None,
            on_error: OnError | None = None) -> None:
        """Answer every request. `requests` may be an open stream, yielding None while none has
        arrived yet; the engine then runs what it has and asks again (lazyrag/serve/scheduler.py).
        `on_finish` gets each one's Sequence as it ends (finishing order): the request's id,
        chunks and meta, its generated ids, ttft_ms, latency_ms, hits and misses. `on_error(seq,
        exc)` gets each request that fails alone (lazyrag/serve/faults.py: a chunk that cannot be
        read, out of memory, bad token ids), after all it held is given back; the others still
        run. Without it such an error ends the run."""
        with objects_frozen():
            self._run(requests, on_finish, lookahead, on_error)

    def _run(self, requests: Iterable[Request | None], on_finish: Callable[[Sequence], None], lookahead: int | None,
             on_error: OnError | None) -> None:
        sequences = (None if r is None else Sequence(r) for r in requests)
        scheduler = Scheduler(self.mode, self.cache, self.batch_size, sequences, lookahead, on_error, self.steps)
        failed: dict[int, Exception] = {}  # id(seq) -> why its decode failed; it leaves at retire
        while (step := scheduler.schedule()) is not None:
            if step.prefill:
                logits = self._isolated_prefill(step.batch, scheduler)
                if logits is None:
                    continue  # the batch failed: its requests run again one at a time
            else:
                logits = self._isolated_decode(step.batch, None, on_error, failed)
            sampled = self._sample(step.batch, logits, pending=0)
            while scheduler.decodes_next(step.batch, pending=1):
                logits = self._isolated_decode(step.batch, sampled.ids, on_error, failed)
                following = self._sample(step.batch, logits, pending=1)
                self._accept(step.batch, sampled)  # waits for the step before only: this one runs meanwhile
                sampled = following
                if any(seq.finished for seq in step.batch):
                    break  # a stop token: the sequence leaves once the step in flight is done
            self._accept(step.batch, sampled)
            for seq in scheduler.retire():  # nothing in flight: their pages can be handed on
                exc = failed.pop(id(seq), None)
                if exc is None:
                    on_finish(seq)
                else:
                    on_error(seq, exc)

    def _isolated_prefill(self, batch: list[Sequence], scheduler: Scheduler) -> torch.Tensor | None:
        """The batch's prefill logits; None when it failed for an error that may concern one
        request only: nothing says which, so each runs again alone, and one failing alone fails
        (everything it held given back). Other errors end the run."""
        try:
            return self._prefill(batch)
        except Exception as exc:
            if scheduler.on_error is None or not faults.concerns_request(exc):
                raise
            for seq in batch:
                self._abandon(seq)
            if len(batch) == 1:
                scheduler.fail(batch[0], exc)
            else:
                scheduler.retry_alone(batch)
            return None

    def _abandon(self, seq: Sequence) -> None:
        """Give back what a sequence whose prefill failed holds, so it can be placed afresh."""
        seq.placement.release(self.cache)
        seq.placement, seq.fed, seq.hits, seq.misses = None, 0, 0, 0

    def _isolated_decode(self, batch: list[Sequence], tokens: torch.Tensor | None, on_error,
                         failed: dict[int, Exception]) -> torch.Tensor:
        """runner.decode; if it fails for an error that may concern one request only, each
        sequence decodes alone, and one failing alone ends now (noted in `failed`; its logits row
        is zeros, never accepted)."""
        try:
            return self.runner.decode(batch, tokens)
        except Exception as exc:
            if on_error is None or not faults.concerns_request(exc):
                raise
        rows = []
        for i, seq in enumerate(batch):
            try:
                rows.append(self.runner.decode([seq], None if tokens is None else tokens[i: i + 1]))
            except Exception as exc:
                if not faults.concerns_request(exc):
                    raise
                failed[id(seq)] = exc
                seq.finished_at = time.perf_counter()
                rows.append(torch.zeros(1, self.runner.vocab, device=self.device))
        return torch.cat(rows)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor, pending: int) -> Sampled:
        """The next token of each sequence, still on the device; `pending` of each one's tokens are
        sampled but not yet accepted (the sampler's step number counts them)."""
        ids = self.sampler.sample(logits, [seq.id for seq in batch], [len(seq.generated) + pending for seq in batch])
        return Sampled(ids)

    def _accept(self, batch: list[Sequence], sampled: Sampled) -> None:
        ids = sampled.read()
        now = time.perf_counter()
        for seq, token in zip(batch, ids):
            if not seq.finished:  # finished at a stop token while this step was in flight
                seq.accept(token, now, self.stop_ids)

    def teacher_forced_logits(self, requests: list[Request], continuations: list[list[int]]) -> list[torch.Tensor]:
        """Per request, the float32 CPU logits [len(continuation), vocab] that predict each
        continuation token after the request's prompt, by teacher forcing, in this engine's mode."""
        return list(self._forced_logits(requests, continuations))

    def continuation_logprobs(self, requests: list[Request], continuations: list[list[int]]) -> list[float]:
        """Mean log-probability per token of each continuation after its request's prompt, by
        teacher forcing, in this engine's mode (more sensitive than accuracy for a small model)."""
        return [mean_logprob(logits, c) for logits, c in zip(self._forced_logits(requests, continuations),
                                                              continuations)]

    def _forced_logits(self, requests: list[Request], continuations: list[list[int]]) -> Iterator[torch.Tensor]:
        # in request order, a batch at a time, so a caller that reduces each tensor holds about one
        # batch's logits; the scheduler may admit a request ahead of one still reading its chunks
        seqs = [Sequence(r, max_new_tokens=len(c)) for r, c in zip(requests, continuations)]
        index = {id(seq): i for i, seq in enumerate(seqs)}
        scheduler = Scheduler(self.mode, self.cache, self.batch_size, seqs)
        ready: dict[int, torch.Tensor] = {}
        done = 0
        while (step := scheduler.schedule()) is not None:  # each batch is finished once scored: all prefill
            order = [index[id(seq)] for seq in step.batch]
            logits = self._computing_recompute(step.batch, self.runner.teacher_forced_logits, step.batch,
                                               [continuations[i] for i in order])
            ready.update(zip(order, logits))
            scheduler.finish(step.batch)
            while done in ready:
                yield ready.pop(done)
                done += 1

    def _prefill(self, batch: list[Sequence]) -> torch.Tensor:
        return self._computing_recompute(batch, self.runner.prefill, batch)

    def _computing_recompute(self, batch: list[Sequence], step, *args):
        """Run `step(*args)`, the batch's first step, after choosing its recompute; if it fails,
        the recomputed pages it was to compute are forgotten (no later request may read them)."""
        try:
            for seq in batch:
                self._check_tokens(seq)
            self._choose_recompute(batch)
            out = step(*args)
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error says more than a broken GPU's
                self._drain()
            self._forget_created(batch)
            raise
        for seq in batch:
            seq.placement.created = []  # computed: later requests may read them
        return out

    def _drain(self) -> None:
        """Wait for the GPU: a failed step may have left kernels in flight over pages about to be
        freed, and chunk copies into free pages wait for no kernel (lazyrag/serve/loader.py)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forget_created(self, batch: list[Sequence]) -> None:
        """The batch's step failed: the recomputed pages it was to compute hold nothing, so they
        leave the cache now. Another request of the batch may have pinned them (it reads what
        the first computes): it lets go too, and the last pin dropped evicts them."""
        created = {id(e) for seq in batch for e in seq.placement.created}
        for seq in batch:
            mine = {id(e) for e in seq.placement.created}
            for entry in [e for e in seq.placement.recomputed if id(e) in created and id(e) not in mine]:
                seq.placement.recomputed.remove(entry)
                self.cache.drop_recomputed(entry)
        for seq in batch:
            seq.placement.forget_created(self.cache)

    def _check_tokens(self, seq: Sequence) -> None:
        """BadTokens for a request whose prompt or chunks hold ids the model cannot embed."""
        faults.check_tokens(seq.placement.prompt_ids, self.runner.vocab, f"request {seq.id}'s prompt")
        for row, tokens in seq.placement.recompute:
            faults.check_tokens(tokens, self.runner.vocab, f"a chunk of request {seq.id}")

    def _choose_recompute(self, batch: list[Sequence]) -> None:
        """For the `attention` policy: rank each admitted request's chunk pages by the attention
        its prompt pays them, in a pass over the first layers, then assign its recompute."""
        if self.mode.recompute.needs_scores:
            for seq, mass in zip(batch, self.runner.row_attention(batch, self.ranking_layer)):
                self.mode.assign_recompute(seq.request, seq.placement, self.cache, mass)

    def close(self) -> None:
        self.cache.close()
