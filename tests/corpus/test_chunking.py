"""Chunking: token runs that tile the document, cut at paragraph, sentence or line boundaries."""

from __future__ import annotations

import re

import pytest

from lazyrag.corpus import Chunk, chunk_document


class WordTokenizer:
    """A tiny stand-in for a fast HF tokenizer: a token is a run of non-space
    characters with the whitespace before it (like GPT-2's "Ġword"), or trailing
    whitespace. Ids come from a growing vocabulary."""

    pattern = re.compile(r"\s*\S+|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text, *, add_special_tokens, return_offsets_mapping):
        assert add_special_tokens is False and return_offsets_mapping is True
        if isinstance(text, list):  # a batch, as a fast tokenizer takes it
            each = [self(t, add_special_tokens=False, return_offsets_mapping=True) for t in text]
            return {key: [e[key] for e in each] for key in ("input_ids", "offset_mapping")}
        ids, offsets = [], []
        for m in self.pattern.finditer(text):
            ids.append(self.vocab.setdefault(m.group(), len(self.vocab)))
            offsets.append(m.span())
        return {"input_ids": ids, "offset_mapping": offsets}


class NewlineTokenizer(WordTokenizer):
    """Like WordTokenizer, but every newline is a token of its own (as in SmolLM2's
    tokenizer, where "\\n\\n" comes out as two "\\n" tokens)."""

    pattern = re.compile(r"\n|[^\S\n]*[^\s]+|[^\S\n]+")


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
    ids = tok(text, add_special_tokens=False, return_offsets_mapping=True)["input_ids"]
    assert chunk_document(text, tok, 64) == [Chunk(tuple(ids), text)]
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


# The chunker finds boundaries over whole arrays; this is the rule as one loop per token, the
# reference it must match cut for cut.
def reference_chunk_document(text, tok, chunk_tokens):
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    n = len(ids)

    def strength(i):
        if not 0 < i < n:
            return 0
        start, end = offsets[i]
        j = start
        while j > 0 and start - j < 64 and text[j - 1].isspace():
            j -= 1
        k = start
        while k < end and text[k].isspace():
            k += 1
        gap = text[j:k]
        if not gap:
            return 0
        if re.search(r"\n[^\S\n]*\n", gap):
            return 3
        p = j
        while p > 0 and j - p < 64 and text[p - 1] in "\"')]}»”’":
            p -= 1
        if p > 0 and text[p - 1] in ".!?…":
            return 2
        return 1 if "\n" in gap else 0

    def cut(start):
        limit = start + chunk_tokens
        best_at, best = limit, -1
        for c in range(limit, max(start + (chunk_tokens + 1) // 2, start + 1) - 1, -1):
            if strength(c) > best:
                best_at, best = c, strength(c)
        if best > 0:
            return best_at
        for c in range(limit, start, -1):
            if offsets[c][0] >= offsets[c - 1][1]:
                return c
        return limit

    bounds, start = [0], 0
    while n - start > chunk_tokens:
        start = cut(start)
        bounds.append(start)
    bounds.append(n)
    return [(tuple(ids[a:b]), text[min(o[0] for o in offsets[a:b]): max(o[1] for o in offsets[a:b])])
            for a, b in zip(bounds, bounds[1:]) if b > a]


class CharTokenizer(WordTokenizer):
    """One token a character, except that some characters come out as two tokens over the same
    span (as byte-level BPE splits a multi-byte character: overlapping offsets)."""

    def __call__(self, text, *, add_special_tokens, return_offsets_mapping):
        if isinstance(text, list):
            return super().__call__(text, add_special_tokens=add_special_tokens,
                                    return_offsets_mapping=return_offsets_mapping)
        ids, offsets = [], []
        for i, ch in enumerate(text):
            for _ in range(2 if ord(ch) > 0x2000 else 1):
                ids.append(self.vocab.setdefault(ch, len(self.vocab)))
                offsets.append((i, i + 1))
        return {"input_ids": ids, "offset_mapping": offsets}


@pytest.mark.parametrize("tok", [WordTokenizer(), NewlineTokenizer(), CharTokenizer()], ids=type)
def test_cuts_match_the_per_token_reference(tok):
    import random

    rng = random.Random(7)
    pieces = ["alpha", "beta.", "gamma!", "delta?", "end…", "\n", "\n\n", " \n \n", "\t", "\u00a0", "\u2003",
              "\x1c", "eps", "(zeta.)", "\"quoted.\"", "it.’”", "x)]}", "😀", "Über", "." + ")" * 70,
              " " * 70, "\n" + " " * 70 + "\n", "a.\u2003\n"]
    for trial in range(60):
        text = "".join(rng.choice(pieces) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 300)))
        for chunk_tokens in (1, 2, 3, 7, 32, 100):
            got = [(c.token_ids, c.text) for c in chunk_document(text, tok, chunk_tokens)]
            assert got == reference_chunk_document(text, tok, chunk_tokens), (trial, chunk_tokens)


def test_a_batch_is_cut_as_each_text_alone():
    """chunk_documents tokenizes its texts in one call; the cuts are those of each text alone, with
    a real fast tokenizer too (a batch is not padded)."""
    pytest.importorskip("tokenizers")
    from lazyrag.corpus import chunk_documents
    from lazyrag.models.presets import byte_tokenizer

    texts = ["First text. It has two sentences.\n\nAnd a paragraph.", "", words(90) + ".\n" + words(40, 90),
             "short"]
    for tok in (WordTokenizer(), byte_tokenizer()):
        for chunk_tokens in (4, 16, 1000):
            assert chunk_documents(texts, tok, chunk_tokens) == [chunk_document(t, tok, chunk_tokens) for t in texts]
    assert chunk_documents([], WordTokenizer(), 8) == []
    with pytest.raises(ValueError, match="at least 1"):
        chunk_documents(["x"], WordTokenizer(), 0)
