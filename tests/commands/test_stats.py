"""`lazyrag stats`: counters summed over runs, ratios recomputed from the sums."""

from lazyrag.commands.stats import overall


def run(lookups, hits, lookup_tokens, hit_tokens, queries, new_tokens):
    cache = {"lookups": lookups, "hits": hits, "misses": lookups - hits, "lookup_tokens": lookup_tokens,
             "hit_tokens": hit_tokens, "bytes_read": 10, "bytes_to_gpu": 20, "evictions": 1,
             "hit_ratio": hits / lookups, "token_hit_ratio": hit_tokens / lookup_tokens}
    return {"cache": cache, "queries": queries, "new_tokens": new_tokens}


def test_overall_sums_counters_and_recomputes_ratios():
    total = overall([run(10, 9, 100, 90, 2, 7), run(30, 3, 300, 30, 5, 11)])
    assert total["runs"] == 2 and total["queries"] == 7 and total["new_tokens"] == 18
    c = total["cache"]
    assert (c["lookups"], c["hits"], c["misses"], c["bytes_read"], c["evictions"]) == (40, 12, 28, 20, 2)
    assert c["hit_ratio"] == 0.3 and c["token_hit_ratio"] == 0.3  # not the mean of 0.9 and 0.1


def test_overall_of_no_runs_is_zero():
    total = overall([])
    assert total["runs"] == 0 and total["cache"]["hit_ratio"] == 0.0 and total["cache"]["lookups"] == 0


def big_run() -> dict:
    """A run record with every table's widest values: large counters, times and an audit."""
    cache = {"lookups": 1_234_567, "hits": 1_000_000, "misses": 234_567, "token_hit_ratio": 0.8123,
             "hit_ratio": 0.8101, "evictions": 987_654, "bytes_read": 123.45e9, "bytes_to_gpu": 98.76e9,
             "peak_pages": 1_234_567, "pool_pages": 9_876_543, "recomputed_tokens": 12_345_678,
             "reused_tokens": 98_765_432}
    times = {"mean": 12_345.6, "p50": 12_345.6, "p95": 123_456.7}
    return {"mode": "block", "queries": 123_456, "seconds": 1234.5, "out": "a.jsonl", "cache": cache,
            "ttft_ms": times, "latency_ms": times, "tokens_per_s": 12_345.6, "new_tokens": 1_000_000,
            "quality": {"accuracy": 0.5, "em": 0.25, "f1": 0.333},
            "settings": {"recompute": 0.1, "recompute_policy": "attention", "chunk_order": "popular"},
            "audit": {"queries": 1000, "identical": 0.175, "f1_to_full": 0.66, "kl_mean": 0.0123,
                      "top1_agreement": 0.91, "tokens": 16_000}}


def test_every_stats_table_fits_80_columns_whole():
    import io

    from rich.console import Console

    from lazyrag.commands.stats import render_stats

    data = {"path": "demo.zarr", "runs": [big_run(), big_run()],
            "store": {"model": "smollm2-135m", "fingerprint": "f" * 64, "documents": 123_456, "chunks": 1_234_567,
                      "tokens": 123_456_789, "bytes": 123e9, "kv_dtype": "bfloat16", "page_size": 64,
                      "segments": 1234, "created": "2026-12-03T08:00:00+00:00", "updated": "2026-12-03T09:00:00+00:00"}}
    console = Console(file=io.StringIO(), width=80, soft_wrap=True)
    render_stats(data, console)
    printed = console.file.getvalue()
    assert "selective recompute" in printed and "vs full attention" in printed
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    assert "…" not in printed  # nothing cut to fit
    for whole in ("1,234,567", "9,876,543", "123,456.7", "12,345,678", "98,765,432", "123.45 GB"):
        assert whole in printed, whole
