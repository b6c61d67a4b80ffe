"""`lazyrag bench`: a seeded sample of the user's queries answered in each configuration asked
for (mode x recompute x batch size), each on a fresh engine and cache (cold) and, with --warm,
a second time on the same engine; one row per pass with its speed, its cache and its distance
to `full` on the same sample (measured as `answer --audit` measures it: lazyrag/commands/audit.py).

Every configuration reuses the answer path: QueryEngine builds the engine and the requests,
ChunkResolver gives each query its chunks and QueryEngine.requests their order. The model loads once. No
answers file is written; the run log gets one record of kind `bench` holding every row.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

import torch

from lazyrag.commands.answer_run import RecordSink
from lazyrag.commands.answer_engine import QueryEngine, load_model_for
from lazyrag.commands.audit import FullReference, forced_logits, full_reference
from lazyrag.commands.queries import ChunkResolver, Query, read_queries
from lazyrag.config import AnswerConfig, BenchConfig, IndexConfig, Mode
from lazyrag.errors import InputError
from lazyrag.eval import scoring
from lazyrag.eval.fidelity import fidelity
from lazyrag.models import resolve_device
from lazyrag.serve import Sequence, faults
from lazyrag.serve.loader import pin_staging_ahead
from lazyrag.serve.staging import wait_staging_pinned
from lazyrag.store import ChunkInfo, Store, StoreError
from lazyrag.store.format import timestamp
from lazyrag.workload import SYNTHETIC, Workload, documents, write_jsonl
from lazyrag.workload import queries as synthetic_queries

# The keys of each row of `bench --json` (and of the run record's `bench` list), documented in
# `lazyrag bench --help` and README: what one pass of one configuration measured.
ROW_KEYS = {
    "mode": "lazy, block or full",
    "recompute": "the recompute share (null for full)",
    "batch_size": "most requests in flight",
    "pass": "cold (fresh engine and cache) or warm (the same engine again)",
    "queries": "queries answered",
    "seconds": "the pass's wall time, engine built",
    "req_per_s": "queries per second",
    "ttft_p50_ms": "time to first token, median",
    "ttft_p95_ms": "time to first token, 95th percentile",
    "latency_p50_ms": "time to the last token, median",
    "hit_ratio": "chunk lookups found in the cache",
    "kv_peak_bytes": "most page-pool bytes in use at once",
    "bytes_read": "chunk bytes read from the store",
    "recomputed_tokens": "chunk tokens recomputed (selective recompute)",
    "reused_tokens": "recomputed chunk tokens read from the cache instead",
    "reuse_ratio": "reused / (recomputed + reused)",
    "identical": "answers equal to full's",
    "f1_to_full": "token F1 to full's answers",
    "kl_mean": "KL(full || mode) per token along full's answer, nats",
    "top1_agreement": "share of those tokens whose argmax is full's",
    "new_tokens": "answer tokens generated",
    "failed": "queries that failed (named once on stderr)",
}


@dataclass(frozen=True)
class Setting:
    """One configuration: a mode, its recompute share (None for full) and a batch size."""

    mode: Mode
    recompute: float | None
    batch_size: int

    def label(self) -> str:
        return self.mode.value if self.recompute is None else f"{self.mode.value} {self.recompute:g}"


@dataclass
class Pass:
    """What one pass over the sample left: each answered query's sequence, and the cache's counters."""

    seconds: float
    seqs: dict[str, Sequence]
    rows: dict[str, dict]
    cache: dict
    failed: int = 0


def plan(cfg: BenchConfig) -> list[Setting]:
    """The configurations, full first (the reference, once, at the first batch size); InputError,
    in one line, for a bad list. Checked before the model loads."""
    modes = _items(cfg.modes, "--modes", _mode)
    shares = _items(cfg.recompute, "--recompute", _share)
    sizes = _items(cfg.batch_sizes, "--batch-sizes", _batch_size)
    if cfg.limit < 1:
        raise InputError(f"--limit {cfg.limit}: sample at least one query")
    if (cfg.answer.queries is None) == (cfg.synthetic is None):
        raise InputError("name a QUERIES file or --synthetic paper|uniform (one of the two)")
    synthetic_workload(cfg)
    settings = [Setting(Mode.FULL, None, sizes[0])] if Mode.FULL in modes else []
    settings += [Setting(m, r, b) for m in dict.fromkeys(modes) if m is not Mode.FULL
                 for r in dict.fromkeys(shares) for b in dict.fromkeys(sizes)]
    return settings


def _items(text: str, option: str, parse: Callable[[str, str], object]) -> list:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise InputError(f"{option} {text!r}: give a comma-separated list with no empty item")
    return [parse(t, option) for t in items]


def _mode(text: str, option: str) -> Mode:
    try:
        return Mode(text)
    except ValueError:
        raise InputError(f"{option}: unknown mode {text!r}; choose from {', '.join(m.value for m in Mode)}") from None


def _share(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise InputError(f"{option}: {text!r} is not a share in [0, 1] (0 is off, 1 recomputes every page)")
    return value


def _batch_size(text: str, option: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"{option}: {text!r} is not a whole number of requests of at least 1")
    return int(text)


def synthetic_workload(cfg: BenchConfig) -> Workload | None:
    """--synthetic's workload, scaled by --docs and --doc-tokens; InputError for an unknown name."""
    if cfg.synthetic is None:
        return None
    if cfg.synthetic not in SYNTHETIC:
        raise InputError(f"--synthetic {cfg.synthetic!r}: choose {' or '.join(SYNTHETIC)}")
    w = SYNTHETIC[cfg.synthetic]
    return replace(w, docs=cfg.docs or w.docs, doc_tokens=cfg.doc_tokens or w.doc_tokens)


def write_synthetic(cfg: BenchConfig, w: Workload, progress: bool) -> BenchConfig:
    """The workload's corpus and --limit queries under --work, the corpus indexed into the store
    (`lazyrag index`'s own path: what is there already is kept); cfg with its queries file."""
    from lazyrag.commands.index import build_index

    corpus = write_jsonl(cfg.work / "corpus.jsonl", documents(w, seed=0))
    queries = write_jsonl(cfg.work / "queries.jsonl", synthetic_queries(w, cfg.limit, seed=cfg.answer.seed + 1))
    build_index(IndexConfig(corpus=corpus, store=cfg.answer.store, model=cfg.index_model, device=cfg.answer.device,
                            chunk_tokens=max(16, w.doc_tokens), trust_remote_code=cfg.answer.trust_remote_code),
                progress=progress)
    return replace(cfg, answer=replace(cfg.answer, queries=queries))


def check_plot(cfg: BenchConfig) -> None:
    """--plot needs matplotlib: said before the model loads."""
    if cfg.plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install matplotlib (or 'lazyrag[plot]')") from None


def run_bench(cfg: BenchConfig, report: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Bench every configuration of `cfg` on a sample of its queries; returns the run record
    (its `bench` list: one row per pass, ROW_KEYS). Options are checked before the model loads."""
    settings = plan(cfg)
    check_plot(cfg)
    if (w := synthetic_workload(cfg)) is not None:
        cfg = write_synthetic(cfg, w, progress)
    base = cfg.answer
    with Store.open(base.store) as store:
        sample = _sample(read_queries(base.queries, report), cfg.limit, base.seed)
        if not sample:
            raise InputError(f"{base.queries} holds no query to bench")
        resolver = ChunkResolver(store, base.top_k)
        resolved = []
        for q in sample:
            try:
                resolved.append((q, resolver.chunks(q)))
            except StoreError as exc:
                report(f"{base.queries}:{q.line}: query {q.id}: {exc}")
        if not resolved:
            raise InputError(f"none of the {len(sample)} sampled queries can be answered from {base.store}")
        pin_staging_ahead(store, resolve_device(base.device))
        loaded = load_model_for(store, base)
        wait_staging_pinned()  # the first configuration's cold pass pins nothing the others' would not
        bench = Bench(store, loaded, resolved, report)
        # the record goes to the run log; only a read-only store sends it beside the queries instead
        # (<queries>.bench.run.json), as answer does beside its answers
        sink = RecordSink(store, uuid.uuid4().hex, base.queries.with_name(f"{base.queries.stem}.bench.jsonl"),
                          report)
        from tqdm import tqdm

        t0 = time.perf_counter()
        for s in tqdm(settings, desc="bench", unit="config", disable=not progress, dynamic_ncols=True):
            bench.measure(s, _answer_config(base, s), cfg.warm)
            sink.save(bench.record(cfg, settings, time.perf_counter() - t0, interrupted=True))
        record = bench.record(cfg, settings, time.perf_counter() - t0)
        sink.save(record)
    if cfg.plot is not None:
        plot_frontier(record["bench"], cfg.plot)
    return record


def _sample(queries, limit: int, seed: int) -> list[Query]:
    """min(limit, all) queries, drawn as `answer --audit` draws its sample: by id, seeded."""
    ordered = sorted(queries, key=lambda q: q.id)
    return random.Random(seed).sample(ordered, min(limit, len(ordered)))


def _answer_config(base: AnswerConfig, s: Setting) -> AnswerConfig:
    return replace(base, mode=s.mode, recompute=s.recompute or 0.0, batch_size=s.batch_size, audit=0)


class Bench:
    """The passes of a bench run and their rows; the first configuration's requests give full's
    reference, which every row is measured against."""

    def __init__(self, store: Store, loaded, resolved: list[tuple[Query, list[ChunkInfo]]],
                 report: Callable[[str], None]):
        self.store, self.loaded, self.resolved, self.report = store, loaded, resolved, report
        self.rows: list[dict] = []
        self.cache: list[dict] = []
        self.reference: FullReference | None = None
        self.reference_ids: list[str] = []
        self._warned: set[str] = set()
        self.device = "-"

    def measure(self, s: Setting, cfg: AnswerConfig, warm: bool) -> None:
        qe = QueryEngine(self.store, cfg, self.loaded)
        self.device = str(qe.engine.device)
        try:
            passes = [self._pass(qe, cfg)]
            if warm:
                qe.engine.cache.reset_counters()  # the chunks and recomputed pages stay resident
                passes.append(self._pass(qe, cfg))
        finally:
            qe.close()  # one pool at a time: the reference's and the teacher forcing's engines come next
        cold = passes[0]
        if self.reference is None:
            self._set_reference(cfg, cold, s.mode is Mode.FULL)
        ids = [i for i in self.reference_ids if i in cold.seqs]
        logits = dict(zip(ids, forced_logits(cfg, self.loaded, self.store, [cold.seqs[i].request for i in ids],
                                             [self.reference.forced[self._ref_index[i]] for i in ids])))
        for name, p in zip(("cold", "warm"), passes):
            self.rows.append(self._row(s, name, p, logits))
            self.cache.append(p.cache)

    def _set_reference(self, cfg: AnswerConfig, first: Pass, is_full: bool) -> None:
        """full's answers and teacher-forced logits on the sample; a full pass's own answers are
        full's, so only the teacher forcing runs then."""
        self.reference_ids = sorted(first.seqs)
        requests = [first.seqs[i].request for i in self.reference_ids]
        generated = {i: first.seqs[i].generated for i in self.reference_ids} if is_full else None
        self.reference = full_reference(cfg, self.loaded, self.store, requests, generated)
        self._ref_index = {i: k for k, i in enumerate(self.reference_ids)}

    def _pass(self, qe: QueryEngine, cfg: AnswerConfig) -> Pass:
        seqs: dict[str, Sequence] = {}
        failed = []

        def fail(q: Query, reason: str) -> None:
            failed.append(q.id)
            if q.id not in self._warned:  # said once, not once per configuration
                self._warned.add(q.id)
                self.report(f"{cfg.queries}:{q.line}: query {q.id}: {reason}")

        t0 = time.perf_counter()
        qe.run(qe.requests(self.resolved, lambda q, exc: fail(q, str(exc))),
               lambda seq: seqs.__setitem__(seq.id, seq), on_error=lambda seq, exc: fail(seq.meta["query"], faults.reason(exc)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return Pass(seconds, seqs, {i: qe.row(seq) for i, seq in seqs.items()},
                    qe.engine.cache.counters.to_json(), len(failed))

    def _row(self, s: Setting, name: str, p: Pass, logits: dict[str, torch.Tensor]) -> dict:
        ids = [i for i in self.reference_ids if i in p.rows and i in logits]
        at = [self._ref_index[i] for i in ids]
        fid = fidelity([self.reference.answers[k] for k in at], [p.rows[i]["answer"] for i in ids],
                       [self.reference.logits[k] for k in at], [logits[i] for i in ids]).to_json()
        rows = list(p.rows.values())
        ttft = scoring.summarize([r["ttft_ms"] for r in rows])
        c = p.cache
        return {
            "mode": s.mode.value, "recompute": s.recompute, "batch_size": s.batch_size, "pass": name,
            "queries": len(rows), "seconds": round(p.seconds, 3),
            "req_per_s": round(len(rows) / p.seconds, 3) if p.seconds > 0 else None,
            "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"],
            "latency_p50_ms": scoring.summarize([r["latency_ms"] for r in rows])["p50"],
            "hit_ratio": c["hit_ratio"], "kv_peak_bytes": c["peak_pages"] * c["page_bytes"],
            "bytes_read": c["bytes_read"], "recomputed_tokens": c["recomputed_tokens"],
            "reused_tokens": c["reused_tokens"], "reuse_ratio": c["reuse_ratio"],
            **{k: fid[k] for k in ("identical", "f1_to_full", "kl_mean", "top1_agreement")},
            "new_tokens": sum(r["new_tokens"] for r in rows), "failed": p.failed,
        }

    def record(self, cfg: BenchConfig, settings: list[Setting], seconds: float, **extra) -> dict:
        """The run log's record of kind `bench`: the answer record's summary keys (so `stats`
        shows and sums it beside answer runs) over every pass, and the rows in `bench`."""
        from lazyrag.commands.stats import overall

        base = cfg.answer
        queries = sum(r["queries"] for r in self.rows)
        new_tokens = sum(r["new_tokens"] for r in self.rows)
        cache = overall([{"cache": c, "queries": 0, "new_tokens": 0} for c in self.cache])["cache"]
        cache.update(peak_pages=max((c["peak_pages"] for c in self.cache), default=0),
                     pool_pages=max((c["pool_pages"] for c in self.cache), default=0))
        return {
            "kind": "bench", "time": timestamp(), "mode": "bench", "queries": queries,
            "sample": len(self.resolved), "configurations": [s.label() + f" @{s.batch_size}" for s in settings],
            "warm": cfg.warm, "synthetic": cfg.synthetic, "queries_file": str(base.queries), "seconds": round(seconds, 3),
            "settings": {"cache_gb": base.cache_gb, "host_cache_gb": base.host_cache_gb,
                         "max_new_tokens": base.max_new_tokens, "top_k": base.top_k, "seed": base.seed,
                         "recompute_policy": base.recompute_policy, "recompute_layer": base.recompute_layer,
                         "recompute_reuse": base.recompute_reuse, "chunk_order": base.chunk_order.value},
            "ttft_ms": _pooled(self.rows, "ttft_p50_ms"), "latency_ms": _pooled(self.rows, "latency_p50_ms"),
            "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else None,
            "queries_per_s": round(queries / seconds, 3) if seconds > 0 else None,
            "model": self.loaded.name, "device": self.device,
            "cache": cache, "bench": self.rows, **extra,
        }


def _pooled(rows: list[dict], key: str) -> dict:
    """The rows' medians summarised (stats' latency columns for a bench run)."""
    return scoring.summarize([r[key] for r in rows if r[key] is not None])


def plot_frontier(rows: list[dict], path) -> None:
    """Throughput against KL to full, one labelled point per configuration's cold pass."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["pass"] != "cold":
            continue
        label = f"{r['mode']}" + ("" if r["recompute"] is None else f" {r['recompute']:g}") + f" b{r['batch_size']}"
        ax.scatter(r["kl_mean"], r["req_per_s"] or 0)
        ax.annotate(label, (r["kl_mean"], r["req_per_s"] or 0), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("KL(full || mode), nats per token (lower is closer to full)")
    ax.set_ylabel("requests per second (cold)")
    ax.set_title("lazyrag bench: speed against fidelity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_bench(record: dict, console) -> None:
    """The bench's one table, a row per pass; narrow (times in seconds, bytes in MB or GB) so that
    it fits an 80-column terminal."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"bench: {record['sample']} queries; fidelity to full", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0, collapse_padding=True)
    for col in ("mode", "F", "bs", "pass", "req/s", "TTFT s\np50/p95", "lat s\np50", "hits", "KV\npeak", "read",
                "same", "F1", "KL", "top-1"):
        t.add_column(col, justify="right")
    for r in record["bench"]:
        t.add_row(r["mode"], "-" if r["recompute"] is None else f"{r['recompute']:g}", str(r["batch_size"]),
                  r["pass"], f"{r['req_per_s'] or 0:,.1f}", f"{_s(r['ttft_p50_ms'])}/{_s(r['ttft_p95_ms'])}",
                  _s(r["latency_p50_ms"]), f"{r['hit_ratio']:.0%}", _bytes(r["kv_peak_bytes"]),
                  _bytes(r["bytes_read"]), f"{r['identical']:.0%}", f"{r['f1_to_full']:.2f}", f"{r['kl_mean']:.2g}",
                  f"{r['top1_agreement']:.0%}")
    console.print(t)


def _s(ms) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def _bytes(n: int) -> str:
    return f"{n / 1e9:.1f}G" if n >= 1e8 else f"{n / 1e6:.0f}M"
