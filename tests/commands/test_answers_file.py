"""The answers file: which ids count as answered, a torn last line repaired, failures kept
apart in the errors file, one writer at a time."""

import json

import pytest

from lazyrag.commands.answers_file import AnswersFile, AnswersFileError, errors_path


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_errors_file_sits_next_to_the_answers():
    from pathlib import Path

    assert errors_path(Path("/x/answers.jsonl")) == Path("/x/answers.errors.jsonl")
    assert errors_path(Path("out")) == Path("out.errors.jsonl")


def test_failures_go_to_the_errors_file_and_are_not_answered(tmp_path):
    out = tmp_path / "a.jsonl"
    with AnswersFile(out, print) as answers:
        answers.write({"id": "q1", "answer": "yes"})
        answers.write_error("q2", "unknown doc ids: d9", line=4)
        assert answers.failed == 1
    assert rows(out) == [{"id": "q1", "answer": "yes"}]
    assert rows(errors_path(out)) == [{"id": "q2", "error": "unknown doc ids: d9", "line": 4}]
    with AnswersFile(out, print) as answers:
        assert answers.done == {"q1"}
        assert not errors_path(out).exists()  # each run lists only its own failures


def test_error_rows_written_into_the_answers_are_retried(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "q1", "answer": "yes"}\n{"id": "q2", "error": "unknown doc ids: d9"}\n')
    with AnswersFile(out, print) as answers:
        assert answers.done == {"q1"}


def test_a_torn_last_line_is_cut_away_and_said_so(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "q1", "answer": "yes"}\n{"id": "q2", "ans')
    notes: list[str] = []
    with AnswersFile(out, notes.append) as answers:
        assert answers.done == {"q1"}
        answers.write({"id": "q2", "answer": "no"})
    assert rows(out) == [{"id": "q1", "answer": "yes"}, {"id": "q2", "answer": "no"}]
    assert len(notes) == 1 and str(out) in notes[0] and "torn" in notes[0]


def test_a_complete_last_row_missing_its_newline_is_kept(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text('{"id": "q1", "answer": "yes"}')
    notes: list[str] = []
    with AnswersFile(out, notes.append) as answers:
        assert answers.done == {"q1"}
        answers.write({"id": "q2", "answer": "no"})
    assert [r["id"] for r in rows(out)] == ["q1", "q2"] and notes == []


def test_a_second_writer_is_refused_while_the_first_holds_the_file(tmp_path):
    out = tmp_path / "a.jsonl"
    with AnswersFile(out, print):
        with pytest.raises(AnswersFileError, match="another answer run is writing"):
            AnswersFile(out, print)
    with AnswersFile(out, print):  # released on close
        pass

