"""BM25 retrieval over a store's visible chunks: built when a query first retrieves, rebuilt when
the chunk set changes or a saved file is damaged, kept in memory when the store cannot be written;
ties broken by document id and chunk index, whatever order the store was built in."""

import shutil

from cli_tools import TINY, cli, rows, write_jsonl

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
        assert st.doc_chunks("a")[0].chunk_id in Retriever.for_store(st).top_k("molten basalt volcanoes", 1)
    # the document's text changed: retrieval must find the new chunk, not the replaced one
    write_jsonl(corpus, {"id": "a", "text": "Glaciers carve granite valleys slowly."},
                {"id": "b", "text": "Penguins swim in cold southern seas."})
    index(store, corpus)
    with Store.open(store) as st:
        assert Retriever.for_store(st).top_k("glaciers granite valleys", 1) == [st.doc_chunks("a")[0].chunk_id]


def test_store_that_cannot_be_written_keeps_the_index_in_memory(tmp_path):
    store, corpus = tmp_path / "s.zarr", tmp_path / "corpus.jsonl"
    write_jsonl(corpus, {"id": "a", "text": "Volcanoes erupt molten basalt."},
                {"id": "b", "text": "Penguins swim in cold southern seas."})
    index(store, corpus)
    (store / "bm25.tmp").write_text("in the way")  # saving needs this folder: the write fails
    with Store.open(store) as st:
        assert Retriever.for_store(st).top_k("penguins", 1) == [st.doc_chunks("b")[0].chunk_id]
    assert not (store / "bm25").exists()


def notes_corpus(folder, numbers):
    folder.mkdir(exist_ok=True)
    for n in numbers:
        (folder / f"note{n}.txt").write_text(f"The answer is forty two, says note {n}.")
    return folder


def test_ties_go_to_the_first_document_whatever_order_the_store_was_built_in(tmp_path):
    at_once, in_steps = tmp_path / "once.zarr", tmp_path / "steps.zarr"
    index(at_once, notes_corpus(tmp_path / "all", [1, 2, 3]))
    index(in_steps, notes_corpus(tmp_path / "steps", [3]))  # note 3's chunk stored first
    index(in_steps, notes_corpus(tmp_path / "steps", [1, 2, 3]))
    found = []
    for store in (at_once, in_steps):
        with Store.open(store) as st:
            # equal scores: the earliest by document id, then chunk index, wins every time
            top = Retriever.for_store(st).top_k("What is the answer?", 1)
            assert top == [st.doc_chunks("note1.txt")[0].chunk_id]
            found.append(Retriever.for_store(st).top_k("What is the answer?", 3))
    assert found[0] == found[1]


def corpus_and_queries(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Alpha is the first letter.\n\nBeta is the second letter.")
    (corpus / "b.txt").write_text("Gamma is the third letter.")
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "q1", "question": "What is alpha?", "docs": ["a.txt"]},
                          {"id": "q2", "question": "What is gamma?"})
    return corpus, queries


def spoil_index(store):
    with open(store / "bm25" / "data.csc.index.npy", "r+b") as f:
        f.write(bytes(range(200, 240)))  # 40 bytes over the header: numpy would ask to unpickle it


def answer(queries, store, out):
    return cli("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--max-new-tokens", "2", "-q")


def test_the_index_is_built_only_when_a_query_retrieves(tmp_path):
    store = tmp_path / "s.zarr"
    corpus, queries = corpus_and_queries(tmp_path)
    index(store, corpus)
    named = write_jsonl(tmp_path / "named.jsonl", {"id": "q1", "question": "What is alpha?", "docs": ["a.txt"]})
    assert answer(named, store, tmp_path / "a.jsonl").exit_code == 0
    assert not (store / "bm25").exists()
    assert answer(queries, store, tmp_path / "b.jsonl").exit_code == 0
    assert (store / "bm25" / "stamp.json").exists()


def test_a_damaged_index_is_rebuilt_by_answer_reported_by_check_and_repaired_by_index(tmp_path):
    store = tmp_path / "s.zarr"
    corpus, queries = corpus_and_queries(tmp_path)
    index(store, corpus)
    assert answer(queries, store, tmp_path / "first.jsonl").exit_code == 0
    spoil_index(store)
    res = cli("check", "--store", store)
    assert res.exit_code == 4 and "retrieval index" in res.stdout and "lazyrag index" in res.stdout, res.output
    res = answer(queries, store, tmp_path / "second.jsonl")
    assert res.exit_code == 0, res.output
    assert "retrieval index is damaged" in res.stderr and "rebuilt from the catalog" in res.stderr
    assert sorted(r["id"] for r in rows(tmp_path / "second.jsonl")) == ["q1", "q2"]
    assert cli("check", "--store", store).exit_code == 0  # answer saved the rebuilt index
    spoil_index(store)
    res = cli("index", corpus, "--store", store, *TINY, "-q")
    assert res.exit_code == 0, res.output
    res = cli("check", "--store", store)
    assert res.exit_code == 0, res.output


def test_stable_top_keeps_position_order_among_equal_scores():
    import numpy as np

    from lazyrag.retrieve import stable_top

    scores = np.array([0.5, 2.0, 1.0, 2.0, 1.0, 0.0, 1.0], dtype=np.float32)
    assert stable_top(scores, 1).tolist() == [1]
    assert stable_top(scores, 3).tolist() == [1, 3, 2]
    assert stable_top(scores, 5).tolist() == [1, 3, 2, 4, 6]
    assert stable_top(scores, 10).tolist() == [1, 3, 2, 4, 6, 0, 5]


def test_a_file_or_link_in_the_index_place_is_replaced_never_followed(tmp_path):
    store = tmp_path / "s.zarr"
    corpus, queries = corpus_and_queries(tmp_path)
    index(store, corpus)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the store's")
    for spoiler in ("file", "link"):
        if spoiler == "file":
            (store / "bm25").write_text("in the way")
        else:
            shutil.rmtree(store / "bm25")
            (store / "bm25").symlink_to(outside)
        assert cli("check", "--store", store).exit_code == 4
        assert answer(queries, store, tmp_path / f"{spoiler}.jsonl").exit_code == 0
        assert (store / "bm25").is_dir() and not (store / "bm25").is_symlink()
        assert cli("check", "--store", store).exit_code == 0
    assert (outside / "keep.txt").read_text() == "not the store's"
