"""BM25 retrieval over a store's visible chunks: rebuilt when the chunk set changes, kept in
memory when the store cannot be written."""

from cli_tools import TINY, cli, write_jsonl

from lazyrag.retrieve import Retriever
from lazyrag.store import Store


def index(store, corpus):
    res = cli("index", corpus, "--store", store, *TINY, "-q")
    assert res.exit_code == 0, res.output


def test_reindexed_document_is_retrieved_by_its_new_text(tmp_path):
    store, corpus = tmp_path / "s.zarr", tmp_path / "corpus.jsonl"
    write_jsonl(corpus, {"id": "a", "text": "Volcanoes erupt molten basalt."},
                {"id": "b", "text": "Penguins swim in cold southern seas."})
    index(store, corpus)
    with Store.open(store) as st:
        assert st.doc_chunks("a")[0].chunk_id in Retriever(st).top_k("molten basalt volcanoes", 1)
    # the document's text changed: retrieval must find the new chunk, not the replaced one
    write_jsonl(corpus, {"id": "a", "text": "Glaciers carve granite valleys slowly."},
                {"id": "b", "text": "Penguins swim in cold southern seas."})
    index(store, corpus)
    with Store.open(store) as st:
        assert Retriever(st).top_k("glaciers granite valleys", 1) == [st.doc_chunks("a")[0].chunk_id]


def test_store_that_cannot_be_written_keeps_the_index_in_memory(tmp_path):
    store, corpus = tmp_path / "s.zarr", tmp_path / "corpus.jsonl"
    write_jsonl(corpus, {"id": "a", "text": "Volcanoes erupt molten basalt."},
                {"id": "b", "text": "Penguins swim in cold southern seas."})
    index(store, corpus)
    (store / "bm25.tmp").write_text("in the way")  # saving needs this folder: the write fails
    with Store.open(store) as st:
        assert Retriever(st).top_k("penguins", 1) == [st.doc_chunks("b")[0].chunk_id]
    assert not (store / "bm25").exists()
