"""Answer scoring (SQuAD conventions), agreement between modes, and compare_answers.py."""
import json
import subprocess
import sys
from pathlib import Path

from lazyrag.eval import scoring

ROOT = Path(__file__).resolve().parents[2]


def test_score_follows_squad_normalisation():
    s = scoring.score("The answer is: Exeter College, Oxford.", ["exeter college"])
    assert s["accuracy"] == 1.0 and s["em"] == 0.0 and 0 < s["f1"] < 1
    assert scoring.score("An Exeter college!", ["Exeter College"])["em"] == 1.0
    assert scoring.score("Cambridge", ["Exeter College"]) == {"accuracy": 0.0, "em": 0.0, "f1": 0.0}
    assert scoring.score("anything", ["", "  "]) == {"accuracy": 0.0, "em": 0.0, "f1": 0.0}


def test_agreement_counts_only_shared_ids():
    ref = {"a": "Paris", "b": "the river Thames", "c": "1999"}
    got = {"a": "paris.", "b": "Thames", "x": "ignored"}
    a = scoring.agreement(got, ref)
    assert a["n"] == 2 and a["identical"] == 0.5
    assert abs(a["f1_to_full"] - (1.0 + 2 * 1 * 0.5 / 1.5) / 2) < 1e-4
    assert scoring.agreement({}, ref)["n"] == 0


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_answers_script(tmp_path):
    def row(i, answer, hits, misses, acc):
        return {"id": i, "answer": answer, "cache": {"hits": hits, "misses": misses},
                "score": {"accuracy": acc, "em": 0.0, "f1": acc}}
    full = _write(tmp_path / "full.jsonl", [row("q1", "Paris", 0, 0, 1.0), row("q2", "Rome", 0, 0, 0.0)])
    lazy = _write(tmp_path / "lazy.jsonl", [row("q1", "Paris", 3, 1, 1.0), row("q2", "Milan", 1, 3, 0.0),
                                            {"id": "q3", "error": "unknown doc"}])
    out = subprocess.run([sys.executable, str(ROOT / "scripts/compare_answers.py"), str(full), str(lazy), "--json"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)[str(lazy)]
    assert r["answers"] == 2 and r["hit_ratio"] == 0.5 and r["accuracy"] == 0.5
    assert r["agreement"]["identical"] == 0.5
    bad = _write(tmp_path / "bad.jsonl", [row("q1", "Paris", 0, 0, 1.0)])
    bad.write_text(bad.read_text() + "{not json\n")
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compare_answers.py"), str(full), str(bad)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and f"{bad}:2" in res.stderr


def test_summarize_gives_mean_and_percentiles():
    s = scoring.summarize([float(v) for v in range(1, 101)])
    assert s == {"mean": 50.5, "p50": 50.5, "p95": 95.05}
    assert scoring.summarize([]) == {"mean": None, "p50": None, "p95": None}
