"""Reading corpora and chunking documents (lazyrag/corpus.py)."""

from __future__ import annotations

import json
import re

import pytest

from lazyrag.corpus import Chunk, CorpusError, CorpusStats, Document, chunk_document, read_corpus


class WordTokenizer:
    """A tiny stand-in for a fast HF tokenizer: a token is a run of non-space
    characters with the whitespace before it (like GPT-2's "Ġword"), or trailing
    whitespace. Ids come from a growing vocabulary."""

    pattern = re.compile(r"\s*\S+|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text, *, add_special_tokens, return_offsets_mapping):
        assert add_special_tokens is False and return_offsets_mapping is True
        ids, offsets = [], []
        for m in self.pattern.finditer(text):
            ids.append(self.vocab.setdefault(m.group(), len(self.vocab)))
            offsets.append(m.span())
        return {"input_ids": ids, "offset_mapping": offsets}


class NewlineTokenizer(WordTokenizer):
    """Like WordTokenizer, but every newline is a token of its own (as in SmolLM2's
    tokenizer, where "\\n\\n" comes out as two "\\n" tokens)."""

    pattern = re.compile(r"\n|[^\S\n]*[^\s]+|[^\S\n]+")


def write(path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# -- reading -------------------------------------------------------------------


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


# -- chunking --------------------------------------------------------------------


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def check_invariants(text, tok, chunks: list[Chunk], chunk_tokens: int) -> None:
    full = tok(text, add_special_tokens=False, return_offsets_mapping=True)["input_ids"]
    assert [t for c in chunks for t in c.token_ids] == full
    assert all(0 < len(c.token_ids) <= chunk_tokens for c in chunks)
    # every chunk's text is the span its tokens cover, so the texts tile the document
    assert "".join(c.text for c in chunks) == text[: len("".join(c.text for c in chunks))]


def test_short_document_is_one_chunk():
    tok = WordTokenizer()
    text = "A short document. Two sentences."
    assert chunk_document(text, tok, 64) == [Chunk(tuple(tok(text, add_special_tokens=False, return_offsets_mapping=True)["input_ids"]), text)]
    assert chunk_document("", tok, 8) == []
    with pytest.raises(ValueError):
        chunk_document(text, tok, 0)


def test_cut_prefers_paragraph_over_sentence_and_line():
    tok = WordTokenizer()
    # window of 20 tokens: a paragraph break after token 12, a sentence end after
    # token 16, a line break after token 18: the cut must be the paragraph break.
    text = words(12) + "\n\n" + words(4, 100) + ". " + words(2, 200) + "\n" + words(30, 300)
    chunks = chunk_document(text, tok, 20)
    check_invariants(text, tok, chunks, 20)
    assert chunks[0].text == words(12)
    assert chunks[1].text.startswith("\n\nw100")


def test_cut_prefers_sentence_then_line():
    tok = WordTokenizer()
    text = words(11) + ". " + words(5, 100) + "\n" + words(2, 200) + " " + words(40, 300)
    chunks = chunk_document(text, tok, 20)
    check_invariants(text, tok, chunks, 20)
    assert chunks[0].text == words(11) + "."
    text = words(11) + "\n" + words(40, 100)
    chunks = chunk_document(text, tok, 20)
    assert chunks[0].text == words(11)
    # of two boundaries of the same kind in the window, the later one is taken
    text = words(11) + ". " + words(6, 100) + "! " + words(40, 300)
    chunks = chunk_document(text, tok, 20)
    assert chunks[0].text == words(11) + ". " + words(6, 100) + "!"


def test_boundary_in_first_half_of_window_is_not_taken():
    tok = WordTokenizer()
    # the only paragraph break is after token 5 of a 20-token window: too early,
    # so the chunk is cut at the window's end instead of making a 5-token chunk.
    text = words(5) + "\n\n" + words(60, 100)
    chunks = chunk_document(text, tok, 20)
    check_invariants(text, tok, chunks, 20)
    assert len(chunks[0].token_ids) == 20
    assert all(len(c.token_ids) >= 10 for c in chunks[:-1])


def test_newline_tokens_cut_after_the_blank_line():
    tok = NewlineTokenizer()
    text = words(14) + ".\n\nNext paragraph starts here " + words(40, 100)
    chunks = chunk_document(text, tok, 24)
    check_invariants(text, tok, chunks, 24)
    assert chunks[0].text == words(14) + ".\n\n"
    assert chunks[1].text.startswith("Next paragraph")


def test_long_random_documents_keep_every_token():
    import random

    rng = random.Random(0)
    tok = NewlineTokenizer()
    pieces = ["alpha", "beta.", "gamma!", "delta?", "\n", "\n\n", "eps", "(zeta.)", "eta"]
    for trial in range(30):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 600)))
        for chunk_tokens in (1, 2, 7, 32, 100):
            chunks = chunk_document(text, tok, chunk_tokens)
            check_invariants(text, tok, chunks, chunk_tokens)
            assert all(len(c.token_ids) >= chunk_tokens // 2 for c in chunks[:-1])


def test_real_fast_tokenizer_protocol():
    """A byte-level BPE trained on the spot, through transformers' fast tokenizer
    class: the same call protocol and offsets as the default model's tokenizer,
    including characters split over several tokens (overlapping offsets)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    sample = "The quick brown fox. Jumps over the lazy dog!\n\nA new paragraph here.\n" * 20
    bpe.train_from_iterator([sample], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    text = ("The quick brown fox jumps. Über naïve 😀 emoji 😀😀 text!\n\n" * 12) + "The end."
    for chunk_tokens in (5, 16, 50):
        chunks = chunk_document(text, tok, chunk_tokens)
        full = tok(text, add_special_tokens=False)["input_ids"]
        assert [t for c in chunks for t in c.token_ids] == full
        assert all(len(c.token_ids) <= chunk_tokens for c in chunks)
        assert all(c.text and c.text in text for c in chunks)
    chunks = chunk_document(text, tok, 50)
    assert all(c.text.endswith("!\n\n") for c in chunks[:-1])  # cut at paragraph ends
