"""The queries file: fields parsed, bad lines reported by file and line, the rest kept."""

import json

import pytest

from lazyrag.commands.queries import Query, QueryError, read_queries


def read(path):
    reports: list[str] = []
    return list(read_queries(path, reports.append)), reports


def test_queries_are_parsed_and_bad_lines_reported_by_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "1", "question": "Where?", "docs": ["a", 2], "answers": ["here"]}),
        "",
        "{not json",
        json.dumps({"id": "2", "question": "   "}),
        json.dumps({"id": "3", "question": "Which?", "chunks": "c1"}),
        json.dumps(["a list"]),
        json.dumps({"id": "1", "question": "Again?"}),
        json.dumps({"id": "4", "question": "What?"}),
    ]) + "\n")
    queries, reports = read(path)
    assert queries == [Query("1", "Where?", 1, docs=["a", "2"], answers=["here"]), Query("4", "What?", 8)]
    assert [r.split(": ", 1)[0] for r in reports] == [f"{path}:{n}" for n in (3, 4, 5, 6, 7)]
    assert "non-empty" in reports[1] and '"chunks" must be a list' in reports[2]
    assert "JSON object" in reports[3] and "duplicate query id '1'" in reports[4]


def test_a_line_that_is_not_utf8_is_reported_and_the_others_read(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(json.dumps({"id": "a", "question": "First?"}).encode() + b"\n"
                     + b'{"id": "b", "question": "Caf\xe9?"}\n'
                     + json.dumps({"id": "c", "question": "Third?"}).encode() + b"\n")
    queries, reports = read(path)
    assert [q.id for q in queries] == ["a", "c"]
    assert len(reports) == 1 and reports[0].startswith(f"{path}:2: ") and "UTF-8" in reports[0]


@pytest.mark.parametrize("qid", [1, 2.5, ["a"], {"a": 1}, None, True, ""])
def test_an_id_that_is_not_a_nonempty_string_is_a_bad_line(tmp_path, qid):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": qid, "question": "Why?"}) + "\n"
                    + json.dumps({"id": "ok", "question": "Why?"}) + "\n")
    queries, reports = read(path)
    assert [q.id for q in queries] == ["ok"]
    assert len(reports) == 1 and reports[0].startswith(f"{path}:1: ") and '"id"' in reports[0]


@pytest.mark.parametrize("field", ["docs", "chunks"])
def test_an_empty_docs_or_chunks_list_is_a_bad_line_not_retrieval(tmp_path, field):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "x", "question": "Why?", field: []}) + "\n")
    queries, reports = read(path)
    assert queries == [] and len(reports) == 1
    assert reports[0].startswith(f"{path}:1: ") and f'"{field}"' in reports[0] and "empty" in reports[0]


def test_chunk_ids_must_be_strings(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "x", "question": "Why?", "chunks": ["c1", 7]}) + "\n")
    queries, reports = read(path)
    assert queries == [] and '"chunks" must be a list of strings' in reports[0]


def test_missing_queries_file_is_one_error(tmp_path):
    with pytest.raises(QueryError, match="cannot read the queries file"):
        list(read_queries(tmp_path / "nope.jsonl", print))


def test_a_byte_order_mark_before_the_first_line_is_not_an_error(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "question": "Why?"}\n')
    notes: list[str] = []
    assert [q.id for q in read_queries(path, notes.append)] == ["a"] and notes == []


def test_a_query_with_both_docs_and_chunks_is_a_bad_line_not_one_of_them_ignored(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"id": "ok", "question": "Why?", "docs": ["a"]}) + "\n"
                    + json.dumps({"id": "x", "question": "Why?", "docs": ["a"], "chunks": ["c1"]}) + "\n")
    queries, reports = read(path)
    assert [q.id for q in queries] == ["ok"]
    assert len(reports) == 1 and reports[0].startswith(f"{path}:2: ")
    assert '"docs" and "chunks"' in reports[0]
