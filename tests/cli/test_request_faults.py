"""One request's failure fails that request only (random:tiny on the CPU): an out-of-memory error
injected into one request of a batch (lazyrag/serve/faults.py's hook) puts it in the errors file
with its line, and every other answer is the one a run without the fault gives, recomputed pages
shared with the failed request included (they are forgotten, never read half computed)."""

import json

import pytest
from cli_tools import answer, index_docs, rows, write_jsonl

from lazyrag.serve.faults import INJECT_OOM_VAR

DOCS = ("jupiter", "mars", "saturn", "piano")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    return index_docs(tmp / "s.zarr", tmp, *DOCS)


def queries(tmp_path):
    # q1 leads the batch and q2 has its chunks: in one prefill, q2 reads the pages q1 recomputes
    return write_jsonl(tmp_path / "q.jsonl",
                       {"id": "q1", "question": "Which moon is largest?", "docs": ["mars", "jupiter"]},
                       {"id": "q2", "question": "Is Mars red?", "docs": ["mars", "jupiter"]},
                       {"id": "q3", "question": "How many rings?", "docs": ["saturn", "jupiter"]},
                       {"id": "q4", "question": "Who made the piano?", "docs": ["piano"]})


def answers(store, tmp_path, name, monkeypatch, fault, *args):
    if fault:
        monkeypatch.setenv(INJECT_OOM_VAR, fault)
    else:
        monkeypatch.delenv(INJECT_OOM_VAR, raising=False)
    out = tmp_path / f"{name}.jsonl"
    res = answer(queries(tmp_path), store, out, "--max-new-tokens", "4", "--chunk-order", "given",
                 *args, "-q")
    assert res.exit_code == 0, res.output
    errors = out.with_name(f"{name}.errors.jsonl")
    failed = [json.loads(line) for line in errors.read_text().splitlines()] if errors.exists() else []
    return {r["id"]: r["answer"] for r in rows(out)}, failed


@pytest.mark.parametrize("fault", ["q1", "q1:decode", "q3"])
@pytest.mark.parametrize("recompute", [("--recompute", "0"), ("--recompute", "0.5", "--recompute-policy", "head")])
def test_an_out_of_memory_request_fails_alone_and_the_others_answer_as_without_it(store, tmp_path, monkeypatch,
                                                                                   fault, recompute):
    clean, none_failed = answers(store, tmp_path, "clean", monkeypatch, None, *recompute)
    assert sorted(clean) == ["q1", "q2", "q3", "q4"] and none_failed == []
    got, failed = answers(store, tmp_path, "faulty", monkeypatch, fault, *recompute)
    culprit = fault.split(":")[0]
    assert [(f["id"], f["line"]) for f in failed] == [(culprit, int(culprit[1:]))]
    assert "out of memory" in failed[0]["error"] and "\n" not in failed[0]["error"]
    assert got == {k: v for k, v in clean.items() if k != culprit}


def test_a_request_refused_for_out_of_memory_is_retried_by_the_next_run(store, tmp_path, monkeypatch):
    first, failed = answers(store, tmp_path, "a", monkeypatch, "q2")
    assert "q2" not in first and [f["id"] for f in failed] == ["q2"]
    again, failed = answers(store, tmp_path, "a", monkeypatch, None)
    assert sorted(again) == ["q1", "q2", "q3", "q4"] and failed == []


def test_a_question_the_tokenizer_cannot_encode_fails_that_query_only(store, tmp_path, monkeypatch):
    from lazyrag.models.prompt import PromptFormat

    encode = PromptFormat.question_ids

    def fragile(self, question):
        if "piano" in question:
            raise ValueError("the tokenizer broke")
        return encode(self, question)

    monkeypatch.setattr(PromptFormat, "question_ids", fragile)
    got, failed = answers(store, tmp_path, "a", monkeypatch, None)
    assert sorted(got) == ["q1", "q2", "q3"]
    assert [(f["id"], f["line"]) for f in failed] == [("q4", 4)] and "tokenizer" in failed[0]["error"]
