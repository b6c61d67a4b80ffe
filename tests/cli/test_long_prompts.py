"""A 12,000-word question beside a short one (random:tiny on the CPU): the short one is answered,
the long one refused in the errors file with what to change, before it is attempted, and the
run's peak memory stays small (the page pool is mapped as it fills, not --cache-gb up front)."""

import json
import subprocess
import sys

import pytest
from cli_tools import TINY, answer, cli, rows, write_jsonl

import lazyrag.commands.answer_engine as answer_engine

LONG = " ".join(["word"] * 12_000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long")
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Alpha is the first letter.\n\nBeta is the second letter.")
    (corpus / "b.txt").write_text("Gamma is the third letter.")
    res = cli("index", corpus, "--store", tmp / "r.zarr", *TINY, "-q")
    assert res.exit_code == 0, res.output
    return tmp / "r.zarr"


def queries(tmp_path):
    return write_jsonl(tmp_path / "q.jsonl", {"id": "long", "question": LONG},
                       {"id": "short", "question": "What is alpha?", "docs": ["a.txt"]})


def errors(out):
    return {e["id"]: e for e in map(json.loads, out.with_name(out.stem + ".errors.jsonl").read_text().splitlines())}


def answer_in_a_child(*args) -> tuple[subprocess.CompletedProcess, int]:
    """`lazyrag answer ARGS` in a process of its own, and its peak RSS in bytes (a wrapper
    process runs it, so RUSAGE_CHILDREN counts that run alone)."""
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "lazyrag.cli", "answer",
                           *map(str, args)], capture_output=True, text=True, timeout=600)
    return proc, int(proc.stdout.split()[-1]) * 1024


@pytest.mark.parametrize("limit, says", [(("--max-prompt-tokens", "4096"), "--max-prompt-tokens 4096"),
                                         (("--cache-gb", "0.02"), "raise --cache-gb")])
def test_the_short_question_is_answered_and_the_long_one_refused_in_little_memory(store, tmp_path, limit, says):
    out = tmp_path / "a.jsonl"
    proc, peak = answer_in_a_child(queries(tmp_path), "--store", store, "--out", out, "--device", "cpu",
                                   "--max-new-tokens", "2", *limit, "-q")
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in rows(out)] == ["short"]
    refused = errors(out)["long"]
    assert refused["line"] == 1 and says in refused["error"] and "--max-prompt-tokens" in refused["error"]
    assert peak < 4 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


def test_a_prompt_whose_prefill_needs_more_memory_than_is_free_is_refused_not_attempted(store, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr(answer_engine, "available_bytes", lambda device: 1 << 30)  # 1 GiB free
    out = tmp_path / "a.jsonl"
    res = answer(queries(tmp_path), store, out, "--cache-gb", "0.5", "-q")  # the pool holds it
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in rows(out)] == ["short"]
    refused = errors(out)["long"]["error"]
    assert "working memory" in refused and "--max-prompt-tokens" in refused and "--cache-gb" in refused


@pytest.mark.gpu
def test_on_a_gpu_an_8b_model_answers_a_100000_token_question_in_slices_beside_a_short_one(tmp_path):
    """random:llama3-8b (a 131,072-token context, a token a byte): the 100,000-token question is within it, so it
    is answered through sliced prefill, and its working memory stays a few GiB (a prefill in one
    step would need its 100,000 x 128,256 logits alone: 48 GiB in fp32)."""
    import torch

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Alpha is the first letter.\n\nBeta is the second letter.")
    store = tmp_path / "r.zarr"
    res = cli("index", corpus, "--store", store, "--model", "random:llama3-8b", "--device", "cuda", "-q")
    assert res.exit_code == 0, res.output
    q = write_jsonl(tmp_path / "q.jsonl", {"id": "long", "question": " ".join(["word"] * 20_000)},
                    {"id": "short", "question": "What is alpha?", "docs": ["a.txt"]})
    out = tmp_path / "a.jsonl"
    torch.cuda.reset_peak_memory_stats()
    res = cli("answer", q, "--store", store, "--out", out, "--device", "cuda", "--cache-gb", "20",
              "--max-new-tokens", "4", "--batch-size", "4", "-q")
    assert res.exit_code == 0, res.output
    answered = {r["id"]: r for r in rows(out)}
    assert set(answered) == {"long", "short"}, errors(out)
    assert all(r["new_tokens"] >= 1 for r in answered.values())
    weights = 8.0e9 * 2  # bf16
    working = torch.cuda.max_memory_allocated() - weights - 20 * 2**30
    assert working < 8 * 2**30, f"working memory {working / 2**30:.1f} GiB over the weights and the pool"
