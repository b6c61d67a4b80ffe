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
