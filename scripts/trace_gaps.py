#!/usr/bin/env python
"""Where the GPU waits: a profiler trace's idle time on the GPU, by the host phase that ran meanwhile.

Reads a Chrome trace written by `bench_e2e.py --profile N --trace` (gzipped or not), merges the
GPU's kernels and copies into busy intervals, says how much of the copies' time kernels ran beside
them, and for each labelled host range (`lazyrag.*`, see bench_e2e.labelled_phases) adds up its
wall time and the GPU's idle time inside it.

Usage: python scripts/trace_gaps.py trace-lazy.json.gz [trace-block.json.gz ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def merged(intervals: np.ndarray) -> np.ndarray:
    """Union of [start, end) intervals, sorted and disjoint."""
    if not len(intervals):
        return intervals.reshape(0, 2)
    iv = intervals[np.argsort(intervals[:, 0])]
    out = [iv[0].copy()]
    for a, b in iv[1:]:
        if a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append(np.array([a, b]))
    return np.array(out)


def length(intervals: np.ndarray) -> float:
    """Total length of disjoint intervals (us)."""
    return float((intervals[:, 1] - intervals[:, 0]).sum()) if len(intervals) else 0.0


def overlap(ranges: np.ndarray, gaps: np.ndarray) -> float:
    """Total length of each range's intersection with the disjoint sorted gaps (us)."""
    total = 0.0
    starts = gaps[:, 0]
    for a, b in ranges:
        i = max(0, np.searchsorted(starts, a) - 1)
        while i < len(gaps) and gaps[i, 0] < b:
            total += max(0.0, min(b, gaps[i, 1]) - max(a, gaps[i, 0]))
            i += 1
    return total


def summarize(events: list[dict]) -> str:
    def intervals(categories) -> np.ndarray:
        return np.array([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                         if e.get("cat") in categories and e.get("ph") == "X"], float).reshape(-1, 2)

    gpu = intervals(GPU_CATEGORIES)
    labels = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("lazyrag.") and e.get("ph") == "X":
            labels[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    if not len(gpu):
        return "no GPU events in the trace"
    busy = merged(gpu)
    lo = min(busy[0, 0], min((r[0][0] for r in labels.values()), default=busy[0, 0]))
    hi = max(busy[-1, 1], max((max(b for _, b in r) for r in labels.values()), default=busy[-1, 1]))
    edges = np.concatenate([[lo], busy.ravel(), [hi]]).reshape(-1, 2)
    gaps = edges[edges[:, 1] > edges[:, 0]]
    span, idle = hi - lo, float((gaps[:, 1] - gaps[:, 0]).sum())
    kernels, copies = (length(merged(intervals(c))) for c in ({"kernel"}, {"gpu_memcpy", "gpu_memset"}))
    both = kernels + copies - (span - idle)  # copies that ran while a kernel did
    lines = [f"span {span / 1e3:.1f} ms, GPU busy {(span - idle) / 1e3:.1f} ms ({1 - idle / span:.1%}), "
             f"idle {idle / 1e3:.1f} ms in {len(gaps)} gaps (largest {np.sort(gaps[:, 1] - gaps[:, 0])[-5:][::-1].round(0).tolist()} us)",
             f"kernels {kernels / 1e3:.1f} ms, copies {copies / 1e3:.1f} ms, of them {both / 1e3:.1f} ms "
             f"({both / copies if copies else 0:.0%}) while kernels ran",
             "| host phase | calls | wall ms | GPU idle inside, ms |", "|---|---:|---:|---:|"]
    rows = []
    for name, ranges in labels.items():
        r = merged(np.array(ranges, float))
        rows.append((overlap(r, gaps), name, len(ranges), float((r[:, 1] - r[:, 0]).sum())))
    for idle_in, name, calls, wall in sorted(rows, reverse=True):
        lines.append(f"| {name.removeprefix('lazyrag.')} | {calls} | {wall / 1e3:.1f} | {idle_in / 1e3:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", type=Path, nargs="+")
    for path in ap.parse_args().traces:
        print(f"## {path.name}\n{summarize(load(path))}\n")


if __name__ == "__main__":
    main()
