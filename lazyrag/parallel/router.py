"""Which engine answers which query: a plan made once from the chunks each query needs, then
batches handed out as engines have room for them. Pure: no Ray, no torch.

`affinity` (the default) co-locates queries that share chunks, so that each engine's cache
holds a part of the corpus rather than all of it, and balances the chunks each engine must
load: on a cold cache those reads are most of an engine's time. Queries naming the same chunks
form a group. Groups go out rarest first (by the sum over their chunks of 1 / the queries
needing it): a chunk few queries need decides where they go, while the hottest chunks end up
on every engine anyway. Each goes to the engine whose set of chunks stays smallest once it
takes the group (so a chunk is added where it is already held, or else to the engine holding
the fewest), among those under their share of the queries (ceil(queries / engines)), the
least loaded on a tie; a group larger than the room left spills over to the next choice. An
engine's queue keeps each group's queries together. `round-robin` deals the queries in file
order, for comparison.

Each engine has at most `in_flight` batches out at a time. At the tail, an engine whose queue
is empty takes a batch from the back of the longest queue; the queries of an engine that died
go back to the front of its queue, less those already answered (others may take them from its
back meanwhile).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Container, Sequence

from lazyrag.config import ROUTINGS


def plan(queries: Sequence[tuple[str, Sequence[str]]], engines: int, routing: str = "affinity") -> list[list[str]]:
    """Each engine's queue of query ids, from (query id, chunk ids) in file order. Deterministic."""
    if engines < 1:
        raise ValueError(f"need at least one engine, got {engines}")
    queues: list[list[str]] = [[] for _ in range(engines)]
    if routing == "round-robin":
        for i, (qid, _) in enumerate(queries):
            queues[i % engines].append(qid)
        return queues
    if routing != "affinity":
        raise ValueError(f"unknown routing {routing!r}: choose {' or '.join(ROUTINGS)}")
    groups: dict[frozenset[str], list[str]] = {}
    for qid, chunks in queries:
        groups.setdefault(frozenset(chunks), []).append(qid)
    needed = Counter(c for chunks, members in groups.items() for c in chunks for _ in members)
    share = math.ceil(len(queries) / engines)
    owned: list[set[str]] = [set() for _ in range(engines)]
    # sorted() is stable: equal rarities keep the order of their first query
    for chunks, members in sorted(groups.items(), key=lambda g: -sum(1 / needed[c] for c in g[0])):
        while members:
            room = [e for e in range(engines) if len(queues[e]) < share]
            best = min(room, key=lambda e: (len(owned[e] | chunks), len(queues[e]), e))
            take = share - len(queues[best])
            queues[best] += members[:take]
            owned[best] |= chunks
            members = members[take:]
    return queues


class Router:
    """The plan's queues and each engine's batches in flight: every query is in exactly one of
    them until its batch is `done`, so none is sent twice unless its engine died."""

    def __init__(self, queries: Sequence[tuple[str, Sequence[str]]], engines: int, routing: str = "affinity",
                 batch: int = 1, in_flight: int = 2):
        if batch < 1 or in_flight < 1:
            raise ValueError("batch and in_flight must be at least 1")
        self.queues = [deque(q) for q in plan(queries, engines, routing)]
        self.batch, self.in_flight = batch, in_flight
        self.running: list[list[list[str]]] = [[] for _ in range(engines)]

    def take(self, engine: int) -> list[str]:
        """The engine's next batch of query ids, or [] when it has `in_flight` batches out or no
        queue holds anything: from the front of its own queue; once that is empty and the engine
        has nothing out (idle at the tail), from the back of the longest."""
        if len(self.running[engine]) >= self.in_flight:
            return []
        queue = self.queues[engine]
        if queue:
            batch = [queue.popleft() for _ in range(min(self.batch, len(queue)))]
        elif self.running[engine]:
            return []  # work of its own is still running: stealing now would only fill its window
        else:
            longest = max(range(len(self.queues)), key=lambda e: (len(self.queues[e]), -e))
            queue = self.queues[longest]
            if not queue:
                return []
            batch = [queue.pop() for _ in range(min(self.batch, len(queue)))][::-1]
        self.running[engine].append(batch)
        return batch

    def done(self, engine: int, batch: list[str]) -> None:
        """The batch came back answered (or failed query by query)."""
        self.running[engine].remove(batch)

    def requeue(self, engine: int, answered: Container[str] = ()) -> list[str]:
        """The engine died: the queries of its batches in flight go back to the front of its queue,
        in order, less those `answered` (they came back before it died); returns their ids."""
        ids = [qid for batch in self.running[engine] for qid in batch if qid not in answered]
        self.queues[engine].extendleft(reversed(ids))
        self.running[engine] = []
        return ids

    @property
    def finished(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not any(self.queues) and not any(self.running)
