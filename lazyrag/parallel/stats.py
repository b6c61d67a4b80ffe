"""Each engine's share of a run, for the run record's `engines`, and the cache counters summed
over them for its `cache`. An engine that was restarted reports the counters of every life."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lazyrag.eval import scoring
from lazyrag.serve.cache import CacheCounters


def sum_counters(counters: list[dict]) -> CacheCounters:
    """The sum of CacheCounters.to_json() dicts (the ratios recomputed from the sums; the page
    size is the same in every engine)."""
    total = {f.name: sum(c[f.name] for c in counters) for f in fields(CacheCounters) if f.name != "page_bytes"}
    return CacheCounters(**total, page_bytes=max((c["page_bytes"] for c in counters), default=0))


@dataclass
class EngineStats:
    device: str = ""
    node: str = ""
    queries: int = 0
    restarts: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    past_lives: list[dict] = field(default_factory=list)  # the last counters of each life before a restart
    counters: dict | None = None                          # this life's, as of its last answers collected

    def answered(self, row: dict) -> None:
        self.queries += 1
        self.ttft_ms.append(row["ttft_ms"])

    def restarted(self) -> None:
        if self.counters is not None:
            self.past_lives.append(self.counters)
        self.counters = None
        self.restarts += 1

    def cache(self) -> CacheCounters:
        return sum_counters(self.past_lives + ([self.counters] if self.counters else []))

    def to_json(self, index: int) -> dict:
        cache = self.cache()
        return {"engine": index, "device": self.device, "node": self.node, "queries": self.queries,
                "restarts": self.restarts, "hit_ratio": round(cache.hit_ratio, 4), "cache": cache.to_json(),
                "ttft_ms": scoring.summarize(self.ttft_ms)}
