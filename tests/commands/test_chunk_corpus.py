"""index chunks its corpus a batch of documents per tokenizer call: the same chunks as one
document at a time, a later document of an id replacing an earlier one."""

from lazyrag.commands import index
from lazyrag.commands.index import chunk_corpus, store_settings, stored_chunks
from lazyrag.corpus import Document
from lazyrag.models import load_model


def test_batches_give_each_documents_own_chunks(monkeypatch):
    loaded = load_model("random:tiny", "cpu")
    settings = store_settings(loaded, "random:tiny", 16, 16)
    docs = [Document(f"d{i}", f"Document {i}. " + "word " * (7 * i) + "end.\n\nMore.", None, f"c.jsonl:{i}")
            for i in range(5)]
    docs.append(Document("d1", "The second d1.", None, "c.jsonl:6"))
    calls = []
    tokenize = loaded.tokenizer.__class__.__call__

    def counted(self, texts, **kw):
        calls.append(len(texts))
        return tokenize(self, texts, **kw)

    monkeypatch.setattr(loaded.tokenizer.__class__, "__call__", counted)
    monkeypatch.setattr(index, "TOKENIZED_AT_ONCE", 4)
    got = chunk_corpus(iter(docs), loaded.tokenizer, settings)
    assert calls == [4, 2]
    assert list(got) == ["d0", "d1", "d2", "d3", "d4"]
    alone = {d.id: stored_chunks([d], loaded.tokenizer, settings)[0] for d in docs}  # the later d1 wins
    assert got == alone
    assert [c.text for c in got["d1"]] == ["The second d1."]
    assert sum(len(c) for c in got.values()) > len(got)  # some documents are cut in several chunks
