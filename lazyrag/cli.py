"""The `lazyrag` command line: parse, call one function per command, print."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from lazyrag.config import DEFAULT_MODEL, DEFAULT_STORE, AnswerConfig, IndexConfig, Mode

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Batch retrieval-augmented generation over a fixed corpus, with each chunk's KV computed once "
         "and reused at any position (deferred RoPE).",
)
out = Console()
err = Console(stderr=True)

StoreOpt = typer.Option(DEFAULT_STORE, "--store", "-s", help="The zarr store directory.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for scripts instead of tables.")
DEVICE_HELP = "auto (CUDA when present), cpu or cuda."
REMOTE_CODE_HELP = "Let transformers run code shipped with the model."
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar.")


def _fail(exc: Exception, code: int = 1):
    err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def _known_errors():
    """Errors reported as one line (exit 1); anything else is a bug and keeps its traceback."""
    from lazyrag.commands.queries import QueryError
    from lazyrag.corpus import CorpusError
    from lazyrag.models import ModelError
    from lazyrag.store import StoreError

    return (CorpusError, ModelError, QueryError, StoreError, FileNotFoundError, ValueError)


@app.command()
def index(
    corpus: Path = typer.Argument(..., help="A directory (.txt, .md, .jsonl, recursively) or one .jsonl file "
                                            "with lines {\"id\", \"text\", \"title\"?}."),
    store: Path = StoreOpt,
    model: str = typer.Option(IndexConfig.model, "--model", "-m",
                              help=f"{DEFAULT_MODEL}, a local Hugging Face model directory, or random:<preset>."),
    chunk_tokens: int = typer.Option(IndexConfig.chunk_tokens, min=16,
                                     help="Most tokens per chunk; cuts prefer paragraph, then sentence boundaries."),
    page_size: int = typer.Option(IndexConfig.page_size, help="Tokens per KV page (chunks are padded to whole pages)."),
    batch_tokens: int = typer.Option(IndexConfig.batch_tokens, min=64, help="Chunk tokens per forward pass."),
    device: str = typer.Option(IndexConfig.device, help=DEVICE_HELP),
    dtype: str = typer.Option(IndexConfig.dtype, help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32."),
    skip_bad: bool = typer.Option(IndexConfig.skip_bad, "--skip-bad", help="Report bad files or lines and go on."),
    trust_remote_code: bool = typer.Option(IndexConfig.trust_remote_code, help=REMOTE_CODE_HELP),
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Chunk a corpus, run the model once per chunk, and store each chunk's KV.

    Re-running adds only chunks that are not stored yet; an interrupted run resumes.
    A store built with another model or other settings is refused.
    """
    from lazyrag.commands.index import build_index

    cfg = IndexConfig(corpus=corpus, store=store, model=model, device=device, dtype=dtype,
                             chunk_tokens=chunk_tokens, page_size=page_size, batch_tokens=batch_tokens,
                             skip_bad=skip_bad, trust_remote_code=trust_remote_code)
    try:
        result = build_index(cfg, report=lambda m: err.print(f"[yellow]skipped:[/] {m}", highlight=False),
                             progress=not (as_json or quiet))
    except _known_errors() as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    if result.chunks_added == 0:
        out.print(f"nothing new: all {result.chunks_total} chunks of {result.documents_total} documents "
                  f"are already in {result.store}")
    else:
        out.print(f"added {result.chunks_added} chunks ({result.tokens_added:,} tokens) in {result.seconds:.1f}s; "
                  f"{result.store} holds {result.chunks_total} chunks of {result.documents_total} documents")
    if result.documents_empty or result.bad_skipped:
        out.print(f"skipped {result.documents_empty} empty documents and {result.bad_skipped} bad inputs")


@app.command()
def answer(
    queries: Path = typer.Argument(..., help='JSONL lines {"id", "question", "docs"?, "chunks"?, "answers"?}.'),
    store: Path = StoreOpt,
    out_path: Path = typer.Option(AnswerConfig.out, "--out", "-o",
                                  help="Answers JSONL, appended; ids already there are skipped (resume)."),
    mode: Mode = typer.Option(AnswerConfig.mode, help="lazy (shared chunk KV, deferred RoPE), block (per-request "
                                                      "re-rotated copies) or full (recompute the whole prompt)."),
    top_k: int = typer.Option(AnswerConfig.top_k, min=1,
                              help="Chunks to retrieve (BM25) for queries naming no docs or chunks."),
    max_new_tokens: int = typer.Option(AnswerConfig.max_new_tokens, min=1),
    cache_gb: float = typer.Option(AnswerConfig.cache_gb,
                                   help="GPU (or CPU) memory for the page pool: chunks, prompts, answers."),
    host_cache_gb: float = typer.Option(AnswerConfig.host_cache_gb,
                                        help="Pinned host memory for chunks evicted from the pool."),
    batch_size: int = typer.Option(AnswerConfig.batch_size, min=1, help="Most requests in flight."),
    device: str = typer.Option(AnswerConfig.device, help=DEVICE_HELP),
    temperature: float = typer.Option(AnswerConfig.temperature, min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(AnswerConfig.top_p, min=0.0, max=1.0),
    seed: int = typer.Option(AnswerConfig.seed),
    model: Optional[str] = typer.Option(AnswerConfig.model, help="Load the model from here instead of the name "
                                                                 "the store records (it must have the same "
                                                                 "fingerprint)."),
    trust_remote_code: bool = typer.Option(AnswerConfig.trust_remote_code, help=REMOTE_CODE_HELP),
    cuda_graphs: bool = typer.Option(AnswerConfig.cuda_graphs, "--cuda-graphs/--eager",
                                     help="On a GPU, replay decode steps from CUDA graphs captured at start "
                                          "(--eager launches every kernel from Python: slower, for debugging)."),
    audit: int = typer.Option(AnswerConfig.audit, min=0, metavar="N",
                              help="Answer a seeded sample of N queries also in full attention and record how far "
                                   "this mode is from it: identical answers, token F1 to full, mean KL(full || mode) "
                                   "and top-1 agreement along full's answer; costs a full-attention pass over those "
                                   "N prompts."),
    recompute: float = typer.Option(AnswerConfig.recompute, min=0.0, max=1.0, metavar="F",
                                    help="lazy and block: recompute this share of each request's chunk pages after "
                                         "its first chunk, in pages private to the request, attending to the chunks "
                                         "before them (page 0 of each chunk first). 0 is off; 1 reproduces full. "
                                         "Costs prefill time and F x those pages of --cache-gb per request."),
    recompute_policy: str = typer.Option(AnswerConfig.recompute_policy,
                                         help="Which pages --recompute takes: head (page 0 of each chunk, then "
                                              "page 1, ...) or attention (those the question attends to most at "
                                              "--recompute-layer, measured in a pass over the first layers)."),
    recompute_layer: int = typer.Option(AnswerConfig.recompute_layer, min=0,
                                        help="The layer whose attention ranks pages (--recompute-policy attention)."),
    ape_temperature: float = typer.Option(AnswerConfig.ape_temperature, metavar="T",
                                          help="lazy and block only: APE's correction of the attention a question "
                                               "pays to separately encoded chunks, its logits to chunk keys divided "
                                               "by T (adaptive parallel encoding). 1 = off."),
    ape_scale: float = typer.Option(AnswerConfig.ape_scale, metavar="S",
                                    help="lazy and block only: APE's scale, ln S added to the question's logits to "
                                         "chunk keys (with --ape-temperature). 1 = off."),
    as_json: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Answer a file of questions from the store; one JSON line per answer, in finishing order."""
    from lazyrag.commands.answer import answer_file

    cfg = AnswerConfig(queries=queries, store=store, out=out_path, mode=mode, model=model, top_k=top_k,
                       max_new_tokens=max_new_tokens, cache_gb=cache_gb, host_cache_gb=host_cache_gb,
                       batch_size=batch_size, device=device, temperature=temperature, top_p=top_p,
                       seed=seed, trust_remote_code=trust_remote_code, cuda_graphs=cuda_graphs, audit=audit,
                       recompute=recompute, recompute_policy=recompute_policy, recompute_layer=recompute_layer,
                       ape_temperature=ape_temperature, ape_scale=ape_scale)
    try:
        result = answer_file(cfg, report=lambda m: err.print(f"[yellow]bad input:[/] {m}", highlight=False),
                             progress=not (as_json or quiet))
    except _known_errors() as exc:
        _fail(exc)
    if as_json:
        print(json.dumps({**result.record, "skipped_already_answered": result.skipped}))
    else:
        from lazyrag.commands.stats import render_run

        if result.skipped:
            out.print(f"{result.skipped} queries were already answered in {out_path}; skipped")
        render_run(result.record, out)
        out.print(f"{result.failed} queries failed" + (f", listed in {result.errors}" if result.failed else ""))
    if result.failed and not result.record["queries"]:
        raise typer.Exit(3)  # bad input: nothing could be answered


@app.command()
def stats(store: Path = StoreOpt, as_json: bool = JsonOpt):
    """Show the store, and each `answer` run's cache hit ratio, latency and quality."""
    from lazyrag.commands.stats import render_stats, stats_json

    try:
        data = stats_json(store)
    except _known_errors() as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        render_stats(data, out)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
