#!/usr/bin/env python
"""Quality of a store of one KV dtype against a store of another, on MuSiQue questions (CPU).

The same corpus is indexed twice with the same model: with `--against` (the reference; default
`auto`, bf16) and with `--kv-dtype` (default fp8). The reference store answers each question
greedily in lazy mode (lazyrag.eval.fidelity.FORCED_TOKENS new tokens at most, EOS stops); the
other store is then teacher-forced along that answer (mean KL(reference || other) per token,
top-1 agreement), answers greedily itself (identical answers, token F1 between the two), and
both stores are teacher-forced along the first gold answer (mean log-likelihood per token).
Each mode in --modes is measured the same way against the reference store in that mode. Both
stores run with --recompute F (default 0: the KV dtype's effect alone; `answer`'s default share,
0.1, costs about 30x the time on the CPU), with `answer`'s recompute policy.

Writes docs/results/quality-<kv-dtype>.json and .md (quality-<kv-dtype>-vs-<against> when
--against is not auto).

Usage: python scripts/eval_kv_dtype.py [--kv-dtype fp8] [--against auto] [--data ../shared/data] [--questions 50]
       [--modes lazy,block] [--recompute F]
  e.g. python scripts/eval_kv_dtype.py --kv-dtype bf16 --against fp32 --questions 10   (the default against fp32)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

from lazyrag.commands.audit import answer_text
from lazyrag.commands.index import build_index
from lazyrag.commands.queries import read_queries, resolve_chunks
from lazyrag.config import DEFAULT_MODEL, AnswerConfig, IndexConfig
from lazyrag.eval.fidelity import FORCED_TOKENS, token_kl, top1_matches
from lazyrag.eval.scoring import agreement
from lazyrag.models import LoadedModel, load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, Request
from lazyrag.store import Store

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def musique(args) -> tuple[Path, Path]:
    """The first --questions MuSiQue questions (file order) and the paragraphs they name."""
    src = args.data / "musique"
    queries = jsonl(src / "queries.jsonl")[: args.questions]
    needed = {d for q in queries for d in q["docs"]}
    corpus, qpath = args.work / "corpus.jsonl", args.work / "queries.jsonl"
    write_jsonl(corpus, [d for d in jsonl(src / "corpus.jsonl") if d["id"] in needed])
    write_jsonl(qpath, queries)
    return corpus, qpath


class Side:
    """One store (one KV dtype) with its model, requests and gold answers."""

    def __init__(self, dtype: str, corpus: Path, queries: Path, args):
        self.dtype = dtype
        self.loaded: LoadedModel = load_model(args.model, args.device, dtype)
        path = args.work / f"{dtype}.zarr"
        build_index(IndexConfig(corpus=corpus, store=path, model=args.model, device=args.device, dtype=dtype),
                    progress=False, loaded=self.loaded)
        self.store = Store.open(path)
        fmt = PromptFormat(self.loaded.tokenizer)
        qs = list(read_queries(queries, print))
        self.requests = [Request(q.id, resolve_chunks(self.store, q, None, 5), fmt.question_ids(q.question),
                                 FORCED_TOKENS) for q in qs]
        self.gold = [fmt.encode(q.answers[0]) for q in qs]  # the answer opens the assistant turn

    def engine(self, mode: str, args) -> Engine:
        cfg = AnswerConfig(queries=Path("-"), mode=mode)
        return Engine(self.loaded, self.store, mode, args.cache_gb * 2**30, args.batch_size,
                      recompute=Recompute(args.recompute, cfg.recompute_policy, cfg.recompute_layer))


def run(side: Side, mode: str, forced: list[list[int]] | None, args) -> dict:
    """Greedy answers, logits teacher-forced along `forced` (default: the greedy answers) and
    gold log-likelihoods of one store in one mode, batch by batch."""
    t = time.perf_counter()
    engine = side.engine(mode, args)
    out = {"answers": {}, "ids": {}, "logits": [], "gold": []}
    try:
        for b in range(0, len(side.requests), args.batch_size):
            reqs = side.requests[b: b + args.batch_size]
            engine.run(reqs, lambda seq: out["ids"].__setitem__(seq.id, seq.generated))
            along = [out["ids"][r.id] for r in reqs] if forced is None else forced[b: b + args.batch_size]
            out["logits"] += engine.teacher_forced_logits(reqs, along)
            out["gold"] += engine.continuation_logprobs(reqs, side.gold[b: b + args.batch_size])
            print(f"{side.dtype} {mode}: {b + len(reqs)}/{len(side.requests)}", flush=True)
    finally:
        engine.close()
    out["answers"] = {r.id: answer_text(side.loaded, out["ids"][r.id]) for r in side.requests}
    out["seconds"] = time.perf_counter() - t
    return out


def compare(mode: str, ref: dict, other: dict, forced: list[list[int]]) -> dict:
    kl = torch.cat([token_kl(a, b) for a, b in zip(ref["logits"], other["logits"]) if len(a)])
    top1 = torch.cat([top1_matches(a, b) for a, b in zip(ref["logits"], other["logits"]) if len(a)])
    same = agreement(other["answers"], ref["answers"])
    return {"mode": mode, "questions": len(forced), "tokens": int(kl.numel()), "kl_mean": float(kl.mean()),
            "top1_agreement": float(top1.float().mean()), "identical": same["identical"],
            "f1_between": same["f1_to_full"], "gold_loglik_reference": sum(ref["gold"]) / len(ref["gold"]),
            "gold_loglik_other": sum(other["gold"]) / len(other["gold"]),
            "seconds": {"reference": round(ref["seconds"], 1), "other": round(other["seconds"], 1)}}


def report(res: dict) -> str:
    h = res["header"]
    ref, other = h["against"], h["kv_dtype"]
    rb = h["row_bytes"]

    def label(d: str) -> str:
        return f"{d} ({h['stored'][d]})" if d == "auto" else d

    lines = [f"# {other} KV against {ref} KV", "", f"`{h['command']}`", "",
             f"{h['date']}; model {h['model']}; device {h['device']}; torch {h['torch']}; lazyrag {h['lazyrag']}; "
             f"{h['questions']} MuSiQue questions (file order), each over the 10 paragraphs it names; greedy, "
             f"{h['forced_tokens']} new tokens at most; recompute {h['recompute']}.", "",
             f"Store bytes per token: {label(ref)} {rb[ref]:,}, {label(other)} {rb[other]:,} "
             f"({rb[other] / rb[ref]:.1%}; {rb[other] / rb['bf16']:.1%} of bf16's {rb['bf16']:,}).", "",
             f"| mode | KL mean | top-1 agreement | identical answers | F1 between answers | gold log-lik / token "
             f"({ref}) | gold log-lik / token ({other}) | seconds ({ref} / {other}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['mode']} | {r['kl_mean']:.3g} | {r['top1_agreement']:.3f} | {r['identical']:.1%} | "
                     f"{r['f1_between']:.3f} | {r['gold_loglik_reference']:.3f} | {r['gold_loglik_other']:.3f} | "
                     f"{r['seconds']['reference']:.0f} / {r['seconds']['other']:.0f} |")
    lines += ["", f"KL: mean KL({ref} || {other}) per token in nats, teacher-forced along the {ref} store's greedy "
              f"answer in that mode; top-1 agreement: share of those tokens where the {other} store's argmax is the "
              f"{ref} store's; identical / F1: the two stores' own greedy answers (SQuAD-normalised); gold log-lik: "
              "mean log-probability per token of the first gold answer.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default="fp8", help="the store measured (index --kv-dtype)")
    ap.add_argument("--against", default="auto", help="the reference store's --kv-dtype")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lazyrag-kv-dtype"), help="the two stores")
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--modes", default="lazy", help="comma-separated: lazy, block")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recompute", type=float, default=0.0, help="share of chunk pages recomputed (answer --recompute)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--cache-gb", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the .json and .md go")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus, queries = musique(args)
    if args.kv_dtype == args.against:
        ap.error("--kv-dtype and --against name the same dtype")
    reference, other = (Side(d, corpus, queries, args) for d in (args.against, args.kv_dtype))
    rows = []
    for mode in args.modes.split(","):
        ref = run(reference, mode, None, args)
        forced = [ref["ids"][r.id] for r in reference.requests]
        rows.append(compare(mode, ref, run(other, mode, forced, args), forced))
        print(json.dumps(rows[-1]), flush=True)
    cfg = AnswerConfig(queries=Path("-"))
    res = {"header": {"command": "python scripts/eval_kv_dtype.py " + shlex.join(sys.argv[1:]),
                      "date": time.strftime("%Y-%m-%d"), "model": args.model, "questions": len(reference.requests),
                      "kv_dtype": args.kv_dtype, "against": args.against,
                      "stored": {s.dtype: s.store.settings.kv_dtype for s in (reference, other)},
                      "device": f"{args.device} ({platform.processor() or platform.machine()}, "
                                f"{torch.get_num_threads()} threads), computing in "
                                f"{str(reference.loaded.dtype).removeprefix('torch.')}",
                      "torch": torch.__version__, "lazyrag": version("lazyrag"), "forced_tokens": FORCED_TOKENS,
                      "recompute": f"{args.recompute:g}" + (f" ({cfg.recompute_policy})" if args.recompute else ""),
                      "row_bytes": {**{s.dtype: s.store.settings.row_bytes for s in (reference, other)},
                                    "bf16": dataclasses.replace(other.store.settings, kv_dtype="bfloat16").row_bytes}},
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"quality-{args.kv_dtype}" + ("" if args.against == "auto" else f"-vs-{args.against}")
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{stem}.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
