"""scripts/read_order.py: the reads a cold run makes before its requests have all their chunks,
replayed by hand on a small case and counted on bench_e2e's requests."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("read_order_script", ROOT / "scripts" / "read_order.py")
read_order = importlib.util.module_from_spec(spec)
spec.loader.exec_module(read_order)


def test_a_small_case_by_hand():
    requests = [["a", "x"], ["b"], ["b", "c"], ["b", "c"]]
    # shared first: b (3), then c (2), then a and x (1 each, in need order)
    assert read_order.reads_until_ready(requests, lookahead=4, shared_first=True) == [0, 1, 3, 3, 4]
    # need order: a, x, b, c
    assert read_order.reads_until_ready(requests, lookahead=4, shared_first=False) == [0, 0, 1, 2, 4]
    # a look-ahead of one: each request alone, in arrival order
    assert read_order.reads_until_ready(requests, lookahead=1, shared_first=True) == [0, 0, 1, 2, 4]


def test_bench_requests_are_a_prefix_of_the_largest_draw_and_the_default_order_is_restored():
    from lazyrag.serve import scheduler

    assert read_order.bench_requests(1000)[:200] != read_order.bench_requests(200)  # drawn after as many questions
    assert scheduler.SHARED_FIRST
    read_order.reads_until_ready(read_order.bench_requests(50), lookahead=16, shared_first=False)
    assert scheduler.SHARED_FIRST
