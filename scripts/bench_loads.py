"""What loading one chunk costs the GPU, beside the limits: a cold run's loads share the GPU with
the steps, so every millisecond here is taken from them.

For one chunk of a model's geometry (default: an 8B model's 2,048 tokens, pages of 64), on CUDA:

  H2D          the chunk's bytes from pinned host memory to the GPU (PCIe: the read's own limit)
  D2D copy     the same bytes copied on the GPU (HBM: each byte read and written once)
  crc32c       device_crc32c over the bytes (the loader's check), and the first level's bit_rows
               at each tiling in --tilings (the same words, or the row is marked)
  into pages   the rows written into scattered pool pages: rows_to_pages (Triton), and the
               indexed assignment it replaced (reference.rows_to_pages), bf16 and fp8 pools

Each figure is the median of --repeats timed runs (CUDA events), with GB/s of the chunk's bytes.

Usage: python scripts/bench_loads.py [--tokens 2048 --layers 32 --kv-heads 8 --head-dim 128 --page 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def timed_ms(fn, repeats: int) -> float:
    fn()  # compile, allocate
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from lazyrag import kernels
    from lazyrag.kernels import reference, triton_ops
    from lazyrag.serve.device_checksums import ROW, device_crc32c, level_matrix, scratch_words
    from lazyrag.store import pack_fp8_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tilings", default="64x16,128x16,64x32,128x32,256x16,256x32",
                    help="bit_rows tilings to time: BLOCK_MxSTEP (rows per program x bytes per dot)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_loads needs CUDA")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.layers, 2, args.kv_heads, args.head_dim)
    rows = torch.randn(shape, generator=g).to(torch.bfloat16)
    nbytes = rows.numel() * rows.element_size()
    pinned = rows.view(torch.uint8).reshape(-1).pin_memory()
    raw = pinned.to(dev)
    num_pages = 4 * args.tokens // args.page
    pages = torch.randperm(num_pages, generator=g)[: args.tokens // args.page].to(dev)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one chunk of {args.tokens:,} tokens "
             f"x {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} = {nbytes / 2**20:.0f} MiB (bf16)",
             "", "| what | ms | GB/s of the chunk |", "|---|---:|---:|"]

    def row(what: str, ms: float, size: int = nbytes) -> None:
        lines.append(f"| {what} | {ms:.3f} | {size / ms / 1e6:,.0f} |")
        print(lines[-1], flush=True)

    copy = torch.empty_like(raw)
    row("H2D from pinned memory", timed_ms(lambda: copy.copy_(pinned, non_blocking=True), args.repeats))
    row("D2D copy (HBM: read + write)", timed_ms(lambda: copy.copy_(raw), args.repeats))
    scratch = torch.empty(scratch_words(nbytes), dtype=torch.int32, device=dev)  # as the loader's
    row("crc32c, device_crc32c (all levels)", timed_ms(lambda: device_crc32c(raw, scratch), args.repeats))
    matrix = level_matrix(0, dev)
    want = kernels.bit_rows(raw, 0, matrix)
    got = torch.empty_like(want)
    for tiling in args.tilings.split(","):
        block_m, step = (int(x) for x in tiling.split("x"))
        triton_ops.bit_rows(raw, 0, matrix, 0, got, block_m=block_m, step=step)
        same = "" if torch.equal(got, want) else " (WRONG words)"
        row(f"crc32c first level, bit_rows {block_m} rows x {step} bytes{same}",
            timed_ms(lambda: triton_ops.bit_rows(raw, 0, matrix, 0, got, block_m=block_m, step=step), args.repeats))
    assert nbytes % ROW == 0
    on_device = rows.to(dev)
    for name, pool_dtype in (("bf16", torch.bfloat16), ("fp8", kernels.FP8)):
        pool = torch.zeros(2, args.layers, num_pages, args.page, args.kv_heads, args.head_dim, dtype=pool_dtype,
                           device=dev)
        if pool_dtype == torch.bfloat16:
            src, size = on_device, nbytes
        else:
            values, scales = kernels.quantize_fp8(on_device.float())
            src = values
            size = values.numel() + scales.numel() * 4
            packed = pack_fp8_rows(values, scales)
            assert packed.numel() == size
        row(f"into pages, rows_to_pages ({name} values)", timed_ms(lambda: kernels.rows_to_pages(src, pool, pages),
                                                                   args.repeats), src.numel() * src.element_size())
        row(f"into pages, indexed assignment ({name} values)",
            timed_ms(lambda: reference.rows_to_pages(src, pool, pages), args.repeats), src.numel() * src.element_size())
        check = pool.clone()
        reference.rows_to_pages(src, check, pages)
        kernels.rows_to_pages(src, pool, pages)
        assert torch.equal(pool.view(torch.uint8), check.view(torch.uint8)), name
    print("\n".join(lines))


if __name__ == "__main__":
    main()
