#!/usr/bin/env python
"""Compare answer files of the same queries in several modes (one table, or --json).

Per file: answers, accuracy / EM / F1 (from each line's `score`, where the queries had gold
answers), the chunk hit ratio (from each line's `cache`), and agreement with the first file
(usually `full`): identical answers after normalisation and token F1 between them.

Usage: python scripts/compare_answers.py answers-full.jsonl answers-lazy.jsonl answers-block.jsonl [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lazyrag.eval import scoring


def load(path: Path) -> dict[str, dict]:
    rows = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            sys.exit(f"{path}:{n}: not JSON ({exc.msg})")
        if "answer" in row:  # error lines (bad query, unknown doc) carry no answer
            rows[row["id"]] = row
    return rows


def summary(rows: dict[str, dict], reference: dict[str, dict]) -> dict:
    scored = [r["score"] for r in rows.values() if r.get("score")]
    hits = sum(r["cache"]["hits"] for r in rows.values())
    misses = sum(r["cache"]["misses"] for r in rows.values())
    out = {"answers": len(rows),
           "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else None}
    for key in ("accuracy", "em", "f1"):
        out[key] = round(sum(s[key] for s in scored) / len(scored), 4) if scored else None
    out["agreement"] = scoring.agreement({i: r["answer"] for i, r in rows.items()},
                                         {i: r["answer"] for i, r in reference.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help="answer files; the first is the reference")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    files = [load(p) for p in args.files]
    result = {str(p): summary(rows, files[0]) for p, rows in zip(args.files, files)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("| file | answers | accuracy | EM | F1 | hit ratio | identical to first | F1 to first |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    for name, r in result.items():
        a = r["agreement"]
        print(f"| {Path(name).name} | {r['answers']} | {fmt(r['accuracy'])} | {fmt(r['em'])} | {fmt(r['f1'])} | "
              f"{fmt(r['hit_ratio'])} | {fmt(a['identical'])} | {fmt(a['f1_to_full'])} |")


if __name__ == "__main__":
    main()
