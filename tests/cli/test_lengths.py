"""Lengths checked against the model: a prompt past the context (or --max-prompt-tokens) fails
that query with its token count, a line too long to be a question is skipped unread, and
`index --chunk-tokens` above the context is refused before any work."""

import json

import pytest
from cli_tools import TINY, answer, cli, index_docs, rows, write_jsonl

from lazyrag.commands.queries import MAX_LINE_BYTES

TINY_CONTEXT = 131072  # random:tiny's max_position_embeddings; its tokenizer has one token per byte


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lengths")
    return index_docs(tmp / "s.zarr", tmp, "saturn")


def errors_of(out):
    return {r["id"]: r for r in rows(out.with_name(out.stem + ".errors.jsonl"))}


def test_a_prompt_over_the_limit_fails_with_its_token_count_and_the_rest_are_answered(store, tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl",
                          {"id": "short", "question": "Rings?"},
                          {"id": "long", "question": "Why? " * 200},
                          {"id": "past-context", "question": "x" * (TINY_CONTEXT + 10)})
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out, "--top-k", 1, "--max-prompt-tokens", 500, "--json")
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in rows(out)] == ["short"]
    failed = errors_of(out)
    assert set(failed) == {"long", "past-context"}
    assert "over the limit of 500" in failed["long"]["error"]
    tokens = int(failed["past-context"]["error"].split("the prompt is ")[1].split()[0].replace(",", ""))
    assert tokens > TINY_CONTEXT
    assert json.loads(res.stdout)["failed"] == 2


def test_the_default_limit_is_the_models_context(store, tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "past-context", "question": "x" * (TINY_CONTEXT + 10)},
                          {"id": "short", "question": "Rings?"})
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out, "--top-k", 1, "-q")
    assert res.exit_code == 0, res.output
    assert f"{TINY_CONTEXT:,}" in errors_of(out)["past-context"]["error"]


def test_a_line_too_long_to_be_a_question_is_reported_by_line_and_skipped(store, tmp_path):
    queries = tmp_path / "q.jsonl"
    huge = json.dumps({"id": "huge", "question": "word " * (MAX_LINE_BYTES // 5 + 10)})
    queries.write_text(huge + "\n" + json.dumps({"id": "ok", "question": "Rings?"}) + "\n")
    out = tmp_path / "a.jsonl"
    res = answer(queries, store, out, "--top-k", 1, "-q")
    assert res.exit_code == 0, res.output
    assert f"{queries}:1:" in res.stderr and "MiB" in res.stderr
    assert [r["id"] for r in rows(out)] == ["ok"]


def test_index_refuses_chunks_longer_than_the_context_before_any_work(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", {"id": "a", "text": "Some text."})
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "--chunk-tokens", TINY_CONTEXT + 1)
    assert res.exit_code == 2
    assert "context" in res.stderr and str(TINY_CONTEXT) in res.stderr
    assert not (tmp_path / "s.zarr").exists()
