"""`answer` with recompute reuse, in the given order and with --chunk-order popular, end to end
(random:tiny on the CPU): answers under their own ids, the audit against full on the given order,
the counters in stats."""

import json

import pytest
from cli_tools import answer, cli, index_docs, last_run, rows, write_jsonl

import lazyrag.commands.audit as audit

DOCS = ("jupiter", "mars", "saturn", "piano")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reuse")
    return index_docs(tmp / "s.zarr", tmp, *DOCS)


def queries(tmp_path):
    # jupiter is in every query, listed last or in the middle: popular order puts it first
    return write_jsonl(tmp_path / "q.jsonl",
                       {"id": "q1", "question": "Which moon is largest?", "docs": ["mars", "jupiter"]},
                       {"id": "q2", "question": "Who made the piano?", "docs": ["piano", "jupiter", "saturn"]},
                       {"id": "q3", "question": "How many rings?", "docs": ["saturn", "jupiter"]},
                       {"id": "q4", "question": "Is Mars red?", "docs": ["mars", "jupiter"]})


def test_popular_order_answers_every_query_under_its_id_and_reuses_recomputed_pages(store, tmp_path):
    q = queries(tmp_path)
    res = answer(q, store, tmp_path / "a.jsonl", "--recompute", "0.5", "--recompute-policy", "head",
                 "--chunk-order", "popular", "--batch-size", "1", "-q")
    assert res.exit_code == 0, res.output
    got = {r["id"]: r for r in rows(tmp_path / "a.jsonl")}
    assert sorted(got) == ["q1", "q2", "q3", "q4"]
    assert len({r["chunks"][0] for r in got.values()}) == 1  # every prompt now leads with jupiter
    run = last_run(store)
    assert run["settings"]["chunk_order"] == "popular" and run["settings"]["recompute_reuse"] is True
    c = run["cache"]
    assert c["recomputed_tokens"] > 0 and c["reused_tokens"] > 0  # q4 repeats q1's documents
    assert c["reuse_ratio"] == pytest.approx(c["reused_tokens"] / (c["reused_tokens"] + c["recomputed_tokens"]),
                                             abs=1e-4)
    overall = json.loads(cli("stats", "--store", store, "--json").stdout)["overall"]["cache"]
    assert overall["reused_tokens"] >= c["reused_tokens"]
    table = cli("stats", "--store", store)
    assert "selective recompute" in table.stdout and "popular" in table.stdout


def test_by_default_prompts_keep_the_given_order_and_reuse_what_repeats(store, tmp_path):
    res = answer(queries(tmp_path), store, tmp_path / "a.jsonl", "--recompute", "0.5", "--recompute-policy", "head",
                 "--batch-size", "1", "-q")
    assert res.exit_code == 0, res.output
    run = last_run(store)
    assert run["settings"]["chunk_order"] == "given" and run["settings"]["recompute_reuse"] is True
    assert run["cache"]["reused_tokens"] > 0  # q4 gives q1's documents in q1's order
    assert len({r["chunks"][0] for r in rows(tmp_path / "a.jsonl")}) == 3  # mars, piano, saturn lead


def test_without_reuse_nothing_is_reused_and_prompts_keep_the_given_order(store, tmp_path):
    res = answer(queries(tmp_path), store, tmp_path / "a.jsonl", "--recompute", "0.5", "--no-recompute-reuse",
                 "--batch-size", "1", "-q")
    assert res.exit_code == 0, res.output
    run = last_run(store)
    assert run["cache"]["recomputed_tokens"] > 0 and run["cache"]["reused_tokens"] == 0
    assert run["settings"]["chunk_order"] == "given"  # ordering serves reuse alone
    assert len({r["chunks"][0] for r in rows(tmp_path / "a.jsonl")}) == 3  # mars, piano, saturn lead


def test_the_audit_compares_with_full_on_the_order_the_query_gave(store, tmp_path, monkeypatch):
    seen = {}
    real = audit.Engine

    class Recording(real):
        def run(self, requests, *a, **kw):
            if self.mode.__class__.__name__ == "Full":
                seen.update({r.id: [c.doc_id for c in r.chunks] for r in requests})
            return super().run(requests, *a, **kw)

    monkeypatch.setattr(audit, "Engine", Recording)
    res = answer(queries(tmp_path), store, tmp_path / "a.jsonl", "--recompute", "0.5", "--chunk-order", "popular",
                 "--audit", "4", "-q")
    assert res.exit_code == 0, res.output
    given = {"q1": ["mars", "jupiter"], "q2": ["piano", "jupiter", "saturn"], "q3": ["saturn", "jupiter"],
             "q4": ["mars", "jupiter"]}
    doc_order = {k: list(dict.fromkeys(v)) for k, v in seen.items()}
    assert doc_order == given
    assert last_run(store)["audit"]["queries"] == 4


def test_a_bad_chunk_order_is_a_usage_error(store, tmp_path):
    res = answer(queries(tmp_path), store, tmp_path / "a.jsonl", "--chunk-order", "random")
    assert res.exit_code == 2 and "random" in res.output
