"""--chunk-order popular: each request's documents most used first, ties and chunks within a
document in the given order (no model)."""

from lazyrag.serve.ordering import PopularFirst, documents, shared_prefixes
from lazyrag.store import ChunkInfo


def chunk(doc: str, ordinal: int) -> ChunkInfo:
    return ChunkInfo(f"{doc}{ordinal}", doc, ordinal, (1, 2), "", "seg", 0, 2, 2)


def ids(chunks):
    return [c.chunk_id for c in chunks]


A, B, C, D = ([chunk(d, 0), chunk(d, 1)] if d == "a" else [chunk(d, 0)] for d in "abcd")


def test_a_documents_chunks_are_one_run():
    assert [ids(r) for r in documents(A + B + A[:1])] == [["a0", "a1"], ["b0"], ["a0"]]


def test_the_most_used_documents_lead_every_prompt_and_ties_keep_the_given_order():
    requests = [C + B + A, B + A, D + A, C + D]  # a: 3 uses, b: 2, c: 2, d: 2
    popular = PopularFirst(requests)
    assert ids(popular.order(C + B + A)) == ["a0", "a1", "c0", "b0"]  # a first, then c and b as given
    assert ids(popular.order(B + A)) == ["a0", "a1", "b0"]
    assert ids(popular.order(D + A)) == ["a0", "a1", "d0"]
    assert ids(popular.order(C + D)) == ["c0", "d0"]
    # two requests over the same documents in different orders now share their leading chunks
    assert popular.order(C + B + A)[:2] == popular.order(B + A)[:2]


def test_a_run_where_every_document_is_used_once_keeps_every_order():
    requests = [C + A, D + B]
    popular = PopularFirst(requests)
    assert [ids(popular.order(r)) for r in requests] == [ids(r) for r in requests]


def test_a_document_named_twice_in_one_request_counts_once():
    popular = PopularFirst([B + C + B, C, D + A])
    assert popular.uses[("b0",)] == 1 and popular.uses[("c0",)] == 2


def test_a_prompts_shared_prefix_is_the_leading_chunks_enough_prompts_start_with():
    prompts = [A + B + C, A + B + D, A + C, B + A]  # a0 a1 lead three prompts, a0 a1 b0 two
    assert shared_prefixes(prompts, 2) == [3, 3, 2, 0]
    assert shared_prefixes(prompts, 3) == [2, 2, 2, 0]
    assert shared_prefixes(prompts, 4) == [0, 0, 0, 0]
    assert shared_prefixes(prompts, 1) == [4, 4, 3, 3]  # every prompt shares itself
    assert shared_prefixes(prompts, None) == [0, 0, 0, 0]
