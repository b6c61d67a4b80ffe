"""The LazyAttention paper's workload, seeded: documents of random words, and queries that each
name `per_prompt` documents drawn by Zipf(alpha) popularity (or uniform), in random order.

`lazyrag bench --synthetic` writes it as a corpus and a queries file; scripts/bench_e2e.py and
scripts/bench_parallel.py build their workloads from it. Text is plain lower-case words, one
token per byte for the random:* models, so `doc_tokens` characters are that many tokens there.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    docs: int = 100            # documents in the corpus
    doc_tokens: int = 2048     # characters per document (tokens, for random:* models)
    per_prompt: int = 5        # documents each query names
    question_tokens: int = 32  # characters per question
    new_tokens: int = 16       # answer tokens the paper generates
    alpha: float | None = 2.1  # Zipf exponent of document popularity; None: uniform

    def uniform(self) -> Workload:
        return replace(self, alpha=None)


PAPER = Workload()
SYNTHETIC = {"paper": PAPER, "uniform": PAPER.uniform()}  # `bench --synthetic NAME`


def words(rng: random.Random, n_chars: int) -> str:
    """Plain lower-case text of exactly n_chars bytes."""
    out = []
    while sum(map(len, out)) < n_chars:
        out.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) + " ")
    return "".join(out)[:n_chars]


def doc_id(i: int) -> str:
    return f"doc{i:03d}"


def documents(w: Workload, seed: int = 0) -> list[dict]:
    """The corpus: `{"id", "text"}` per document."""
    rng = random.Random(seed)
    return [{"id": doc_id(i), "text": words(rng, w.doc_tokens)} for i in range(w.docs)]


def draw_docs(rng: random.Random, w: Workload, n: int, alpha: float | None = None) -> list[list[str]]:
    """n prompts' document ids: per_prompt distinct documents each, drawn with popularity
    1 / (rank + 1)^alpha (uniform when alpha is None), in random order."""
    weights = [1.0] * w.docs if alpha is None else [1.0 / (k + 1) ** alpha for k in range(w.docs)]
    prompts = []
    for _ in range(n):
        chosen: list[int] = []
        while len(chosen) < min(w.per_prompt, w.docs):
            d = rng.choices(range(w.docs), weights)[0]
            if d not in chosen:
                chosen.append(d)
        rng.shuffle(chosen)
        prompts.append([doc_id(d) for d in chosen])
    return prompts


def queries(w: Workload, n: int, seed: int = 1) -> list[dict]:
    """n queries `{"id", "question", "docs"}`: a question of random words, documents by w.alpha."""
    rng = random.Random(seed)
    prompts = draw_docs(rng, w, n, w.alpha)
    return [{"id": f"q{i:05d}", "question": words(rng, w.question_tokens), "docs": docs}
            for i, docs in enumerate(prompts)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
