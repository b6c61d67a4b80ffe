"""How many chunk reads a cold run makes before N of its requests have all their chunks, with the
scheduler's read order (lazyrag.serve.scheduler.read_order: the chunks most waiting requests share
first) against the order the requests need them. The requests are bench_e2e's (the paper's
workload, its seed); reads end one at a time, and every waiting request whose chunks have all been
read is admitted at once, the look-ahead refilled in arrival order. A count, not a timing: no
model, no GPU.

    python scripts/read_order.py --requests 200,1000 --lookahead 128
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

from lazyrag.serve import scheduler
from lazyrag.workload import PAPER, draw_docs, words


def bench_requests(n: int) -> list[list[str]]:
    """The documents of bench_e2e's requests when its largest count is n (it draws that many questions
    first, from the same generator; a smaller count takes the first ones)."""
    rng = random.Random(1)
    for _ in range(n):
        words(rng, PAPER.question_tokens)
    return draw_docs(rng, PAPER, n, PAPER.alpha)


def reads_until_ready(requests: list[list[str]], lookahead: int, shared_first: bool) -> list[int]:
    """Requests admitted after each read (index: reads made)."""
    chunks = {doc: SimpleNamespace(chunk_id=doc) for docs in requests for doc in docs}
    source, waiting, read, admitted = iter(requests), [], set(), [0]
    while True:
        waiting += [docs for _, docs in zip(range(lookahead - len(waiting)), source)]
        ready = [docs for docs in waiting if read.issuperset(docs)]
        if ready:
            waiting = [docs for docs in waiting if not read.issuperset(docs)]
            admitted[-1] += len(ready)
            continue
        if not waiting:
            return admitted
        default, scheduler.SHARED_FIRST = scheduler.SHARED_FIRST, shared_first
        try:
            order = scheduler.read_order([chunks[d] for d in docs] for docs in waiting)
        finally:
            scheduler.SHARED_FIRST = default
        read.add(next(c.chunk_id for c in order if c.chunk_id not in read))
        admitted.append(admitted[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="200,1000", help="request counts, comma-separated")
    ap.add_argument("--lookahead", type=int, default=128, help="waiting requests read ahead for (a batch's worth)")
    args = ap.parse_args()
    print("| requests | read order | chunks | reads until 64 / 128 / all ready | ready after 10 / 20 reads |")
    print("|---|---|---|---|---|")
    counts = [int(x) for x in args.requests.split(",")]
    drawn = bench_requests(max(counts))
    for n in counts:
        requests = drawn[:n]
        for shared_first in (True, False):
            admitted = reads_until_ready(requests, args.lookahead, shared_first)
            until = [next(i for i, a in enumerate(admitted) if a >= k) for k in (min(64, n), min(128, n), n)]
            after = [admitted[min(i, len(admitted) - 1)] for i in (10, 20)]
            name = "most shared first" if shared_first else "need order"
            print(f"| {n:,} | {name} | {len(admitted) - 1} | {' / '.join(map(str, until))} | {after[0]} / {after[1]} |")


if __name__ == "__main__":
    main()
