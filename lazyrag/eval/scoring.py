"""Answer scoring (SQuAD conventions) and latency summaries."""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lower-case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def score(prediction: str, golds: list[str]) -> dict:
    """accuracy: a normalised gold is contained in the normalised prediction (the peers'
    'substring EM'); em: equal after normalisation; f1: token F1. Best over golds."""
    pred = normalize(prediction)
    golds = [g for g in golds if normalize(g)]
    if not golds:
        return {"accuracy": 0.0, "em": 0.0, "f1": 0.0}
    return {
        "accuracy": float(any(normalize(g) in pred for g in golds)),
        "em": float(any(normalize(g) == pred for g in golds)),
        "f1": max(token_f1(prediction, g) for g in golds),
    }


def agreement(answers: dict[str, str], reference: dict[str, str]) -> dict:
    """How close one mode's answers are to a reference mode's (usually `full`) on the ids both
    have: the share of identical answers after normalisation, and the mean token F1 between them."""
    ids = [i for i in reference if i in answers]
    if not ids:
        return {"identical": None, "f1_to_full": None, "n": 0}
    same = sum(normalize(answers[i]) == normalize(reference[i]) for i in ids)
    f1 = sum(token_f1(answers[i], reference[i]) for i in ids)
    return {"identical": round(same / len(ids), 4), "f1_to_full": round(f1 / len(ids), 4), "n": len(ids)}


def summarize(values: list[float]) -> dict:
    """mean, p50, p95 (None when there are no values)."""
    if not values:
        return {"mean": None, "p50": None, "p95": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": round(float(a.mean()), 3), "p50": round(float(np.percentile(a, 50)), 3),
            "p95": round(float(np.percentile(a, 95)), 3)}
