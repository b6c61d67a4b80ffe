"""The queries file: fields parsed, bad lines reported by file and line, the rest kept."""

import json

import pytest

from lazyrag.commands.queries import Query, QueryError, read_queries


def test_queries_are_parsed_and_bad_lines_reported_by_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": 1, "question": "Where?", "docs": ["a", 2], "answers": ["here"]}),
        "",
        "{not json",
        json.dumps({"id": "2", "question": "   "}),
        json.dumps({"id": "3", "question": "Which?", "chunks": "c1"}),
        json.dumps(["a list"]),
        json.dumps({"id": "1", "question": "Again?"}),
        json.dumps({"id": "4", "question": "What?"}),
    ]) + "\n")
    reports: list[str] = []
    queries = list(read_queries(path, reports.append))
    assert queries == [Query("1", "Where?", 1, docs=["a", "2"], answers=["here"]), Query("4", "What?", 8)]
    assert [r.split(": ", 1)[0] for r in reports] == [f"{path}:{n}" for n in (3, 4, 5, 6, 7)]
    assert "non-empty" in reports[1] and '"chunks" must be a list' in reports[2]
    assert "JSON object" in reports[3] and "duplicate query id '1'" in reports[4]


def test_missing_queries_file_is_one_error(tmp_path):
    with pytest.raises(QueryError, match="cannot read the queries file"):
        list(read_queries(tmp_path / "nope.jsonl", print))
