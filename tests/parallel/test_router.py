"""The router without Ray: the affinity plan's exact assignments, its balance, round-robin,
batches in flight, tail stealing, and the requeue of a dead engine's queries not yet answered."""

import random

import pytest

from lazyrag.parallel.router import Router, plan


def test_affinity_keeps_queries_sharing_chunks_together():
    queries = [("a1", ["x"]), ("b1", ["y"]), ("a2", ["x"]), ("c1", ["x", "z"]), ("b2", ["y"]), ("d1", ["w"])]
    # rarest groups first (x is needed 3 times, y twice, z and w once): {x,z}: c1 -> e0; {w}: d1 -> e1
    # (its set of chunks stays smaller there); {y}: b1 b2 -> e1 for the same reason; {x}: a1 a2 -> e0,
    # which holds x and is under its share of 3: 4 chunk loads in all, the fewest possible
    assert plan(queries, 2) == [["c1", "a1", "a2"], ["d1", "b1", "b2"]]


def test_a_group_larger_than_a_share_spills_to_the_next_engine():
    queries = [(f"q{i}", ["x"]) for i in range(5)] + [("r", ["y"])]
    # {y} is rarer and goes first, to e0; {x} then fills e1 to its share of 3 and spills to e0
    assert plan(queries, 2) == [["r", "q3", "q4"], ["q0", "q1", "q2"]]


def test_round_robin_deals_in_file_order():
    queries = [(f"q{i}", ["x"]) for i in range(5)]
    assert plan(queries, 2, "round-robin") == [["q0", "q2", "q4"], ["q1", "q3"]]


def test_the_plan_is_balanced_and_deterministic():
    rng = random.Random(0)
    queries = [(f"q{i}", rng.sample("abcdefghij", 2)) for i in range(101)]
    queues = plan(queries, 4)
    assert sorted(q for queue in queues for q in queue) == sorted(q for q, _ in queries)
    assert max(len(q) for q in queues) <= 26  # each at most its share, ceil(101 / 4)
    assert plan(queries, 4) == queues


def test_affinity_reads_fewer_chunks_per_engine_than_round_robin():
    rng = random.Random(1)
    docs = [[f"d{d}c{c}" for c in range(3)] for d in range(8)]
    queries = [(f"q{i}", docs[rng.randrange(8)]) for i in range(80)]

    def chunk_loads(queues):  # each engine reads each of its chunks once
        chunks = dict(queries)
        return sum(len({c for q in queue for c in chunks[q]}) for queue in queues)

    assert chunk_loads(plan(queries, 4)) < chunk_loads(plan(queries, 4, "round-robin"))


def test_affinity_balances_the_chunks_each_engine_loads():
    # Zipf-skewed documents, 5 per query: the hot ones go everywhere, the rare ones split evenly,
    # so no engine has to load (on a cold cache: read) most of the corpus
    rng = random.Random(2)
    weights = [1 / (k + 1) ** 2.1 for k in range(100)]
    queries = []
    for i in range(400):
        docs = set()
        while len(docs) < 5:
            docs.add(f"d{rng.choices(range(100), weights)[0]}")
        queries.append((f"q{i}", sorted(docs)))
    chunks = dict(queries)

    def loads(queues):
        return [len({c for q in queue for c in chunks[q]}) for queue in queues]

    distinct = len({c for _, cs in queries for c in cs})
    affinity, round_robin = loads(plan(queries, 2)), loads(plan(queries, 2, "round-robin"))
    assert sum(affinity) < sum(round_robin) and max(affinity) < max(round_robin)
    assert max(affinity) < 0.75 * distinct  # one engine alone would load all of them
    assert max(affinity) - min(affinity) <= 2


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        plan([("q", ["x"])], 2, "random")


def test_batches_in_flight_are_bounded_per_engine():
    router = Router([(f"q{i}", [f"c{i % 2}"]) for i in range(8)], 2, "round-robin", batch=1, in_flight=2)
    assert router.take(0) == ["q0"] and router.take(0) == ["q2"]
    assert router.take(0) == []  # two out already
    router.done(0, ["q0"])
    assert router.take(0) == ["q4"]


def test_an_idle_engine_takes_batches_from_the_back_of_the_longest_queue():
    queries = [(f"a{i}", ["x"]) for i in range(6)] + [("b0", ["y"])]
    assert plan(queries, 2) == [["b0", "a4", "a5"], ["a0", "a1", "a2", "a3"]]
    router = Router(queries, 2, batch=2, in_flight=1)
    assert router.take(0) == ["b0", "a4"]
    router.done(0, ["b0", "a4"])
    assert router.take(0) == ["a5"]
    router.done(0, ["a5"])
    assert router.take(0) == ["a2", "a3"]  # engine 1's tail, in order
    assert router.take(1) == ["a0", "a1"]
    router.done(1, ["a0", "a1"])
    router.done(0, ["a2", "a3"])
    assert router.take(1) == [] and router.finished


def test_a_dead_engines_queries_go_back_to_the_front_of_its_queue_once():
    router = Router([(f"q{i}", ["x"]) for i in range(6)], 2, "round-robin", batch=1, in_flight=2)
    assert router.take(0) == ["q0"] and router.take(0) == ["q2"] and router.take(1) == ["q1"]
    router.done(0, ["q0"])
    assert router.requeue(0) == ["q2"]  # q0 came back answered: not sent again
    assert list(router.queues[0]) == ["q2", "q4"]
    sent = [router.take(0), router.take(0)]
    assert sent == [["q2"], ["q4"]]
    for batch in sent:
        router.done(0, batch)
    router.done(1, ["q1"])
    # engine 1's own queue still holds q3 and q5: each query sent once more, none twice
    assert router.take(1) == ["q3"] and router.take(0) == ["q5"]
    router.done(1, ["q3"])
    router.done(0, ["q5"])
    assert router.finished


def test_a_dead_engines_queries_that_came_back_before_it_died_are_not_requeued():
    router = Router([(f"q{i}", ["x"]) for i in range(6)], 1, batch=2, in_flight=2)
    assert router.take(0) == ["q0", "q1"] and router.take(0) == ["q2", "q3"]
    assert router.requeue(0, answered={"q0", "q3"}) == ["q1", "q2"]
    assert router.take(0) == ["q1", "q2"] and router.take(0) == ["q4", "q5"]


def test_an_engine_steals_only_when_idle_not_to_fill_its_window():
    queries = [(f"a{i}", ["x"]) for i in range(4)] + [(f"b{i}", ["y"]) for i in range(4)]
    router = Router(queries, 2, batch=2, in_flight=3)
    assert router.take(0) == ["a0", "a1"] and router.take(0) == ["a2", "a3"]
    assert router.take(0) == []  # its own work is out: engine 1's queue is left to engine 1
    assert router.take(1) == ["b0", "b1"]
    router.done(0, ["a0", "a1"])
    router.done(0, ["a2", "a3"])
    assert router.take(0) == ["b2", "b3"]  # idle now: the back of the longest queue
