"""Admission without a model: arrival order, the batch size limit, fit checks against the
cache's free and evictable pages, waiting for running requests to free pages, a request
too large for the pool, and an open stream of requests. Lazy mode, preamble of 3 tokens
(page 0), page size 4."""

import threading
import time

import pytest
from serve_fakes import PAGE_SIZE, PREAMBLE, chunk, make_cache, sequence

from lazyrag.serve.modes import Lazy
from lazyrag.serve.paged import OutOfPages
from lazyrag.serve.scheduler import LOOKAHEAD, IDLE_POLL_S, Scheduler

A, B, C = chunk("a", 8), chunk("b", 8), chunk("c", 8)  # 2 pages each
QUESTION = [7, 8]  # with 2 answer tokens: 1 own page


def setup(num_pages, seqs, batch_size=4, lookahead=64):
    cache, loader = make_cache(num_pages)
    mode = Lazy(PREAMBLE, PAGE_SIZE, lambda copies: None)
    mode.place_preamble(cache)
    return Scheduler(mode, cache, batch_size, seqs, lookahead), cache, loader


def finish(seq):
    seq.finished_at = time.perf_counter()


def test_admits_in_arrival_order_up_to_the_batch_size_then_decodes():
    seqs = [sequence(str(i), [A], QUESTION, 2) for i in range(5)]
    sched, _, _ = setup(32, seqs, batch_size=2)
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["0", "1"]
    step = sched.schedule()
    assert not step.prefill and [s.id for s in step.batch] == ["0", "1"]  # the batch is full
    finish(seqs[1])
    assert [s.id for s in sched.retire()] == ["1"]
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["2"]
    assert [s.id for s in sched.running] == ["0", "2"]


def test_decodes_next_only_when_the_same_batch_certainly_decodes_again():
    seqs = [sequence(str(i), [A], QUESTION, 3) for i in range(3)]
    sched, _, _ = setup(32, seqs, batch_size=2)
    step = sched.schedule()
    assert [s.id for s in step.batch] == ["0", "1"] and [s.id for s in sched.waiting] == ["2"]
    assert sched.decodes_next(step.batch, pending=1)  # the batch is full: nobody can be admitted
    assert not sched.decodes_next(step.batch[:1], pending=1)  # not the whole running batch
    for s in step.batch:
        s.generated = [5]
    assert sched.decodes_next(step.batch, pending=1)  # with the pending token: 2 of 3
    seqs[1].generated = [5, 6]
    assert not sched.decodes_next(step.batch, pending=1)  # its pending token is its last
    seqs[1].generated = [5]
    finish(seqs[0])  # a stop token
    assert not sched.decodes_next(step.batch, pending=1)


def test_decodes_next_not_while_a_waiting_request_could_be_admitted():
    first, second = sequence("1", [A], QUESTION, 4), sequence("2", [B], QUESTION, 4)
    sched, _, _ = setup(5, [first, second])  # the second does not fit beside the first
    step = sched.schedule()
    assert [s.id for s in step.batch] == ["1"] and not sched.decodes_next(step.batch, pending=1)
    sched2, _, _ = setup(32, [sequence("3", [A], QUESTION, 4)])
    step = sched2.schedule()
    assert sched2.decodes_next(step.batch, pending=1)  # room in the batch, but nobody waits


def test_fit_counts_resident_chunks_and_pages_eviction_could_free():
    # 8 pages: preamble 1, then a request with one chunk needs 2 + 1
    sched, cache, _ = setup(8, [])
    cache.release(cache.acquire(B))  # resident, unpinned: its 2 pages can be evicted
    cache.alloc(4)                   # held elsewhere: 1 page free
    assert sched.fits(sequence("b", [B], QUESTION, 2))      # b resident: needs 1 own page
    assert sched.fits(sequence("a", [A], QUESTION, 2))      # 3 pages: 1 free + b's 2
    assert not sched.fits(sequence("ab", [A, B], QUESTION, 2))  # b is kept for it: 1 free < 1 + 2
    assert not sched.fits(sequence("long", [A], QUESTION, 3))   # 2 own pages: 4 > 3


def test_a_request_waits_until_running_ones_free_their_pages():
    first, second = sequence("1", [A], QUESTION, 2), sequence("2", [B], QUESTION, 2)
    sched, cache, _ = setup(5, [first, second])  # preamble + one request (3 pages) + 1 spare
    step = sched.schedule()
    assert [s.id for s in step.batch] == ["1"]  # the second does not fit beside it
    step = sched.schedule()
    assert not step.prefill and [s.id for s in step.batch] == ["1"]
    assert [s.id for s in sched.waiting] == ["2"]
    finish(first)
    sched.retire()
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["2"]
    assert not cache.is_resident("a")  # evicted to make room
    finish(second)
    sched.retire()
    assert sched.schedule() is None


def test_a_request_that_can_never_fit_raises():
    sched, _, _ = setup(4, [sequence("huge", [A, B], QUESTION, 2)])  # needs 5 pages, 3 exist besides the preamble
    with pytest.raises(OutOfPages, match="request huge does not fit in the cache even alone"):
        sched.schedule()


def test_a_request_is_not_admitted_before_it_arrives():
    t0 = time.perf_counter()
    sched, _, _ = setup(32, [sequence("later", [A], QUESTION, 2, arrival=t0 + 0.05)])
    step = sched.schedule()
    assert time.perf_counter() - t0 >= 0.05 and [s.id for s in step.batch] == ["later"]


def test_the_chunks_of_the_next_requests_are_prefetched():
    seqs = [sequence("1", [A, B], QUESTION, 2), sequence("2", [C], QUESTION, 2),
            sequence("3", [chunk("d", 4)], QUESTION, 2)]
    sched, _, loader = setup(32, seqs, batch_size=1, lookahead=2)
    sched.schedule()  # looks at 1 and 2 (lookahead), admits 1
    assert loader.prefetched == ["a", "b", "c"]


def test_by_default_the_chunks_of_a_whole_batch_after_the_running_one_are_read_ahead():
    batch = LOOKAHEAD + 36  # larger than the floor: the batch size sets the look-ahead
    seqs = [sequence(str(i), [chunk(f"c{i}", 4)], QUESTION, 2) for i in range(2 * batch + 50)]
    cache, loader = make_cache(2 * batch + 8)
    mode = Lazy(PREAMBLE, PAGE_SIZE, lambda copies: None)
    mode.place_preamble(cache)
    sched = Scheduler(mode, cache, batch, seqs)
    while len(sched.running) < batch:
        assert sched.schedule().prefill
    loader.prefetched = []
    step = sched.schedule()
    assert not step.prefill
    assert loader.prefetched == [f"c{i}" for i in range(batch, 2 * batch)]


def test_the_batch_size_must_be_positive():
    cache, _ = make_cache(4)
    with pytest.raises(ValueError, match="at least 1"):
        Scheduler(Lazy(PREAMBLE, PAGE_SIZE, lambda copies: None), cache, 0, [])


def test_an_open_stream_with_nothing_yet_runs_what_there_is_and_asks_again():
    seqs = [sequence(str(i), [A], QUESTION, 2) for i in range(3)]
    # "0" arrives, then nothing for a while, then "1" and "2"
    sched, _, _ = setup(32, iter([seqs[0], None, None, seqs[1], None, seqs[2]]))
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["0"]  # not held back by the stream's gap
    step = sched.schedule()
    assert not step.prefill and [s.id for s in step.batch] == ["0"]  # the next poll: still nothing
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["1"]
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["2"]
    for seq in seqs:
        finish(seq)
    sched.retire()
    assert sched.schedule() is None  # the stream ended and nothing runs


def test_an_idle_scheduler_waits_between_polls_of_an_open_stream():
    polls = []

    def stream():
        for _ in range(3):
            polls.append(time.perf_counter())
            yield None
        polls.append(time.perf_counter())
        yield sequence("late", [A], QUESTION, 2)

    sched, _, _ = setup(32, stream())
    step = sched.schedule()  # nothing waiting or running: waits for the stream instead of ending
    assert [s.id for s in step.batch] == ["late"]
    assert all(b - a >= IDLE_POLL_S for a, b in zip(polls, polls[1:]))


def reads_end_after(loader, seconds: float, chunks):
    """The reads of `chunks` (in flight now) end after `seconds`, on another thread."""
    def end():
        loader.done += chunks
        loader.in_flight -= {c.chunk_id for c in chunks}
    timer = threading.Timer(seconds, end)
    timer.start()
    return timer


def test_a_request_waits_for_its_chunks_still_being_read_and_the_batch_runs_on():
    seqs = [sequence("1", [A], QUESTION, 2), sequence("2", [B], QUESTION, 2), sequence("3", [C], QUESTION, 2)]
    sched, _, loader = setup(32, seqs)
    loader.in_flight = {"a", "b"}
    t0 = time.perf_counter()
    timer = reads_end_after(loader, 0.05, [A])
    step = sched.schedule()
    timer.join()
    # nothing is placed to read on the step loop while reads are under way; then 1, whose a came
    # (2 waits for b, and 3 keeps its place behind it)
    assert time.perf_counter() - t0 >= 0.05
    assert step.prefill and [s.id for s in step.batch] == ["1"]
    step = sched.schedule()
    assert not step.prefill and [s.id for s in step.batch] == ["1"]  # b still in flight: the batch decodes
    loader.in_flight = set()
    step = sched.schedule()
    # no read under way: 2 is placed (b read at its placement), then 3 (c)
    assert step.prefill and [s.id for s in step.batch] == ["2", "3"]
    assert loader.prefetched[:3] == ["a", "b", "c"]  # none shared: the look-ahead asks in need order


def test_with_nothing_running_the_first_step_waits_for_reads_under_way_and_takes_whom_they_complete():
    seqs = [sequence("1", [A], QUESTION, 2), sequence("2", [B], QUESTION, 2), sequence("3", [B], QUESTION, 2)]
    sched, _, loader = setup(32, seqs)
    loader.in_flight, loader.in_line = {"b"}, {"a"}  # b being read, a waiting its turn
    t0 = time.perf_counter()
    timer = reads_end_after(loader, 0.05, [B])
    step = sched.schedule()
    timer.join()
    assert time.perf_counter() - t0 >= 0.05
    # b came; with no read under way a's turn is not coming: 1 is placed, reading a, and 2 and 3 go with it
    assert step.prefill and [s.id for s in step.batch] == ["1", "2", "3"]
    assert [c for c, _ in loader.loads] == ["b", "a"]


def test_chunks_are_read_ahead_once_each_in_the_order_the_waiting_requests_need_them():
    seqs = [sequence("1", [A, B], QUESTION, 2), sequence("2", [C, B], QUESTION, 2),
            sequence("3", [B], QUESTION, 2), sequence("4", [C], QUESTION, 2)]
    sched, _, loader = setup(32, seqs, batch_size=1)
    sched.schedule()
    assert loader.prefetched[:3] == ["a", "b", "c"]  # b shared by three is still read after a


def test_a_request_whose_chunks_are_all_resident_passes_one_whose_chunks_are_still_being_read():
    seqs = [sequence("1", [A], QUESTION, 3), sequence("2", [B], QUESTION, 3), sequence("3", [A], QUESTION, 3),
            sequence("4", [C], QUESTION, 3), sequence("5", [A], QUESTION, 3)]
    sched, cache, loader = setup(32, seqs, batch_size=4)
    loader.in_flight, loader.done = {"b"}, [A]
    step = sched.schedule()
    # a was read ahead: 1, 3 and 5 go; 2 waits for b; 4's c is neither here nor being read, so it
    # keeps its place behind 2
    assert step.prefill and [s.id for s in step.batch] == ["1", "3", "5"]
    assert cache.is_resident("a") and not cache.is_resident("c")
    assert [s.id for s in sched.waiting] == ["2", "4"]
    step = sched.schedule()
    assert not step.prefill and [s.id for s in step.batch] == ["1", "3", "5"]  # b still in flight
    loader.in_flight = set()
    step = sched.schedule()
    assert step.prefill and [s.id for s in step.batch] == ["2"]  # the batch is full at 4
    assert [s.id for s in sched.waiting] == ["4"]


def test_steps_are_counted_with_the_sequences_they_hold():
    seqs = [sequence("1", [A], QUESTION, 3), sequence("2", [B], QUESTION, 3), sequence("3", [C], QUESTION, 3)]
    sched, _, loader = setup(32, seqs, batch_size=2)
    assert [s.id for s in sched.schedule().batch] == ["1", "2"]
    step = sched.schedule()
    assert not step.prefill
    assert sched.decodes_next(step.batch, pending=1)  # the batch is full: the engine decodes on unasked
    finish(seqs[0])
    sched.retire()
    assert [s.id for s in sched.schedule().batch] == ["3"]
    assert not sched.decodes_next([seqs[1]], pending=1)  # 2 and 3 run: not that batch, not counted
    assert sched.decodes_next(sched.running, pending=1)
    s = sched.steps
    assert (s.prefills, s.prefilled, s.decodes, s.decoded) == (2, 3, 3, 6)


def test_the_read_order_is_made_again_only_when_the_waiting_requests_change(monkeypatch):
    from lazyrag.serve import scheduler as scheduler_module

    calls, original = [], scheduler_module.read_order
    monkeypatch.setattr(scheduler_module, "read_order", lambda needs: calls.append(1) or original(needs))
    seqs = [sequence(str(i), [A], QUESTION, 4) for i in range(3)]
    sched, _, _ = setup(32, seqs, batch_size=2)
    assert [s.id for s in sched.schedule().batch] == ["0", "1"]
    assert not sched.schedule().prefill
    made = len(calls)  # for 0, 1 and 2 waiting, then for 2 alone
    for _ in range(3):
        assert not sched.schedule().prefill  # the batch is full: "2" waits, unchanged
    assert len(calls) == made == 2
    finish(seqs[0])
    sched.retire()
    assert [s.id for s in sched.schedule().batch] == ["2"]
    sched.schedule()
    assert len(calls) == made + 1  # nobody waits now: ordered once for the empty queue
