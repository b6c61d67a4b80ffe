"""`lazyrag stats`: the store and its run log, as JSON for scripts or tables for people."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from lazyrag.store import Store
from lazyrag.store.location import StoreURL


def stats_json(store_path: Path | StoreURL) -> dict:
    with Store.open(store_path) as store:
        runs, summary = store.runs(), store.summary()
    return {"path": str(store_path), "store": summary, "runs": runs, "overall": overall(runs)}


def overall(runs: list[dict]) -> dict:
    """Counters summed over runs, ratios recomputed from the sums (not averaged)."""
    keys = ("lookups", "hits", "misses", "lookup_tokens", "hit_tokens", "bytes_read", "bytes_to_gpu", "evictions",
            "recomputed_tokens", "reused_tokens")
    cache = {k: sum(r.get("cache", {}).get(k, 0) for r in runs) for k in keys}
    cache["hit_ratio"] = round(cache["hits"] / cache["lookups"], 4) if cache["lookups"] else 0.0
    cache["token_hit_ratio"] = round(cache["hit_tokens"] / cache["lookup_tokens"], 4) if cache["lookup_tokens"] else 0.0
    recomputed = cache["recomputed_tokens"] + cache["reused_tokens"]
    cache["reuse_ratio"] = round(cache["reused_tokens"] / recomputed, 4) if recomputed else 0.0
    return {"runs": len(runs), "queries": sum(r["queries"] for r in runs), "cache": cache,
            "new_tokens": sum(r.get("new_tokens", 0) for r in runs)}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:,.1f}"


def render_stats(data: dict, console: Console) -> None:
    s = data["store"]
    t = Table(title="store", show_header=False, title_justify="left")
    t.add_column("key")
    t.add_column("value", overflow="fold")  # a long path folds onto more lines, never cut
    for label, value in [("path", data["path"]), ("model", s["model"]), ("fingerprint", s["fingerprint"][:16]),
                         ("documents", f"{s['documents']:,}"), ("chunks", f"{s['chunks']:,}"),
                         ("tokens", f"{s['tokens']:,}"), ("on disk", _gb(s["bytes"])), ("kv dtype", s["kv_dtype"]),
                         ("page size", str(s["page_size"])), ("segments", str(s["segments"])),
                         ("created", str(s["created"])), ("updated", str(s["updated"]))]:
        t.add_row(label, str(value))
    console.print(t)
    if data["runs"]:
        runs_table(data["runs"], console)
    else:
        console.print("no answer runs yet")


def table(title: str, columns: tuple[str, ...]) -> Table:
    """A table without vertical rules, numbers right-aligned: at most seven short columns of
    these fit an 80-column terminal whole (a bordered one of nine cut its cells)."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="right", overflow="fold")
    return t


def runs_table(runs: list[dict], console: Console) -> None:
    """Narrow tables (they must fit an 80-column terminal): speed and quality, latency, the cache
    and its memory, and the distance to full attention of the runs that were audited."""
    t = table("answer runs", ("#", "mode", "queries", "hit ratio", "tok/s", "accuracy", "F1"))
    for i, r in enumerate(runs, 1):
        q = r.get("quality", {})
        t.add_row(str(i), r["mode"], str(r["queries"]), f"{r['cache']['hit_ratio']:.1%}",
                  f"{r['tokens_per_s'] or 0:,.1f}", f"{q['accuracy']:.1%}" if q else "-", f"{q['f1']:.3f}" if q else "-")
    console.print(t)
    t = table("latency (ms)", ("#", "TTFT p50", "TTFT p95", "latency p50", "latency p95"))
    for i, r in enumerate(runs, 1):
        t.add_row(str(i), _ms(r["ttft_ms"], "p50"), _ms(r["ttft_ms"], "p95"), _ms(r["latency_ms"], "p50"),
                  _ms(r["latency_ms"], "p95"))
    console.print(t)
    t = table("cache", ("#", "lookups", "hits", "misses", "token hits", "evictions"))
    for i, r in enumerate(runs, 1):
        c = r["cache"]
        t.add_row(str(i), str(c["lookups"]), str(c["hits"]), str(c["misses"]), f"{c['token_hit_ratio']:.1%}",
                  str(c["evictions"]))
    console.print(t)
    t = table("cache memory", ("#", "from disk", "to pool", "peak pages", "pool pages"))
    for i, r in enumerate(runs, 1):
        c = r["cache"]
        t.add_row(str(i), _gb(c["bytes_read"]), _gb(c["bytes_to_gpu"]), f"{c['peak_pages']:,}", f"{c['pool_pages']:,}")
    console.print(t)
    if any(r["cache"].get("recomputed_tokens") or r["cache"].get("reused_tokens") for r in runs):
        recompute_table(runs, console)
    for i, r in enumerate(runs, 1):
        for e in r.get("engines", []):  # runs of `answer --data-parallel`: a line per engine
            restarts = f", restarted {e['restarts']}x" if e["restarts"] else ""
            console.print(f"#{i} engine {e['engine']} ({e['device']} on {e['node']}): {e['queries']} queries, "
                          f"hit ratio {e['hit_ratio']:.1%}, TTFT p50 {_ms(e['ttft_ms'], 'p50')} ms, "
                          f"{_gb(e['cache']['bytes_read'])} read{restarts}", highlight=False)
    for i, r in enumerate(runs, 1):
        if r.get("kind") == "bench":  # `lazyrag bench`: its rows are in the record (stats --json)
            console.print(f"#{i} bench: {len(r['configurations'])} configurations on {r['sample']} queries "
                          f"({', '.join(r['configurations'])})", highlight=False)
    if any("audit" in r for r in runs):
        audit_table(runs, console)


def recompute_table(runs: list[dict], console: Console) -> None:
    """Selective recompute per run: the chunk tokens recomputed, and those reused from the cache."""
    t = table("selective recompute", ("#", "F", "policy", "order", "recomputed", "reused", "reuse"))
    for i, r in enumerate(runs, 1):
        c, s = r["cache"], r.get("settings", {})
        done, reused = c.get("recomputed_tokens", 0), c.get("reused_tokens", 0)
        t.add_row(str(i), f"{s.get('recompute', 0):g}", str(s.get("recompute_policy", "-")),
                  str(s.get("chunk_order", "given")), f"{done:,}", f"{reused:,}",
                  f"{reused / (done + reused):.1%}" if done + reused else "-")
    console.print(t)


def audit_table(runs: list[dict], console: Console) -> None:
    """The audited runs (`answer --audit N`, lazyrag/commands/audit.py): how far each mode is from full."""
    t = table("vs full attention (audit)", ("#", "mode", "queries", "identical", "F1 to full", "KL/token", "top-1",
                                           "tokens"))
    for i, r in enumerate(runs, 1):
        if a := r.get("audit"):
            t.add_row(str(i), r["mode"], str(a["queries"]), f"{a['identical']:.1%}", f"{a['f1_to_full']:.3f}",
                      f"{a['kl_mean']:.3g}", f"{a['top1_agreement']:.1%}", str(a["tokens"]))
    console.print(t)


def render_run(record: dict, console: Console) -> None:
    console.print(f"answered {record['queries']} queries in {record['seconds']:.1f}s -> {record['out']}")
    if record["queries"]:
        runs_table([record], console)
