"""`lazyrag answer --audit N`: how far the run's mode is from full attention on its own queries.

A seeded sample of the run's answered queries is answered again in `full`, greedily and
as long as the run's answers may be; then `full` and the run's mode are both teacher-forced
along the first FORCED_TOKENS of full's answer, so the measures of lazyrag/eval/fidelity.py
compare the two modes on the same prefix. The mode's answer is the one the run wrote.
A `full` run is audited the same way: it checks the measurement itself (identical, KL 0).
`full` always takes each query's chunks in the order the query gave, whatever order the run
put them in (--chunk-order): the audit measures the distance to what the user asked for.
`lazyrag bench` measures each configuration against one FullReference the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lazyrag.config import AnswerConfig, Mode
from lazyrag.eval.fidelity import FORCED_TOKENS, fidelity
from lazyrag.models import LoadedModel
from lazyrag.serve import Engine, Recompute, Request
from lazyrag.store import Store


@dataclass
class FullReference:
    """full's greedy answers to some requests, each on the chunk order its query gave, and full's
    logits teacher-forced along the first FORCED_TOKENS of each answer (one entry per request)."""

    answers: list[str]
    forced: list[list[int]]
    logits: list[torch.Tensor]


def audit_run(cfg: AnswerConfig, loaded: LoadedModel, store: Store, rows: list[dict],
              requests: dict[str, Request]) -> dict:
    """The run's `audit` record (lazyrag.eval.fidelity.Fidelity) over min(cfg.audit, len(rows))
    of its answered rows, sampled with cfg.seed; `requests` holds each row's request by id."""
    answered = sorted(rows, key=lambda r: r["id"])
    sample = random.Random(cfg.seed).sample(answered, min(cfg.audit, len(answered)))
    reqs = [requests[r["id"]] for r in sample]
    reference = full_reference(cfg, loaded, store, reqs)
    logits = forced_logits(cfg, loaded, store, reqs, reference.forced)
    return fidelity(reference.answers, [r["answer"] for r in sample], reference.logits, logits).to_json()


def full_reference(cfg: AnswerConfig, loaded: LoadedModel, store: Store, requests: list[Request],
                   generated: dict[str, list[int]] | None = None) -> FullReference:
    """full's reference for `requests`; `generated` (token ids by request id): full's answers
    already at hand, else they are generated here."""
    as_given = [Request(r.id, r.meta.get("given_chunks", r.chunks), r.question_ids, r.max_new_tokens)
                for r in requests]
    full = _engine(cfg, loaded, store, Mode.FULL, cfg.cuda_graphs)  # plain attention: APE has no chunks in full
    try:
        if generated is None:
            generated = {}
            full.run(as_given, lambda seq: generated.__setitem__(seq.id, seq.generated))
        forced = [generated[r.id][:FORCED_TOKENS] for r in requests]
        logits = full.teacher_forced_logits(as_given, forced)
    finally:
        full.close()
    return FullReference([answer_text(loaded, generated[r.id]) for r in requests], forced, logits)


def forced_logits(cfg: AnswerConfig, loaded: LoadedModel, store: Store, requests: list[Request],
                  forced: list[list[int]]) -> list[torch.Tensor]:
    """cfg.mode's logits for `requests` teacher-forced along `forced` (a reference's), on a fresh engine."""
    # teacher forcing is all prefill: no decode graphs
    mode = _engine(cfg, loaded, store, cfg.mode, cuda_graphs=False, ape=(cfg.ape_temperature, cfg.ape_scale))
    try:
        return mode.teacher_forced_logits(requests, forced)
    finally:
        mode.close()


def _engine(cfg: AnswerConfig, loaded: LoadedModel, store: Store, mode: Mode, cuda_graphs: bool,
            ape: tuple[float, float] = (1.0, 1.0)) -> Engine:
    return Engine(loaded, store, mode, cfg.cache_gb * 2**30, cfg.batch_size,
                  host_cache_bytes=cfg.host_cache_gb * 2**30, cuda_graphs=cuda_graphs,
                  recompute=Recompute.of(cfg), ape=ape, shared_attention=cfg.shared_attention)


def answer_text(loaded: LoadedModel, generated: list[int]) -> str:
    """An answer's text as the answers file holds it."""
    return loaded.tokenizer.decode(generated, skip_special_tokens=True).strip()
