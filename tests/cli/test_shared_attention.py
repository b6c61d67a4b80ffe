"""`answer --no-shared-attention`: lazy answers read the shared chunk pages per request instead of
once per step for all, with the same answers, from a store of the model's KV dtype or an fp8 one;
the run record says which."""

import pytest
from cli_tools import answer, index_docs, last_run, rows, write_jsonl


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_answers_are_the_same_with_and_without_shared_attention(tmp_path, kv_dtype):
    store = index_docs(tmp_path / "s.zarr", tmp_path, "jupiter", "mars", "saturn", kv_dtype=kv_dtype)
    queries = write_jsonl(tmp_path / "q.jsonl",
                          {"id": "a", "question": "Which moon is the largest?", "docs": ["saturn", "jupiter"]},
                          {"id": "b", "question": "Which planet is red?", "docs": ["jupiter", "mars", "saturn"]},
                          {"id": "c", "question": "Which planet has rings?", "docs": ["mars", "jupiter"]})
    answers, settings = {}, {}
    for flag in ("--shared-attention", "--no-shared-attention"):
        out = tmp_path / f"{flag}.jsonl"
        res = answer(queries, store, out, "--max-new-tokens", "4", flag)
        assert res.exit_code == 0, res.output
        answers[flag] = {r["id"]: r["answer"] for r in rows(out)}
        settings[flag] = last_run(store)["settings"]["shared_attention"]
    assert answers["--shared-attention"] == answers["--no-shared-attention"] and len(answers["--shared-attention"]) == 3
    assert settings == {"--shared-attention": True, "--no-shared-attention": False}
