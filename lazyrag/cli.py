"""The `lazyrag` command line: parse, call one function per command, print."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from lazyrag.config import (DEFAULT_MODEL, DEFAULT_STORE, DEVICES, KV_DTYPES, PAGE_SIZES, ROUTINGS,
                            AnswerConfig, BenchConfig, ChunkOrder, IndexConfig, Mode)

# one line per message, even when piped (no wrap at 80 columns); tables still fit the width
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


class Commands(TyperGroup):
    """Runs every command inside one handler: a failure is one line on stderr and an exit code
    by class (lazyrag/failures.py)."""

    def invoke(self, ctx: click.Context):
        from lazyrag.failures import classify, debug_traceback

        _sigterm_interrupts()
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.UsageError as exc:
            where = f"lazyrag {ctx.invoked_subcommand} --help" if ctx.invoked_subcommand else "lazyrag --help"
            _error(f"{exc.format_message()} (see `{where}`)")
            ctx.exit(2)
        except KeyboardInterrupt:
            _error("interrupted; run the same command again to resume")
            ctx.exit(130)
        except BrokenPipeError:
            # the reader (`| head`) stopped reading: the command did nothing wrong; stdout goes
            # to /dev/null so the interpreter's final flush cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except Exception as exc:
            failure = classify(exc)
            debug_traceback()
            _error(failure.message)
            ctx.exit(failure.code)


def _sigterm_interrupts() -> None:
    """SIGTERM stops a command as Ctrl-C does (one line, exit 130; the run resumes), not silently
    with 143; `answer` installs its own handler while it runs, to finish the row being written."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def _error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)


app = typer.Typer(
    cls=Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    # click's plain help: option names in a column of at most 30, so the text keeps 46 of 80 columns
    # (rich's panels give the wide flag names most of the width; tests/cli/test_help_width.py)
    rich_markup_mode=None,
    help="Batch retrieval-augmented generation over a fixed corpus, with each chunk's KV computed once "
         "and reused at any position (deferred RoPE).",
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        out.print(f"lazyrag {version('lazyrag')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                            help="Print the version and exit.")):
    pass  # the group's own options (--version); the help text is the app's
StoreOpt = typer.Option(DEFAULT_STORE, "--store", "-s", metavar="PATH|URL",
                        help="The zarr store: a directory, or a URL on object storage (s3://BUCKET/PREFIX, gs://, "
                             "az://) with credentials from the environment (AWS_ACCESS_KEY_ID, ...).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for scripts instead of tables.")
DEVICE_HELP = f"{DEVICES} (auto: CUDA when present)."
REMOTE_CODE_HELP = "Let transformers run code shipped with the model."
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar.")


def _device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r}: choose {DEVICES}")
    return value


def _kv_dtype(value: str) -> str:
    if value not in KV_DTYPES:
        raise typer.BadParameter(f"{value!r}: choose {', '.join(KV_DTYPES[:-1])} or {KV_DTYPES[-1]}")
    return value


def _page_size(value: int) -> int:
    if value not in PAGE_SIZES:
        raise typer.BadParameter(f"{value}: choose one of {', '.join(map(str, PAGE_SIZES))} "
                                 "(the attention kernels take a power of two in 16..128)")
    return value


def _routing(value: str) -> str:
    if value not in ROUTINGS:
        raise typer.BadParameter(f"{value!r}: choose {' or '.join(ROUTINGS)}")
    return value


def _store(value: str):
    """--store, parsed once for every command: a local Path, or a StoreURL on object storage."""
    from lazyrag.store.location import store_location

    try:
        return store_location(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--store'") from None


def _answers_path(value: Path) -> Path:
    if value.exists() and not value.is_file():
        raise typer.BadParameter(f"{value} is {'a directory' if value.is_dir() else 'not a regular file'}; "
                                 "name a file (created if missing)")
    return value


def _quiet_libraries() -> None:
    """No progress bars or info lines from transformers and huggingface_hub (--json, -q)."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()
    logging.disable_progress_bar()
    logging.set_verbosity_error()


def given_options(ctx: click.Context, names: tuple[str, ...]) -> set[str]:
    """Those of ``names`` the command line gave (not left at their defaults)."""
    return {n for n in names if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}


@app.command()
def index(
    ctx: typer.Context,
    corpus: Path = typer.Argument(..., help="A directory (.txt, .md, .jsonl, recursively) or one .jsonl file "
                                            "with lines {\"id\", \"text\", \"title\"?}."),
    store: str = StoreOpt,
    model: str = typer.Option(IndexConfig.model, "--model", "-m",
                              help=f"{DEFAULT_MODEL}, a local Hugging Face model directory, or random:<preset>."),
    chunk_tokens: int = typer.Option(IndexConfig.chunk_tokens, min=16,
                                     help="Most tokens per chunk; cuts prefer paragraph, then sentence boundaries."),
    page_size: int = typer.Option(IndexConfig.page_size, callback=_page_size,
                                  help="Tokens per KV page (chunks are padded to whole pages): "
                                       f"{', '.join(map(str, PAGE_SIZES))}."),
    batch_tokens: int = typer.Option(IndexConfig.batch_tokens, min=64, help="Chunk tokens per forward pass."),
    device: str = typer.Option(IndexConfig.device, callback=_device, help=DEVICE_HELP),
    dtype: str = typer.Option(IndexConfig.dtype, "--kv-dtype", "--dtype", callback=_kv_dtype,
                              help="The stored KV's dtype: auto (bf16), bf16, fp16 or fp32, which a GPU computes "
                                   "in (the CPU computes in fp32 whatever the KV dtype); or fp8 (e4m3 with a scale "
                                   "per token and KV head: about half of bf16's bytes; a GPU computes in bf16). "
                                   "`answer` follows the store."),
    skip_bad: bool = typer.Option(IndexConfig.skip_bad, "--skip-bad", help="Report bad files or lines and go on."),
    trust_remote_code: bool = typer.Option(IndexConfig.trust_remote_code, help=REMOTE_CODE_HELP),
    force: bool = typer.Option(IndexConfig.force, "--force",
                               help="Index even when the store's estimated size exceeds the free disk space."),
    verify: bool = typer.Option(IndexConfig.verify, "--verify",
                                help="First read every stored chunk back against its checksum (as `lazyrag check` "
                                     "does) and encode corrupt ones again; reads the whole store."),
    workers: int = typer.Option(IndexConfig.workers, min=1,
                                help="Encoding processes, documents split between them: one per GPU (cuda:0..N-1), "
                                     "or on the CPU each with its share of the threads."),
    sync: bool = typer.Option(IndexConfig.sync, "--sync",
                              help="Also take the documents the corpus no longer holds out of the store (a bad "
                                   "input skipped counts as gone); their chunks stay on disk until `lazyrag compact`."),
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Chunk a corpus, run the model once per chunk, and store each chunk's KV.

    Re-running adds only chunks that are not stored yet; an interrupted run resumes.
    Chunks in missing or truncated segments are encoded again (with --verify, corrupt ones too).
    An existing store's model, --chunk-tokens, --page-size and --kv-dtype are used unless given;
    given ones that differ from the store's are refused.
    """
    from lazyrag.commands.index_workers import index_corpus
    from lazyrag.commands.preflight import STORE_OPTIONS, check_index, scan_corpus, size_text, with_store_settings

    cfg = IndexConfig(corpus=corpus, store=_store(store), model=model, device=device, dtype=dtype,
                      chunk_tokens=chunk_tokens, page_size=page_size, batch_tokens=batch_tokens,
                      skip_bad=skip_bad, trust_remote_code=trust_remote_code, force=force, verify=verify,
                      workers=workers, sync=sync)
    cfg = with_store_settings(cfg, given_options(ctx, STORE_OPTIONS))  # re-indexing repeats no option
    if as_json or quiet:
        _quiet_libraries()
    scan = scan_corpus(cfg)
    if not scan.documents:
        err.print(f"[yellow]warning:[/] {escape(str(corpus))} holds no documents to index ({scan.empty} empty, "
                  f"{scan.bad} bad skipped); nothing was indexed", highlight=False)
        raise typer.Exit(3)
    estimate = check_index(cfg, scan)
    if not (as_json or quiet):
        err.print(f"index: {escape(estimate.line())}", highlight=False)
    result = index_corpus(cfg, report=lambda m: err.print(f"[yellow]skipped:[/] {escape(m)}", highlight=False),
                         progress=not (as_json or quiet))
    if as_json:
        print(json.dumps(result.to_json()))
        return
    size = size_text(result.store_bytes)
    if result.chunks_added == 0:
        out.print(f"nothing new: all {result.chunks_total} chunks of {result.documents_total} documents "
                  f"are already in {result.store} ({size})")
    else:
        out.print(f"added {result.chunks_added} chunks ({result.tokens_added:,} tokens) in {result.seconds:.1f}s; "
                  f"{result.store} holds {result.chunks_total} chunks of {result.documents_total} documents "
                  f"({size})")
    if result.documents_empty or result.bad_skipped:
        out.print(f"skipped {result.documents_empty} empty documents and {result.bad_skipped} bad inputs")
    if result.documents_removed:
        out.print(escape(result.removed_line()), highlight=False)


@app.command()
def answer(
    queries: Path = typer.Argument(..., help='JSONL lines {"id", "question", "docs"?, "chunks"?, "answers"?}.'),
    store: str = StoreOpt,
    out_path: Path = typer.Option(AnswerConfig.out, "--out", "-o", callback=_answers_path,
                                  help="Answers JSONL, appended; ids already there are skipped (resume)."),
    mode: Mode = typer.Option(AnswerConfig.mode, help="lazy (shared chunk KV, deferred RoPE), block (per-request "
                                                      "re-rotated copies) or full (recompute the whole prompt)."),
    top_k: int = typer.Option(AnswerConfig.top_k, min=1,
                              help="Chunks to retrieve (BM25) for queries naming no docs or chunks."),
    max_new_tokens: int = typer.Option(AnswerConfig.max_new_tokens, min=1),
    max_prompt_tokens: Optional[int] = typer.Option(AnswerConfig.max_prompt_tokens, min=1,
                                                    help="Longest prompt (preamble, chunks, question) to answer; "
                                                         "a longer one is listed in the errors file. Default: the "
                                                         "model's context less --max-new-tokens."),
    cache_gb: float = typer.Option(AnswerConfig.cache_gb,
                                   help="GPU (or CPU) memory for the page pool: chunks, prompts, answers."),
    host_cache_gb: float = typer.Option(AnswerConfig.host_cache_gb,
                                        help="Pinned host memory for chunks evicted from the pool."),
    batch_size: int = typer.Option(AnswerConfig.batch_size, min=1, help="Most requests in flight."),
    device: str = typer.Option(AnswerConfig.device, callback=_device, help=DEVICE_HELP),
    temperature: float = typer.Option(AnswerConfig.temperature, min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(AnswerConfig.top_p, min=0.0, max=1.0),
    seed: int = typer.Option(AnswerConfig.seed),
    model: Optional[str] = typer.Option(AnswerConfig.model, help="Load the model from here instead of the name "
                                                                 "the store records (it must have the same "
                                                                 "fingerprint)."),
    trust_remote_code: bool = typer.Option(AnswerConfig.trust_remote_code, help=REMOTE_CODE_HELP),
    cuda_graphs: bool = typer.Option(AnswerConfig.cuda_graphs, "--cuda-graphs/--eager",
                                     help="On a GPU, replay decode steps, and prefill steps' layers outside "
                                          "attention, from CUDA graphs captured at start (--eager launches every "
                                          "kernel from Python: slower, for debugging)."),
    shared_attention: bool = typer.Option(AnswerConfig.shared_attention, "--shared-attention/--no-shared-attention",
                                          help="lazy: each step reads each chunk page once for every request using "
                                               "it (chunk-major attention; a recomputed page reads its pages per "
                                               "request); --no-shared-attention reads them all per request (answers "
                                               "equal up to bf16 rounding; for comparison)."),
    audit: int = typer.Option(AnswerConfig.audit, min=0, metavar="N",
                              help="Answer a seeded sample of N queries also in full attention and record how far "
                                   "this mode is from it: identical answers, token F1 to full, mean KL(full || mode) "
                                   "and top-1 agreement along full's answer; costs a full-attention pass over those "
                                   "N prompts."),
    recompute: float = typer.Option(AnswerConfig.recompute, min=0.0, max=1.0, metavar="F",
                                    help="lazy and block: recompute this share of each request's chunk pages after "
                                         "its first chunk, in pages private to the request, attending to the chunks "
                                         "before them. 0 is off; 1 reproduces full. "
                                         "Costs prefill time and F x those pages of --cache-gb per request."),
    recompute_policy: str = typer.Option(AnswerConfig.recompute_policy,
                                         help="Which pages --recompute takes: head (page 0 of each chunk, then "
                                              "page 1, ...) or attention (those the question attends to most at "
                                              "--recompute-layer, measured in a pass over the first layers)."),
    recompute_layer: Optional[int] = typer.Option(AnswerConfig.recompute_layer, min=0, show_default="2, or "
                                                  "the last layer of a shallower model",
                                                  help="The layer whose attention ranks pages (--recompute-policy "
                                                       "attention)."),
    recompute_reuse: bool = typer.Option(AnswerConfig.recompute_reuse, "--recompute-reuse/--no-recompute-reuse",
                                         help="lazy: keep recomputed pages in the cache; a later request whose "
                                              "prompt starts with the same chunks reuses them (the same bits) "
                                              "instead of recomputing. --no-recompute-reuse also keeps the given "
                                              "order."),
    chunk_order: ChunkOrder = typer.Option(AnswerConfig.chunk_order,
                                    help="lazy: the order of each prompt's documents: given, or popular (most "
                                         "used in the run first, ties as given), so leading chunks repeat and "
                                         "recomputed pages are reused far more often (with --recompute-reuse), "
                                         "at the cost of answers that move away from full on the given order "
                                         "where prompts share documents (docs/quality.md). --audit compares "
                                         "with full on the given order."),
    ape_temperature: float = typer.Option(AnswerConfig.ape_temperature, metavar="T",
                                          help="lazy and block only: APE's correction of the attention a question "
                                               "pays to separately encoded chunks, its logits to chunk keys divided "
                                               "by T (adaptive parallel encoding). 1 = off."),
    ape_scale: float = typer.Option(AnswerConfig.ape_scale, metavar="S",
                                    help="lazy and block only: APE's scale, ln S added to the question's logits to "
                                         "chunk keys (with --ape-temperature). 1 = off."),
    data_parallel: int = typer.Option(AnswerConfig.data_parallel, min=1, metavar="N",
                                      help="Answer with N engines, one per GPU, as actors on Ray (needs "
                                           "lazyrag[ray]): a local Ray instance, or the cluster of --ray-address. "
                                           "On a machine without GPUs (or with --device cpu), N CPU engines."),
    ray_address: Optional[str] = typer.Option(AnswerConfig.ray_address, metavar="ADDR",
                                              help="Join this Ray cluster (auto: the one this machine is in) and "
                                                   "place the --data-parallel engines one per GPU across its nodes; "
                                                   "every node must read the store at the same path (a shared file "
                                                   "system) or on object storage."),
    routing: str = typer.Option(AnswerConfig.routing, callback=_routing,
                                help="How queries are spread over the engines: affinity (queries sharing chunks "
                                     "on the same engine, balanced) or round-robin."),
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Answer a file of questions from the store; one JSON line per answer, in finishing order."""
    from lazyrag.commands.answer import answer_file

    cfg = AnswerConfig(queries=queries, store=_store(store), out=out_path, mode=mode, model=model, top_k=top_k,
                       max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, cache_gb=cache_gb,
                       host_cache_gb=host_cache_gb,
                       batch_size=batch_size, device=device, temperature=temperature, top_p=top_p,
                       seed=seed, trust_remote_code=trust_remote_code, cuda_graphs=cuda_graphs,
                       shared_attention=shared_attention, audit=audit,
                       recompute=recompute, recompute_policy=recompute_policy, recompute_layer=recompute_layer,
                       recompute_reuse=recompute_reuse, chunk_order=chunk_order,
                       ape_temperature=ape_temperature, ape_scale=ape_scale, data_parallel=data_parallel,
                       ray_address=ray_address, routing=routing)
    if as_json or quiet:
        _quiet_libraries()
    result = answer_file(cfg, report=lambda m: err.print(f"[yellow]warning:[/] {escape(m)}", highlight=False),
                         progress=not (as_json or quiet))
    if as_json:
        print(json.dumps({**(result.record or {"queries": 0, "failed": result.failed, "bad_lines": len(result.bad)}),
                          "skipped_already_answered": result.skipped}))
    else:
        from lazyrag.commands.stats import render_run

        if result.skipped:
            out.print(f"{result.skipped} queries were already answered in {out_path}; skipped")
        if result.record:
            render_run(result.record, out)
        elif not result.queries_in_file:
            out.print(f"{queries} holds no queries")
        out.print(f"{result.failed} queries failed" + (f", listed in {result.errors}" if result.failed else "")
                  + (f"; {len(result.bad)} bad lines skipped (reported above)" if result.bad else ""))
        if result.record_file:
            out.print(f"the store is not writable: this run's record is in {result.record_file}")
    if result.nothing_answered:
        if result.too_large:  # resources, not input: the same queries fit with more memory
            from lazyrag.errors import ResourceError

            raise ResourceError(f"no query was answered: {result.too_large}")
        raise typer.Exit(3)  # bad input: nothing could be answered


@app.command()
def bench(
    queries: Optional[Path] = typer.Argument(None, help="The queries file, as `answer` reads it; a sample is "
                                                        "benched. Or --synthetic."),
    store: str = StoreOpt,
    modes: str = typer.Option(BenchConfig.modes, help="Modes to bench, comma-separated: lazy, block, full "
                                                      "(full runs once, at the first batch size)."),
    recompute: str = typer.Option(BenchConfig.recompute, metavar="F,...",
                                  help="Recompute shares in [0, 1] for lazy and block (as answer --recompute)."),
    batch_sizes: str = typer.Option(BenchConfig.batch_sizes, metavar="N,...", help="Batch sizes to bench."),
    limit: int = typer.Option(BenchConfig.limit, metavar="N", help="Queries sampled (by --seed) from the file."),
    seed: int = typer.Option(AnswerConfig.seed, help="Seeds the sample."),
    warm: bool = typer.Option(BenchConfig.warm, "--warm",
                              help="Also time a second pass on each configuration's engine (cache warm)."),
    max_new_tokens: int = typer.Option(AnswerConfig.max_new_tokens, min=1),
    top_k: int = typer.Option(AnswerConfig.top_k, min=1, help="Chunks to retrieve for queries naming none."),
    cache_gb: float = typer.Option(AnswerConfig.cache_gb, help="Page pool per configuration, as answer's."),
    host_cache_gb: float = typer.Option(AnswerConfig.host_cache_gb, help="Pinned host tier, as answer's."),
    device: str = typer.Option(AnswerConfig.device, callback=_device, help=DEVICE_HELP),
    model: Optional[str] = typer.Option(AnswerConfig.model, help="The store's model from this path instead."),
    trust_remote_code: bool = typer.Option(AnswerConfig.trust_remote_code, help=REMOTE_CODE_HELP),
    recompute_policy: str = typer.Option(AnswerConfig.recompute_policy, help="head or attention, as answer's."),
    recompute_layer: Optional[int] = typer.Option(AnswerConfig.recompute_layer, min=0,
                                                  help="The layer ranking pages, as answer's."),
    recompute_reuse: bool = typer.Option(AnswerConfig.recompute_reuse, "--recompute-reuse/--no-recompute-reuse",
                                         help="lazy: reuse recomputed pages, as answer's."),
    chunk_order: ChunkOrder = typer.Option(AnswerConfig.chunk_order, help="lazy: given or popular, as answer's."),
    cuda_graphs: bool = typer.Option(AnswerConfig.cuda_graphs, "--cuda-graphs/--eager",
                                     help="On a GPU, replay steps from CUDA graphs, as answer's."),
    synthetic: Optional[str] = typer.Option(None, metavar="NAME",
                                            help="Instead of QUERIES: the paper's workload (paper: Zipf 2.1; "
                                                 "uniform), --limit queries of 5 docs each, written under --work "
                                                 "and indexed into --store with --index-model."),
    work: Path = typer.Option(BenchConfig.work, help="Where --synthetic writes corpus.jsonl, queries.jsonl."),
    docs: Optional[int] = typer.Option(None, min=1, help="--synthetic: documents (paper: 100)."),
    doc_tokens: Optional[int] = typer.Option(None, min=16, help="--synthetic: tokens per document (paper: 2048)."),
    index_model: str = typer.Option(BenchConfig.index_model, help="--synthetic: the model to index with."),
    plot: Optional[Path] = typer.Option(None, metavar="FILE.png",
                                        help="Draw req/s against KL, a point per configuration (matplotlib)."),
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Answer a sample of QUERIES in each configuration and compare speed with fidelity to full.

    Each configuration (mode x recompute x batch size) runs on a fresh engine and cache;
    --warm adds a pass on the same engine. Writes no answers file; the run log records
    the run as kind "bench" (`lazyrag stats`).

    --json prints {"bench": [row, ...], ...}, each row: mode, recompute (null for full),
    batch_size, pass (cold or warm), queries, seconds, req_per_s, ttft_p50_ms,
    ttft_p95_ms, latency_p50_ms, hit_ratio, kv_peak_bytes, bytes_read, recomputed_tokens,
    reused_tokens, reuse_ratio, new_tokens, failed, and fidelity to full on the sample as
    answer --audit measures it: identical, f1_to_full, kl_mean (nats per token),
    top1_agreement.
    """
    from lazyrag.commands.bench import render_bench, run_bench

    answer_cfg = AnswerConfig(queries=queries, store=_store(store), model=model, top_k=top_k,
                              max_new_tokens=max_new_tokens, cache_gb=cache_gb, host_cache_gb=host_cache_gb,
                              device=device, seed=seed, trust_remote_code=trust_remote_code,
                              cuda_graphs=cuda_graphs, recompute_policy=recompute_policy,
                              recompute_layer=recompute_layer, recompute_reuse=recompute_reuse,
                              chunk_order=chunk_order)
    cfg = BenchConfig(answer=answer_cfg, modes=modes, recompute=recompute, batch_sizes=batch_sizes, limit=limit,
                      warm=warm, plot=plot, synthetic=synthetic, work=work, docs=docs, doc_tokens=doc_tokens,
                      index_model=index_model)
    if as_json or quiet:
        _quiet_libraries()
    record = run_bench(cfg, report=lambda m: err.print(f"[yellow]warning:[/] {escape(m)}", highlight=False),
                       progress=not (as_json or quiet))
    if as_json:
        print(json.dumps(record))
        return
    render_bench(record, out)
    if plot:
        out.print(f"plotted {sum(r['pass'] == 'cold' for r in record['bench'])} configurations -> {plot}")


@app.command()
def stats(store: str = StoreOpt, as_json: bool = JsonOpt):
    """Show the store, and each `answer` run's cache hit ratio, latency and quality."""
    from lazyrag.commands.stats import render_stats, stats_json

    data = stats_json(_store(store))
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        render_stats(data, out)


@app.command()
def check(store: str = StoreOpt, as_json: bool = JsonOpt):
    """Read every chunk back against its checksum and compare the catalog with the disk.

    Exits 4 when the store is damaged: a corrupt chunk (checksum mismatch),
    a missing or truncated chunk or segment, a document listing a chunk the
    catalog lacks, an orphan segment left by an interrupted write, or a
    damaged retrieval index (`index` rebuilds it). Exits 0 when it is clean. Chunks no document uses any more are not
    damage: `lazyrag compact` reclaims them.
    """
    from lazyrag.commands.check import render_check, run_check

    location = _store(store)
    report = run_check(location)
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        render_check(report, location, out)
    if not report.ok:
        raise typer.Exit(4)  # the store is damaged


@app.command()
def compact(
    store: str = StoreOpt,
    wait: bool = typer.Option(False, "--wait", help="Wait for answer or stats runs reading the store to finish "
                                                    "instead of refusing."),
    as_json: bool = JsonOpt,
):
    """Reclaim the disk space of chunks no document uses any more (old versions of re-indexed documents).

    Refuses while another process writes the store, or (without --wait) reads it.
    """
    from lazyrag.commands.compact import describe, run_compact

    result = run_compact(_store(store), wait)
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        out.print(describe(result), highlight=False)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
