"""Each mode's page needs, page rows (page, delta, start, length), prompt ids and, for block,
its copies; no model. Preamble of 3 tokens, page size 4; chunk a has 6 tokens (2 pages),
chunk b 3 (1 page); the question has 2 tokens and the answer up to 3."""

import pytest
from serve_fakes import PAGE_SIZE, PREAMBLE, chunk, make_cache, sequence

from lazyrag.config import Mode
from lazyrag.serve.modes import Block, ChunkCopy, Full, Lazy, select_mode

A, B = chunk("a", 6), chunk("b", 3)
QUESTION = [7, 8]


def start(mode_class, num_pages=32):
    copies = []
    mode = mode_class(PREAMBLE, PAGE_SIZE, copies.extend)
    cache, _ = make_cache(num_pages)
    return mode, cache, copies


def test_lazy_reads_shared_pages_shifted_to_their_positions():
    mode, cache, copies = start(Lazy)
    preamble = mode.place_preamble(cache)
    assert preamble.tokens == PREAMBLE and preamble.rows.tolist() == [[0, 0, 0, 3]]
    first = sequence("1", [A, B], QUESTION, 3)
    assert mode.prompt_ids(first.request) == QUESTION
    assert mode.pages_needed(first, cache) == 2 + 2 + 1  # own (5 tokens), a, b
    p = mode.place(first, cache)
    # rows: [page, delta, start, length]; a at 3..8 (stored at 3..), b at 9..11 (stored at 3..)
    assert p.rows.tolist() == [[0, 0, 0, 3],
                               [1, 0, 3, 4], [2, 0, 7, 2],
                               [3, 6, 3, 3],
                               [4, 0, 12, 4], [5, 0, 16, 4]]
    assert (p.n_context, p.own_start, p.own_pages, p.private_pages) == (4, 12, [4, 5], [])
    assert [e.info.chunk_id for e in p.pins] == ["a", "b"] and all(e.pins == 1 for e in p.pins)
    assert (first.hits, first.misses) == (0, 2)

    second = sequence("2", [B, A], QUESTION, 3)
    assert mode.pages_needed(second, cache) == 2  # both chunks resident
    p2 = mode.place(second, cache)
    assert p2.rows.tolist() == [[0, 0, 0, 3],
                                [3, 0, 3, 3],
                                [1, 3, 3, 4], [2, 3, 7, 2],
                                [6, 0, 12, 4], [7, 0, 16, 4]]
    assert (second.hits, second.misses) == (2, 0) and p2.pins[1].pins == 2
    assert copies == []
    assert mode.rotate_queries


def test_lazy_pins_resident_chunks_before_loading_the_others():
    mode, cache, _ = start(Lazy, num_pages=5)
    mode.place_preamble(cache)  # page 0
    cache.release(cache.acquire(B))  # page 1, unpinned
    cache.release(cache.acquire(chunk("c", 8)))  # pages 2-3, unpinned, more recent than b
    seq = sequence("1", [A, B], QUESTION, 1)  # own: 3 tokens, 1 page
    p = mode.place(seq, cache)
    # b was pinned first, so loading a evicted c rather than b
    assert cache.is_resident("b") and not cache.is_resident("c")
    assert [e.pages for e in p.pins] == [[2, 3], [1]]


def test_block_copies_each_chunk_to_private_pages_at_its_logical_positions():
    mode, cache, copies = start(Block)
    mode.place_preamble(cache)
    seq = sequence("1", [A, B], QUESTION, 3)
    assert mode.pages_needed(seq, cache) == 2 + (2 + 2) + (1 + 1)  # own, then each chunk and its copy
    p = mode.place(seq, cache)
    assert copies == [ChunkCopy([1, 2], [4, 5], 0), ChunkCopy([3], [6], 6)]
    assert p.rows.tolist() == [[0, 0, 0, 3],
                               [4, 0, 3, 4], [5, 0, 7, 2],
                               [6, 0, 9, 3],
                               [7, 0, 12, 4], [8, 0, 16, 4]]
    assert (p.n_context, p.own_start, p.own_pages, p.private_pages) == (4, 12, [7, 8], [4, 5, 6])
    assert p.pins == [] and cache.available_pages() == 32 - 1 - 5  # the shared copies are evictable now
    assert mode.pages_needed(sequence("2", [A, B], QUESTION, 3), cache) == 2 + 2 + 1
    assert mode.prompt_ids(seq.request) == QUESTION and not mode.rotate_queries


def test_full_recomputes_the_whole_prompt_in_its_own_pages():
    mode, cache, copies = start(Full)
    assert mode.place_preamble(cache) is None
    seq = sequence("1", [A, B], QUESTION, 3)
    prompt = PREAMBLE + list(A.token_ids) + list(B.token_ids) + QUESTION
    assert mode.prompt_ids(seq.request) == prompt
    assert mode.cached_chunks(seq.request) == []
    assert mode.pages_needed(seq, cache) == 5  # 3 + 6 + 3 + 2 + 3 = 17 tokens
    p = mode.place(seq, cache)
    assert p.rows.tolist() == [[0, 0, 0, 4], [1, 0, 4, 4], [2, 0, 8, 4], [3, 0, 12, 4], [4, 0, 16, 4]]
    assert (p.n_context, p.own_start, p.prompt_ids, p.pins) == (0, 0, prompt, [])
    assert cache.counters.lookups == 0 and copies == []


@pytest.mark.parametrize("mode_class", [Lazy, Block, Full])
def test_release_gives_every_page_back(mode_class):
    mode, cache, _ = start(mode_class)
    mode.place_preamble(cache)
    free = cache.available_pages()
    seq = sequence("1", [A, B], QUESTION, 3)
    p = mode.place(seq, cache)
    assert cache.available_pages() < free
    p.release(cache)
    assert cache.available_pages() == free  # chunks stay resident, but unpinned
    assert (p.pins, p.own_pages, p.private_pages) == ([], [], [])


def test_select_mode_takes_the_enum_or_its_value():
    assert select_mode(Mode.LAZY) is Lazy and select_mode("block") is Block and select_mode("full") is Full
    with pytest.raises(ValueError, match="unknown mode 'fast'; choose one of lazy, block, full"):
        select_mode("fast")
