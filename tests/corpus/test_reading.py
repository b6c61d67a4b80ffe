"""Reading corpora: directories and files, ids and sources, bad input named by file and line."""

from __future__ import annotations

import json

import pytest

from lazyrag.corpus import CorpusError, CorpusStats, Document, read_corpus


def write(path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def test_directory_nested_sorted_with_ids_and_sources(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", "Bee text.")
    write(root / "a" / "z.md", "# Zed\nmarkdown body")
    write(root / "a" / "docs.jsonl", jsonl({"id": 7, "text": "seven", "title": "Seventh"}, {"id": "x", "text": "ex"}))
    write(root / "ignored.csv", "not,a,doc")
    write(root / ".hidden" / "h.txt", "hidden")
    stats = CorpusStats()
    docs = list(read_corpus(root, stats=stats))
    assert [d.id for d in docs] == ["7", "x", "a/z.md", "b.txt"]
    assert docs[0] == Document(id="7", text="seven", title="Seventh", source=f"{root / 'a' / 'docs.jsonl'}:1")
    assert docs[1].source.endswith("docs.jsonl:2") and docs[1].title is None
    assert docs[2].source == str(root / "a" / "z.md") and docs[2].text == "# Zed\nmarkdown body"
    assert docs[0].model_text == "Seventh\nseven"
    assert docs[1].model_text == "ex"
    assert stats == CorpusStats(documents=4, empty_skipped=0, bad_skipped=0, files=3)


def test_single_jsonl_file_blank_lines_and_empty_docs(tmp_path):
    f = tmp_path / "c.jsonl"
    write(f, jsonl({"id": "a", "text": "one"}, "", "   ", {"id": "e", "text": "  \n\t"}, {"id": "b", "text": "two"}))
    write(tmp_path / "empty.txt", "\n\n  \n")
    stats = CorpusStats()
    assert [d.id for d in read_corpus(f, stats=stats)] == ["a", "b"]
    assert stats.documents == 2 and stats.empty_skipped == 1
    stats = CorpusStats()
    assert list(read_corpus(tmp_path, stats=stats)) and stats.empty_skipped == 2


def test_single_text_file(tmp_path):
    f = tmp_path / "sub" / "note.md"
    write(f, "\ufeffline one\r\nline two\r\n")
    (doc,) = read_corpus(f)
    assert doc.id == "note.md" and doc.text == "line one\nline two\n" and doc.source == str(f)


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"id": "a", "text": ', "invalid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"text": "no id"}', 'missing "id"'),
        ('{"id": "a"}', 'missing "text"'),
        ('{"id": "a", "text": 5}', '"text" must be a string'),
        ('{"id": true, "text": "t"}', '"id" must be a string or an integer'),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, reason):
    f = tmp_path / "docs.jsonl"
    write(f, jsonl({"id": "ok", "text": "fine"}, "", line, {"id": "after", "text": "later"}))
    with pytest.raises(CorpusError) as e:
        list(read_corpus(tmp_path))
    assert str(e.value).startswith(f"{f}:3: ")
    assert reason in str(e.value)


def test_skip_bad_reports_and_continues(tmp_path):
    f = tmp_path / "a.jsonl"
    write(f, jsonl({"id": "1", "text": "one"}, "{broken", {"id": "2", "text": "two"}, {"id": "1", "text": "dup"}))
    write(tmp_path / "b.txt", b"good start\n\xff\xfe bad bytes")
    write(tmp_path / "c.txt", "fine")
    messages: list[str] = []
    stats = CorpusStats()
    docs = list(read_corpus(tmp_path, skip_bad=True, report=messages.append, stats=stats))
    assert [d.id for d in docs] == ["1", "2", "c.txt"]
    assert len(messages) == 3 and stats.bad_skipped == 3 and stats.documents == 3
    assert messages[0].startswith(f"{f}:2: invalid JSON")
    assert messages[1].startswith(f"{f}:4: duplicate document id '1'") and f"{f}:1" in messages[1]
    assert messages[2].startswith(f"{tmp_path / 'b.txt'}:2: not valid UTF-8")


def test_non_utf8_file_stops_with_file_and_line(tmp_path):
    write(tmp_path / "a.txt", "fine")
    write(tmp_path / "latin1.txt", "first line\nsecond line caf\u00e9\n".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt:2: not valid UTF-8"):
        list(read_corpus(tmp_path))
    write(tmp_path / "latin1.txt", "x")
    write(tmp_path / "d.jsonl", b'{"id": "1", "text": "ok"}\n{"id": "2", "text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: not valid UTF-8"):
        list(read_corpus(tmp_path))


def test_duplicate_ids_across_files_name_both_places(tmp_path):
    write(tmp_path / "a.jsonl", jsonl({"id": "b.txt", "text": "from jsonl"}))
    write(tmp_path / "b.txt", "a file whose id collides")
    with pytest.raises(CorpusError) as e:
        list(read_corpus(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'b.txt'}:1: duplicate document id 'b.txt'")
    assert f"{tmp_path / 'a.jsonl'}:1" in msg


def test_missing_path_and_unsupported_file(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        list(read_corpus(tmp_path / "nope"))
    write(tmp_path / "x.csv", "a,b")
    with pytest.raises(CorpusError, match="unsupported file type"):
        list(read_corpus(tmp_path / "x.csv"))
