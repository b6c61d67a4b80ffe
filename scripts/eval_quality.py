#!/usr/bin/env python
"""Quality of selective recompute (and APE) against full attention, on real questions (CPU).

Every measure compares a configuration with `full` on the same prompt token ids
(lazyrag/eval/fidelity.py, the same measurement as `answer --audit`): full answers each
question greedily (FORCED_TOKENS new tokens at most, EOS stops); each configuration is
teacher-forced along full's answer ids (mean KL(full || mode) per token, top-1 agreement),
answers greedily itself (identical to full, token F1 to full), and on MuSiQue is
teacher-forced along the first gold answer (mean log-likelihood per token).

A configuration is a mode (lazy, block), a recompute fraction F and policy
(lazyrag/serve/recompute.py), and APE's attention temperature and scale when the engine
has them. The first half of the MuSiQue questions (1-75 of 150, file order) chooses the
default F: the smallest F of the grid below 1 that closes at least half of the gap between
F=0 and full in both mean KL and gold log-likelihood (else the one closing the most). The
second half and the news questions (own document + 4 BM25 neighbours, shuffled) report it.
`--held-out news-shared` measures reuse and chunk order where prompts share documents
(each news question's own document + 4 drawn by Zipf popularity from 20 others).

Each corpus is indexed once into --work, and full's answers and logits and every
configuration's figures are kept there, so an interrupted run resumes (a new --work, or
removing its results/, measures again). Writes
docs/results/quality-recompute.json (every figure) and docs/results/quality-recompute.md.

Usage: python scripts/eval_quality.py [--data ../shared/data] [--per-split 75] [--news-limit 40] [--grid 0.05,0.1]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from lazyrag.commands.audit import answer_text
from lazyrag.commands.index import build_index
from lazyrag.commands.queries import read_queries, resolve_chunks
from lazyrag.config import DEFAULT_MODEL, PAGE_SIZES, ChunkOrder, IndexConfig, Mode
from lazyrag.eval.fidelity import FORCED_TOKENS, Fidelity, mean_logprob, token_kl, top1_matches
from lazyrag.eval.scoring import agreement
from lazyrag.kernels.rope import rope
from lazyrag.models import LoadedModel, load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, Request
from lazyrag.serve.ordering import PopularFirst, shared_prefixes
from lazyrag.store import Store

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
APE = (0.9, 1.0)  # attention temperature and scale for the APE rows (T=S=1 is off)
HALF = 0.5        # share of the F=0 gap a default must close in both measures


# ---- configurations ---------------------------------------------------------------------------

def policies() -> list[str]:
    """The recompute policies this lazyrag has (`head` alone before policies were added)."""
    try:
        from lazyrag.serve.recompute import Policy
    except ImportError:
        return ["head"]
    return [p.value for p in Policy]


def engine_has_ape() -> bool:
    return "ape" in inspect.signature(Engine).parameters


@dataclass(frozen=True)
class Config:
    mode: str
    fraction: float = 0.0
    policy: str = "head"
    ape: tuple[float, float] | None = None
    reuse: bool = False         # recomputed pages cached and reused across requests (Recompute.reuse)
    order: str = "given"        # the prompts' document order (--chunk-order); full always takes the given one
    primed: bool = False        # with reuse: each prompt's pages first recomputed for another question (worst case)

    @property
    def key(self) -> str:
        ape = f"ape{self.ape[0]:g}x{self.ape[1]:g}" if self.ape else "noape"
        extra = ("-reuse" if self.reuse else "") + ("" if self.order == "given" else f"-{self.order}")
        extra += "-primed" if self.primed else ""
        return f"{self.mode}-F{self.fraction:g}-{self.policy}-{ape}{extra}"

    def engine(self, loaded: LoadedModel, store: Store, args) -> Engine:
        recompute = Recompute(self.fraction, self.policy, reuse=self.reuse)
        extra = {"ape": self.ape} if self.ape else {}
        return Engine(loaded, store, self.mode, args.cache_gb * 2**30, args.batch_size,
                      recompute=recompute, **extra)

    def prompts(self, requests: list[Request]) -> list[Request]:
        """The requests as answer builds them in this configuration: chunks in its order and
        shared prefixes, both counted over the split."""
        if ChunkOrder(self.order) is ChunkOrder.POPULAR:
            popular = PopularFirst(r.chunks for r in requests)
            requests = [Request(r.id, popular.order(r.chunks), r.question_ids, r.max_new_tokens) for r in requests]
        uses = Recompute(self.fraction, self.policy, reuse=self.reuse).whole_prefix_uses if self.mode == "lazy" else None
        shared = shared_prefixes([r.chunks for r in requests], uses)
        return [replace(r, shared_prefix=n) for r, n in zip(requests, shared)]


FULL = Config(Mode.FULL.value)
LAZY = Config(Mode.LAZY.value)


def grid(points: list[tuple[str, float]]) -> list[Config]:
    """The selection grid: lazy at F=0, block and APE there, then each (policy, F) point."""
    rows = [LAZY, Config(Mode.BLOCK.value)]
    if engine_has_ape():
        rows.append(Config(Mode.LAZY.value, ape=APE))
    return rows + [Config(Mode.LAZY.value, f, p) for p, f in points]


def parse_configs(text: str) -> list[Config]:
    """"attention:0.1:reuse:popular,..." -> lazy configurations: policy, F, then the optional
    words reuse and popular (an order)."""
    configs = []
    for item in text.split(","):
        policy, f, *words = item.split(":")
        order = next((w for w in words if w not in ("reuse", "primed")), "given")
        configs.append(Config(Mode.LAZY.value, float(f), policy, reuse="reuse" in words or "primed" in words,
                              order=order, primed="primed" in words))
    return configs


def parse_grid(text: str) -> list[tuple[str, float]]:
    """"attention:0.05,head:0.2" -> [(policy, F)]; a bare F means every policy."""
    points = []
    for item in text.split(","):
        policy, _, f = item.rpartition(":")
        points += [(p, float(f)) for p in ([policy] if policy else policies())]
    return points


def at_default(default: Config, lean: bool) -> list[Config]:
    """The rows a reported split needs: F=0 and the default in each mode, each policy at the
    default F, and APE at both when the engine has it. lean: lazy alone at F=0 and at the
    default (block and APE are measured on the selection questions)."""
    if lean:
        return [LAZY, default]
    ape = engine_has_ape()
    rows = [LAZY, Config(Mode.BLOCK.value)] + [Config(Mode.LAZY.value, ape=APE)] * ape + [default]
    rows.append(Config(Mode.BLOCK.value, default.fraction, default.policy))
    rows += [Config(Mode.LAZY.value, default.fraction, p) for p in policies() if p != default.policy]
    rows += [Config(Mode.LAZY.value, default.fraction, default.policy, APE)] * ape
    return list(dict.fromkeys(rows))


# ---- data -------------------------------------------------------------------------------------

def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def musique_queries(args, selection: bool = True, report: bool = True) -> list[dict]:
    """The first --per-split of the selection half (questions 1-75) and of the reported half
    (76-150), each where asked for; their documents written as the corpus of that choice."""
    src = args.data / "musique"
    queries = jsonl(src / "queries.jsonl")
    half = len(queries) // 2
    queries = (queries[:half][: args.per_split] if selection else []) + (queries[half:][: args.per_split] if report else [])
    needed = {d for q in queries for d in q["docs"]}
    name = "musique" if report else "musique-select"
    write_jsonl(args.work / f"{name}-corpus.jsonl", [d for d in jsonl(src / "corpus.jsonl") if d["id"] in needed])
    return queries


def news_queries(args) -> list[dict]:
    """Each question with its own document and its 4 BM25 neighbours from the whole corpus, shuffled."""
    import bm25s

    src = args.data / "news"
    corpus = jsonl(src / "corpus.jsonl")
    by_id = {d["id"]: d for d in corpus}
    bm25 = bm25s.BM25()
    bm25.index(bm25s.tokenize([d["text"] for d in corpus], show_progress=False), show_progress=False)
    rng = random.Random(0)
    rows, needed = [], set()
    for q in jsonl(src / "queries.jsonl")[: args.news_limit]:
        own = q["id"].replace("news-q", "news-")
        hits, _ = bm25.retrieve(bm25s.tokenize([q["question"]], show_progress=False), k=6, show_progress=False)
        docs = [own] + [corpus[int(i)]["id"] for i in hits[0] if corpus[int(i)]["id"] != own][:4]
        rng.shuffle(docs)
        needed.update(docs)
        rows.append({"id": q["id"], "question": q["question"], "docs": docs})
    write_jsonl(args.work / "news-corpus.jsonl", [by_id[d] for d in sorted(needed)])
    return rows


def shared_news_queries(args, pool: int = 20) -> list[dict]:
    """News questions whose prompts share documents, as a batch over a popular set shares them:
    each question's own document and 4 drawn from `pool` other news documents by Zipf(2.1)
    popularity (lazyrag/workload.py), shuffled. In popular order many prompts start with the same
    documents, so whole shared chunks are recomputed once and read by the rest: reuse at work on
    real text."""
    from lazyrag.workload import PAPER, draw_docs

    src = args.data / "news"
    corpus = jsonl(src / "corpus.jsonl")
    questions = jsonl(src / "queries.jsonl")[: args.news_limit]
    own = [q["id"].replace("news-q", "news-") for q in questions]
    others = [d["id"] for d in corpus if d["id"] not in set(own)][:pool]
    rng = random.Random(0)
    draws = draw_docs(rng, replace(PAPER, docs=pool, per_prompt=4), len(questions), PAPER.alpha)
    rows = []
    for q, mine, drawn in zip(questions, own, draws):
        docs = [mine] + [others[int(d.removeprefix("doc"))] for d in drawn]
        rng.shuffle(docs)
        rows.append({"id": q["id"], "question": q["question"], "docs": docs})
    by_id = {d["id"]: d for d in corpus}
    write_jsonl(args.work / "news-shared-corpus.jsonl", [by_id[d] for d in sorted({d for r in rows for d in r["docs"]})])
    return rows


@dataclass
class Split:
    """Questions measured together: their requests and, on MuSiQue, the first gold answer's ids."""

    name: str
    title: str
    store: Store
    requests: list[Request]
    gold: list[list[int]] | None


def splits_of(corpus: str, queries: list[dict], loaded: LoadedModel, args, halves: bool) -> list[Split]:
    """The corpus indexed once, its questions as requests: MuSiQue with gold answers, in two
    halves (selection, report) or, with halves False, the reported half alone; news whole."""
    path = args.work / f"{corpus}.jsonl"
    write_jsonl(path, queries)
    page = f"-p{args.page_size}" if args.page_size != IndexConfig.page_size else ""  # its own store and figures
    store_path = args.work / f"{corpus}{page}.zarr"
    build_index(IndexConfig(corpus=args.work / f"{corpus}-corpus.jsonl", store=store_path, model=DEFAULT_MODEL,
                            device=args.device, page_size=args.page_size), progress=False, loaded=loaded)
    store = Store.open(store_path)
    fmt = PromptFormat(loaded.tokenizer)
    qs = list(read_queries(path, print))
    reqs = [Request(q.id, resolve_chunks(store, q, None, 5), fmt.question_ids(q.question), FORCED_TOKENS) for q in qs]
    pages = f", page size {args.page_size}" if page else ""
    if corpus == "news":
        return [Split(f"{corpus}-1-{len(reqs)}{page}", f"news, {len(reqs)} questions{pages}", store, reqs, None)]
    if corpus == "news-shared":
        return [Split(f"{corpus}-{len(reqs)}{page}", f"news, {len(reqs)} questions sharing popular documents{pages}",
                      store, reqs, None)]
    gold = [fmt.encode(q.answers[0]) for q in qs]  # the answer opens the assistant turn
    if corpus == "musique-select":
        return [Split(f"{corpus}-p{args.page_size}", f"MuSiQue questions 1-{len(reqs)} (selection), page size "
                      f"{args.page_size}", store, reqs, gold)]
    if not halves:
        return [Split(f"{corpus}-report{page}", f"MuSiQue questions 76-{75 + len(reqs)}{pages}", store, reqs, gold)]
    k = (len(reqs) + 1) // 2
    return [Split(f"{corpus}-select{page}", f"MuSiQue questions 1-{k} (selection){pages}", store, reqs[:k], gold[:k]),
            Split(f"{corpus}-report{page}", f"MuSiQue questions 76-{75 + len(reqs) - k}{pages}", store, reqs[k:],
                  gold[k:])]


# ---- measuring --------------------------------------------------------------------------------

class DenseFull:
    """Full attention over one prompt with a growing KV cache: the prompt is computed once and
    serves full's greedy answer and the gold answer's forcing (the engine's `full` computes it
    once per pass; on the CPU this is most of the script's time). Checked against the engine's
    `full` on the first questions (`reference_check` in the results)."""

    def __init__(self, loaded: LoadedModel):
        self.model, self.scale = loaded.model, loaded.cfg.head_dim ** -0.5
        self.keys: list[torch.Tensor | None] = [None] * loaded.cfg.num_layers
        self.values: list[torch.Tensor | None] = [None] * loaded.cfg.num_layers
        self.length = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = rope(q.float(), self.positions, self.model.inv_freq).to(q.dtype)
        prev_k, prev_v = self.keys[layer], self.values[layer]
        keys = k if prev_k is None else torch.cat([prev_k, k])
        values = v if prev_v is None else torch.cat([prev_v, v])
        if self.commit:
            self.keys[layer], self.values[layer] = keys, values
        qh, kh, vh = (x.float().transpose(0, 1)[None] for x in (q, keys, values))
        kwargs = {"is_causal": True} if prev_k is None else {
            "attn_mask": torch.arange(len(keys))[None, :] <= self.positions[:, None]}
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=True, **kwargs)
        return o[0].transpose(0, 1).to(q.dtype)

    def forward(self, ids: list[int], commit: bool) -> torch.Tensor:
        """Logits [len(ids), vocab] of `ids` fed after what is cached (kept if `commit`)."""
        self.positions = torch.arange(self.length, self.length + len(ids))
        self.commit = commit
        hidden = self.model(torch.tensor(ids, device=self.model.inv_freq.device), self.positions.to(
            self.model.inv_freq.device), self)
        if commit:
            self.length += len(ids)
        return self.model.logits(hidden).float().cpu()


def dense_reference(loaded: LoadedModel, prompt: list[int], gold: list[int] | None) -> dict:
    """full's greedy answer (FORCED_TOKENS at most, EOS stops), its logits along it, and the
    gold answer's mean log-probability per token."""
    dense = DenseFull(loaded)
    last = first = dense.forward(prompt, commit=True)[-1]
    forced, logits = [], []
    while len(forced) < FORCED_TOKENS:
        token = int(last.argmax())
        if token in loaded.eos_ids:
            break
        forced.append(token)
        logits.append(last)
        last = dense.forward([token], commit=True)[-1]
    ll = None
    if gold:
        cut = dense.length - len(forced)
        for i in range(len(dense.keys)):  # back to the prompt alone
            dense.keys[i], dense.values[i] = dense.keys[i][:cut], dense.values[i][:cut]
        dense.length = cut
        gold_logits = torch.cat([first[None], dense.forward(gold[:-1], commit=False)]) if len(gold) > 1 else first[None]
        ll = mean_logprob(gold_logits, gold)
    return {"forced": forced, "logits": torch.stack(logits) if logits else torch.zeros(0, loaded.cfg.vocab_size),
            "gold_loglik": ll}
def full_prompt(split: Split, request: Request) -> list[int]:
    """The prompt `full` computes: preamble, every chunk's tokens, the question."""
    return [*split.store.settings.preamble_ids, *(t for c in request.chunks for t in c.token_ids), *request.question_ids]


def reference(split: Split, loaded: LoadedModel, args) -> dict:
    """full's answers, logits along them and gold log-likelihoods, one cached file per question
    (safetensors: tensors and JSON, no pickle)."""
    folder = args.work / "results" / "full"
    folder.mkdir(parents=True, exist_ok=True)
    ref = {"forced": [], "answers": [], "logits": [], "gold": [], "seconds": 0.0}
    for i, req in enumerate(split.requests):
        path = folder / f"{req.id}.safetensors"
        if not path.exists():
            t = time.perf_counter()
            one = dense_reference(loaded, full_prompt(split, req), split.gold[i] if split.gold else None)
            meta = {"forced": one["forced"], "gold_loglik": one["gold_loglik"], "seconds": time.perf_counter() - t}
            save_file({"logits": one["logits"].contiguous()}, path, metadata={"json": json.dumps(meta)})
            print(f"full {req.id}: {meta['seconds']:.1f}s", flush=True)
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["json"])
            ref["logits"].append(f.get_tensor("logits"))
        ref["forced"].append(meta["forced"])
        ref["answers"].append(answer_text(loaded, meta["forced"]))
        ref["gold"].append(meta["gold_loglik"])
        ref["seconds"] += meta["seconds"]
    ref["gold_loglik"] = None if split.gold is None else sum(ref["gold"]) / len(ref["gold"])
    return ref


def check_reference(split: Split, ref: dict, loaded: LoadedModel, args, n: int = 2) -> dict:
    """The dense reference against the engine's `full` on the first n questions: the largest
    logit difference and KL along full's answer (both fp32 on the same ids)."""
    engine = FULL.engine(loaded, split.store, args)
    try:
        logits = engine.teacher_forced_logits(split.requests[:n], ref["forced"][:n])
    finally:
        engine.close()
    diff = max(float((a - b).abs().max()) for a, b in zip(ref["logits"][:n], logits) if len(a))
    kl = max(float(token_kl(a, b).max()) for a, b in zip(ref["logits"][:n], logits) if len(a))
    return {"questions": min(n, len(split.requests)), "max_abs_logit_diff": diff, "max_kl": kl}


def measure(cfg: Config, split: Split, ref: dict, loaded: LoadedModel, args) -> dict:
    """One configuration's figures on one split, cached per batch of questions."""
    folder = args.work / "results" / split.name / cfg.key
    folder.mkdir(parents=True, exist_ok=True)
    per_question: list[dict] = []
    engine = None
    try:
        for b in range(0, len(split.requests), args.batch_size):
            # named by the questions it holds: a longer run of the same split reuses whole batches
            path = folder / f"{b}-{min(b + args.batch_size, len(split.requests))}.json"
            if not path.exists():
                engine = engine or cfg.engine(loaded, split.store, args)
                path.write_text(json.dumps(measure_batch(cfg, engine, split, ref, loaded, b, args.batch_size)))
            per_question += json.loads(path.read_text())
    finally:
        if engine is not None:
            engine.close()
    kl = [k for q in per_question for k in q["kl"]]
    top1 = [t for q in per_question for t in q["top1"]]
    same = agreement({i: q["answer"] for i, q in enumerate(per_question)}, dict(enumerate(ref["answers"])))
    gold = [q["gold"] for q in per_question if q["gold"] is not None]
    fid = Fidelity(queries=len(per_question), identical=same["identical"], f1_to_full=same["f1_to_full"],
                   kl_mean=sum(kl) / len(kl) if kl else 0.0, top1_agreement=sum(top1) / len(top1) if top1 else 1.0,
                   tokens=len(kl))
    row = {**asdict(cfg), **fid.to_json(), "gold_loglik": sum(gold) / len(gold) if gold else None,
           "seconds": round(sum(q["seconds"] for q in per_question), 1),
           # per question, in the greedy pass (absent from batches measured before they were counted)
           "recomputed_tokens": round(sum(q.get("recomputed_tokens", 0) for q in per_question) / len(per_question), 1),
           "reused_tokens": round(sum(q.get("reused_tokens", 0) for q in per_question) / len(per_question), 1)}
    print(f"{split.name} {cfg.key}: KL {row['kl_mean']:.4f}, top-1 {row['top1_agreement']:.3f}, "
          f"identical {row['identical']:.3f}, gold {row['gold_loglik']}, recomputed / reused tokens "
          f"{row['recomputed_tokens']} / {row['reused_tokens']}, {row['seconds']}s", flush=True)
    return row


def measure_batch(cfg: Config, engine: Engine, split: Split, ref: dict, loaded: LoadedModel, b: int,
                  n: int) -> list[dict]:
    """Per question of split.requests[b:b + n]: KL and top-1 per forced token, the greedy answer,
    the gold log-likelihood, and the batch's seconds shared out."""
    t = time.perf_counter()
    reqs = cfg.prompts(split.requests)[b: b + n]  # the reference is full on the given order
    ids: dict[str, list[int]] = {}
    if cfg.primed:  # the same prompts with the next question of the batch: each request then takes its choice
        others = reqs[1:] + reqs[:1]
        engine.run([Request(f"prime-{r.id}", r.chunks, o.question_ids, 1) for r, o in zip(reqs, others)],
                   lambda seq: None)
    before = engine.cache.counters.recomputed_tokens, engine.cache.counters.reused_tokens
    engine.run(reqs, lambda seq: ids.__setitem__(seq.id, seq.generated))
    recomputed, reused = (after - b4 for after, b4 in zip((engine.cache.counters.recomputed_tokens,
                                                            engine.cache.counters.reused_tokens), before))
    logits = engine.teacher_forced_logits(reqs, ref["forced"][b: b + n])
    gold = engine.continuation_logprobs(reqs, split.gold[b: b + n]) if split.gold else [None] * len(reqs)
    seconds = (time.perf_counter() - t) / len(reqs)
    return [{"kl": token_kl(f, m).tolist(), "top1": top1_matches(f, m).tolist(), "answer": answer_text(loaded, ids[r.id]),
             "gold": g, "seconds": seconds, "recomputed_tokens": recomputed / len(reqs),
             "reused_tokens": reused / len(reqs)}  # in the greedy pass, shared out over the batch
            for r, f, m, g in zip(reqs, ref["logits"][b: b + n], logits, gold)]


def gap_closed(rows: list[dict], ref: dict) -> None:
    """Each row's share of the F=0 lazy-to-full gap closed, in KL and in gold log-likelihood."""
    base = next(r for r in rows if r["mode"] == LAZY.mode and r["fraction"] == 0 and not r["ape"])
    for r in rows:
        r["closed_kl"] = 1 - r["kl_mean"] / base["kl_mean"] if base["kl_mean"] > 0 else None
        gap = None if ref["gold_loglik"] is None else ref["gold_loglik"] - base["gold_loglik"]
        r["closed_loglik"] = (r["gold_loglik"] - base["gold_loglik"]) / gap if gap else None


def choose_default(rows: list[dict]) -> tuple[Config, str]:
    """The smallest F below 1 closing HALF of both gaps; else the one closing the most."""
    def config(r: dict) -> Config:
        return Config(r["mode"], r["fraction"], r["policy"])

    def worst(r: dict) -> float:
        return min(r["closed_kl"] or 0.0, r["closed_loglik"] if r["closed_loglik"] is not None else 1.0)

    candidates = [r for r in rows if r["mode"] == Mode.LAZY.value and 0 < r["fraction"] < 1 and not r["ape"]]
    good = [r for r in candidates if worst(r) >= HALF]
    if good:
        best = min(good, key=lambda r: (r["fraction"], -worst(r)))
        return config(best), (f"the smallest F closing at least half of both gaps "
                              f"({best['closed_kl']:.0%} of KL, {fmt_share(best['closed_loglik'])} of log-likelihood)")
    best = max(candidates, key=worst)
    return config(best), (f"no F below 1 closes half of both gaps; F={best['fraction']:g} closes the most "
                          f"({best['closed_kl']:.0%} of KL, {fmt_share(best['closed_loglik'])} of log-likelihood)")


# ---- report -----------------------------------------------------------------------------------

def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{round(x, 2) + 0.0:.0%}"  # + 0.0: no "-0%" from rounding noise


def table(split: dict) -> list[str]:
    gold = split["gold_loglik_full"] is not None
    head = ["mode", "F", "policy", "reuse, order", "APE (T, S)", "KL mean", "top-1 agreement", "identical",
            "F1 to full"]
    head += ["gold log-lik / token"] if gold else []
    head += ["gap closed: KL"] + (["gap closed: log-lik"] if gold else []) + ["seconds"]
    lines = [f"### {split['title']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full = ["full", "", "", "given", "", "0", "1.000", "100.0%", "1.000"] + ([f"{split['gold_loglik_full']:.3f}"] if gold else [])
    full += ["", ""] if gold else [""]
    lines.append("| " + " | ".join(full + [f"{split['seconds_full']:.0f}"]) + " |")
    for r in split["rows"]:
        ape = f"{r['ape'][0]:g}, {r['ape'][1]:g}" if r["ape"] else "off"
        reuse = ("reuse" if r.get("reuse") else "no reuse") + ", " + r.get("order", "given")
        reuse += ", primed" if r.get("primed") else ""
        cells = [r["mode"], f"{r['fraction']:g}", r["policy"], reuse, ape, f"{r['kl_mean']:.4f}",
                 f"{r['top1_agreement']:.3f}",
                 f"{r['identical']:.1%}", f"{r['f1_to_full']:.3f}"]
        cells += [f"{r['gold_loglik']:.3f}"] if gold else []
        cells += [fmt_share(r["closed_kl"])] + ([fmt_share(r["closed_loglik"])] if gold else [])
        lines.append("| " + " | ".join(cells + [f"{r['seconds']:.0f}"]) + " |")
    return lines + [""]


def header(args, loaded: LoadedModel) -> dict:
    dtypes = f"computing in {str(loaded.dtype).removeprefix('torch.')}, {str(loaded.kv_dtype).removeprefix('torch.')} KV"
    return {"command": "python scripts/eval_quality.py " + shlex.join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "model": f"{DEFAULT_MODEL} (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised)",
            "device": f"{args.device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), {dtypes}",
            # bm25s picks the news questions' neighbour documents: another version, other prompts
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "bm25s": importlib.metadata.version("bm25s")},
            "forced_tokens": FORCED_TOKENS, "batch_size": args.batch_size, "page_size": args.page_size,
            "policies": policies(),
            "ape": list(APE) if engine_has_ape() else None}


def report(res: dict) -> str:
    h = res["header"]
    lines = ["# Quality of selective recompute and APE against full", "",
             f"`{h['command']}`", "",
             f"{h['date']}; model {h['model']}; device {h['device']}; torch {h['versions']['torch']}, "
             f"transformers {h['versions']['transformers']}; greedy, {h['forced_tokens']} new tokens at most; "
             f"batch {h['batch_size']}.", ""]
    for name, n in res.get("held_out", {}).items():
        lines += [f"The {name} split measured again: `{n['command']}`, {n['date']}, device {n['device']}.", ""]
    if "default" in res:
        d = res["default"]
        lines += [f"Default chosen on the selection questions: F={d['fraction']:g}, policy {d['policy']}: {d['why']}.", ""]
    for split in res["splits"].values():
        lines += table(split)
    lines += ["KL: mean KL(full || mode) per token in nats along full's answer (teacher forcing); top-1 agreement: "
              "share of those tokens where the argmax is full's; identical / F1 to full: the configuration's own "
              "greedy answer against full's (SQuAD-normalised); gold log-lik: mean log-probability per token of the "
              "first gold answer; gap closed: share of the lazy F=0 to full gap closed; seconds: wall time of the "
              "configuration's passes over the split (greedy, forced along full's answer, and on MuSiQue forced "
              "along the gold answer).", ""]
    return "\n".join(lines)


def run_split(split: Split, configs: list[Config], loaded: LoadedModel, args, res: dict) -> list[dict]:
    ref = reference(split, loaded, args)
    rows = [measure(c, split, ref, loaded, args) for c in configs]
    gap_closed(rows, ref)
    res["splits"][split.name] = {"title": f"{split.title}", "questions": len(split.requests),
                                 "gold_loglik_full": ref["gold_loglik"], "seconds_full": round(ref["seconds"], 1),
                                 "rows": rows}
    save(res)
    return rows


def save(res: dict) -> None:
    order = ["musique-select", "musique-report", "news-1-", "news-shared"]  # selection, then the reported splits
    res["splits"] = dict(sorted(res["splits"].items(), key=lambda kv: next(
        (i for i, name in enumerate(order) if kv[0].startswith(name)), len(order))))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quality-recompute.json").write_text(json.dumps(res, indent=1))
    (RESULTS / "quality-recompute.md").write_text(report(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lazyrag-quality"), help="stores and figures (resumable)")
    ap.add_argument("--per-split", type=int, default=75, help="MuSiQue questions measured in each half")
    ap.add_argument("--news-limit", type=int, default=40)
    ap.add_argument("--grid", default="0.05,0.1,0.2,0.3", help="recompute points, policy:F or F for every "
                    "policy (comma-separated)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--cache-gb", type=float, default=5.0, help="page pool: 16 MuSiQue prompts of fp32 KV need ~5 GB")
    ap.add_argument("--lean", action="store_true", help="on the reported questions lazy alone, at F=0 and "
                    "the default (block and APE are measured on the selection questions): for a slow CPU")
    ap.add_argument("--held-out", choices=["news", "musique", "news-shared", "musique-select"],
                    help="only this split (news, news-shared: news questions over shared popular documents, "
                    "musique: MuSiQue 76-150, or musique-select: the selection questions 1-75 at --page-size, to "
                    "try a setting before it is reported), lazy at F=0 and at the default already chosen in "
                    "docs/results/quality-recompute.json, whose other tables are kept: more questions without "
                    "choosing the default again")
    ap.add_argument("--page-size", type=int, default=IndexConfig.page_size, choices=PAGE_SIZES,
                    help="the stores' page size, the unit recompute selects (its own stores and figures in --work)")
    ap.add_argument("--configs", help="with --held-out: measure lazy at F=0 and these configurations instead of "
                    "the default alone: policy:F[:reuse][:popular][:primed], comma-separated (reuse: recomputed "
                    "pages reused across the split's requests; popular: --chunk-order popular; primed: every "
                    "prompt first recomputed for another question, whose choice it then reuses)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    points = parse_grid(args.grid)

    loaded = load_model(DEFAULT_MODEL, args.device)
    if args.held_out:
        res = json.loads((RESULTS / "quality-recompute.json").read_text())
        name = {"news": "news-1-", "news-shared": "news-shared", "musique": "musique-report",
                "musique-select": f"musique-select-p{args.page_size}"}[args.held_out]
        res.setdefault("held_out", {})[name if args.held_out == "musique-select" else args.held_out] = header(args, loaded)
        res["splits"] = {k: v for k, v in res["splits"].items() if not k.startswith(name)}  # replaced, not kept
        queries = {"news": news_queries, "news-shared": shared_news_queries,
                   "musique-select": lambda a: musique_queries(a, report=False)}.get(
            args.held_out, lambda a: musique_queries(a, selection=False))(args)
        (split,) = splits_of(args.held_out, queries, loaded, args, halves=False)
        d = res["default"]
        configs = [LAZY, *parse_configs(args.configs)] if args.configs else at_default(
            Config(Mode.LAZY.value, d["fraction"], d["policy"]), lean=True)
        run_split(split, configs, loaded, args, res)
        print(report(res))
        return
    res = {"header": header(args, loaded), "splits": {}}
    select, report_musique = splits_of("musique", musique_queries(args), loaded, args, halves=True)
    check = args.work / "results" / "reference-check.json"
    if not check.exists():
        check.write_text(json.dumps(check_reference(select, reference(select, loaded, args), loaded, args)))
    res["reference_check"] = json.loads(check.read_text())
    default, why = choose_default(run_split(select, grid(points), loaded, args, res))
    res["default"] = {"fraction": default.fraction, "policy": default.policy, "why": why}
    reported = at_default(default, args.lean)
    run_split(select, list(dict.fromkeys(grid(points) + reported)), loaded, args, res)  # grid rows are cached
    (news,) = splits_of("news", news_queries(args), loaded, args, halves=False)
    for split in (report_musique, news):
        run_split(split, reported, loaded, args, res)
    print(report(res))


if __name__ == "__main__":
    main()
