#!/usr/bin/env python
"""Quality of lazy and block against full, on real questions (CPU is fine).

MuSiQue (gold answers): accuracy (normalised gold contained in the answer), EM, token F1,
and the mean per-token log-likelihood of the gold answer under teacher forcing, per mode;
plus the fidelity of lazy and block to full (identical greedy answers, token F1 between
them). News (no gold): fidelity only; each question gets its own document (same number)
plus 4 BM25 neighbours from the whole corpus, shuffled.

Both go through the real index and answer paths. Writes docs/results/quality-eval.md (the
tables docs/quality.md quotes) and docs/results/quality-eval.json. --musique-limit /
--news-limit keep the CPU time reasonable.

Usage: python scripts/eval_quality.py --data ../shared/data [--musique-limit 50] [--news-limit 25]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from lazyrag.eval import scoring as metrics
from lazyrag.commands.answer import answer_file
from lazyrag.commands.queries import read_queries, resolve_chunks
from lazyrag.config import AnswerConfig, IndexConfig
from lazyrag.serve import Engine, Request
from lazyrag.commands.index import build_index
from lazyrag.models import load_model
from lazyrag.models.prompt import PromptFormat
from lazyrag.store import Store

MODES = ("full", "lazy", "block")
ROOT = Path(__file__).resolve().parent.parent


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_modes(work: Path, store: Path, queries: Path, args) -> dict[str, dict[str, dict]]:
    """Each mode's answers to exactly these queries (an answers file may hold more: resumable)."""
    ids = {q["id"] for q in jsonl(queries)}
    answers = {}
    for mode in MODES:
        out = work / f"answers-{queries.stem}-{mode}.jsonl"
        t = time.perf_counter()
        answer_file(AnswerConfig(queries=queries, store=store, out=out, mode=mode, device=args.device,
                                 max_new_tokens=args.max_new_tokens, cache_gb=args.cache_gb,
                                 batch_size=args.batch_size), report=print, progress=False)
        answers[mode] = {r["id"]: r for r in jsonl(out) if "answer" in r and r["id"] in ids}
        print(f"{queries.stem} {mode}: {len(answers[mode])} answers in {time.perf_counter() - t:.0f}s", flush=True)
    return answers


def fidelity(answers: dict, mode: str) -> dict:
    text = {m: {i: r["answer"] for i, r in rows.items()} for m, rows in answers.items()}
    return metrics.agreement(text[mode], text["full"])


def gold_loglik(store_path: Path, queries: Path, args) -> dict[str, float]:
    store = Store.open(store_path)
    loaded = load_model(store.settings.model, args.device, store.settings.kv_dtype)
    fmt = PromptFormat(loaded.tokenizer)
    qs = list(read_queries(queries, print))
    conts = [fmt.encode(q.answers[0]) for q in qs]  # the answer opens the assistant turn: no space
    result = {}
    for mode in MODES:
        engine = Engine(loaded, store, mode, args.cache_gb * 2**30, args.batch_size)
        reqs = [Request(q.id, resolve_chunks(store, q, None, 5), fmt.question_ids(q.question), 1) for q in qs]
        lps = engine.continuation_logprobs(reqs, conts)
        engine.close()
        result[mode] = round(sum(lps) / len(lps), 4)
    return result


def musique(args, work: Path) -> dict:
    src = args.data / "musique"
    queries = jsonl(src / "queries.jsonl")[: args.musique_limit]
    needed = {d for q in queries for d in q["docs"]}
    write_jsonl(work / "musique-corpus.jsonl", [d for d in jsonl(src / "corpus.jsonl") if d["id"] in needed])
    write_jsonl(work / "musique.jsonl", queries)
    store = work / "musique.zarr"
    build_index(IndexConfig(corpus=work / "musique-corpus.jsonl", store=store, device=args.device), progress=True)
    answers = run_modes(work, store, work / "musique.jsonl", args)
    rows = {}
    for mode in MODES:
        scored = [r["score"] for r in answers[mode].values()]
        rows[mode] = {k: round(sum(s[k] for s in scored) / len(scored), 4) for k in ("accuracy", "em", "f1")}
        rows[mode]["n"] = len(scored)
    ll = {} if args.skip_loglik else gold_loglik(store, work / "musique.jsonl", args)
    for mode in MODES:
        rows[mode]["gold_loglik"] = ll.get(mode)
        if mode != "full":
            rows[mode]["fidelity"] = fidelity(answers, mode)
    return rows


def news(args, work: Path) -> dict:
    import bm25s

    src = args.data / "news"
    corpus = jsonl(src / "corpus.jsonl")
    by_id = {d["id"]: d for d in corpus}
    queries = jsonl(src / "queries.jsonl")[: args.news_limit]
    bm25 = bm25s.BM25()
    bm25.index(bm25s.tokenize([d["text"] for d in corpus], show_progress=False), show_progress=False)
    rng = random.Random(0)
    rows, needed = [], set()
    for q in queries:
        own = q["id"].replace("news-q", "news-")
        hits, _ = bm25.retrieve(bm25s.tokenize([q["question"]], show_progress=False), k=6, show_progress=False)
        neighbours = [corpus[int(i)]["id"] for i in hits[0] if corpus[int(i)]["id"] != own][:4]
        docs = [own] + neighbours
        rng.shuffle(docs)
        needed.update(docs)
        rows.append({"id": q["id"], "question": q["question"], "docs": docs})
    write_jsonl(work / "news-corpus.jsonl", [by_id[d] for d in sorted(needed)])
    write_jsonl(work / "news.jsonl", rows)
    store = work / "news.zarr"
    build_index(IndexConfig(corpus=work / "news-corpus.jsonl", store=store, device=args.device), progress=True)
    answers = run_modes(work, store, work / "news.jsonl", args)
    return {mode: fidelity(answers, mode) for mode in ("lazy", "block")}


def report(res: dict, args) -> str:
    m = res["musique"]
    lines = [
        "# Quality: lazy and block against full", "",
        f"Date {time.strftime('%Y-%m-%d')}; model smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised), "
        f"CPU fp32, greedy, {args.max_new_tokens} new tokens at most. Command: `python scripts/eval_quality.py "
        f"--data {args.data} --musique-limit {args.musique_limit} --news-limit {args.news_limit}`.", "",
        f"## MuSiQue ({m['full']['n']} questions, 10 paragraphs each in the given retrieval order)", "",
        "| mode | accuracy | EM | F1 | gold log-likelihood / token | identical to full | F1 to full |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = m[mode]
        fid = r.get("fidelity", {})
        ll = "not run" if r["gold_loglik"] is None else f"{r['gold_loglik']:.3f}"
        lines.append(f"| {mode} | {r['accuracy']:.1%} | {r['em']:.1%} | {r['f1']:.3f} | {ll} | "
                     f"{fid.get('identical', 1):.1%} | {fid.get('f1_to_full', 1):.3f} |")
    if "news" in res:
        n = res["news"]
        lines += ["", f"## News ({n['lazy']['n']} questions, own document + 4 BM25 neighbours, shuffled; no gold)",
                  "", "| mode | identical to full | F1 to full |", "|---|---|---|"]
        for mode in ("lazy", "block"):
            lines.append(f"| {mode} | {n[mode]['identical']:.1%} | {n[mode]['f1_to_full']:.3f} |")
    lines += ["", "Accuracy: the SQuAD-normalised gold answer is contained in the normalised answer; EM and F1 as "
              "in SQuAD, best over the gold answers. Gold log-likelihood: mean log-probability per token of the "
              "first gold answer after the prompt (teacher forcing); higher is better.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lazyrag-quality"), help="stores and answers (resumable)")
    ap.add_argument("--musique-limit", type=int, default=50)
    ap.add_argument("--news-limit", type=int, default=25)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--cache-gb", type=float, default=2.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-news", action="store_true")
    ap.add_argument("--skip-loglik", action="store_true", help="full mode re-reads every prompt: the slow part")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    res = {"musique": musique(args, args.work)}
    if not args.skip_news:
        res["news"] = news(args, args.work)
    (ROOT / "docs" / "results" / "quality-eval.json").write_text(json.dumps(res, indent=1))
    text = report(res, args)
    (ROOT / "docs" / "results" / "quality-eval.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
