#!/usr/bin/env python
"""Registers, spills and shared memory of the Triton kernels, compiled for the H200 (sm_90a)
ahead of time: no GPU needed, so it runs on the CPU machine.

Spills in a key loop cost local-memory traffic on every iteration; this shows them per
tile configuration before any device time is spent. Uses the ptxas that ships with Triton;
the numbers belong to the installed Triton version (printed), which should match the GPU's.

Usage: python scripts/kernel_regs.py [--arch 90]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from lazyrag.kernels import bit_matrix, decode, prefill
from lazyrag.kernels.tuning import Launch

POINTERS = {**{n: "*bf16" for n in ("Q", "K", "V", "O")},
            **{n: "*i32" for n in ("IDS", "DELTA", "START", "LEN", "COUNT", "CU", "QPOS")},
            **{n: "*fp32" for n in ("INVF", "OP", "LSE")}}
# (query heads, KV heads) of the benchmark's models, by head dim: Llama-3.1-8B and SmolLM2
HEADS = {128: (32, 8), 64: (9, 3)}


def launch_ints(D: int, PS: int) -> dict:
    """The integer arguments a launch passes for these shapes (contiguous tensors)."""
    H, Hkv = HEADS[D]
    return dict(stride_qt=H * D, stride_qb=H * D, stride_qh=D, stride_ot=H * D, stride_oh=D,
                stride_kp=PS * Hkv * D, stride_vp=PS * Hkv * D, stride_kt=Hkv * D, stride_vt=Hkv * D,
                stride_kh=D, stride_vh=D, num_heads=H)


def resources(launch: Launch, arch: int, tma_block=None) -> dict:
    kernel, constexprs, options = launch.kernel, launch.constexprs, launch.options
    names = kernel.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in constexprs else "fp32" if n == "qk_scale" else "i32")
           for n in names}
    if tma_block:  # K and V as TMA descriptors of [rows, columns] blocks
        sig.update(K=f"tensordesc<bf16{list(tma_block)}>", V=f"tensordesc<bf16{list(tma_block)}>")
    # specialise as a launch does: a launch marks 16-byte-aligned pointers and integers that
    # are multiples of 16 (unless do_not_specialize), and the pipeliner copies a tile
    # asynchronously only when it can prove its alignment; without these marks the numbers
    # describe a kernel that never runs
    ints = launch_ints(2 * constexprs["HALF"], constexprs["PS"])
    keep = set(kernel.do_not_specialize)
    aligned = [n for n in names if sig[n].startswith("*")
               or (n in ints and n not in keep and ints[n] % 16 == 0)]
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return report(src, options, arch)


def report(src: ASTSource, options: dict, arch: int) -> dict:
    """Compile ``src`` for ``arch`` (sm_90a for 90) and read ptxas's report."""
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        # the ptxas this Triton version compiles with (the PTX it emits may be too new for another)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(ptx), "-o", str(Path(tmp) / "k.cubin")]
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    # K/V tiles the software pipeliner loads asynchronously (cp.async or TMA): none means each
    # page waits on its own load
    async_tiles = len(re.findall(r"ttng\.async_tma_copy_global_to_local|"
                                 r"ttg\.async_copy_global_to_local .*tensor<\d+x\d+x!tt\.ptr", compiled.asm["ttgir"]))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    n_regs = int(regs.group(1)) if regs else 0
    return {"registers": n_regs,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0,
            "shared": compiled.metadata.shared,
            "async_tiles": async_tiles,
            "programs_per_sm": programs_per_sm(n_regs, compiled.metadata.shared, options.get("num_warps", 4))}


def bit_rows_resources(arch: int) -> dict:
    """bit_rows (the GPU's crc32c) at the launcher's defaults."""
    kernel = bit_matrix._bit_rows_kernel
    names = kernel.arg_names
    constexprs = dict(BLOCK_M=64, STEP=16, ROW=bit_matrix.ROW_BYTES, BITS=bit_matrix.BITS)
    sig = {"DATA": "*u8", "MAT": "*fp16", "OUT": "*i32", **{n: "i32" for n in ("n", "pad", "rows", "xor")},
           **{n: "constexpr" for n in constexprs}}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ("DATA", "MAT", "OUT")})
    return report(src, {}, arch)


def programs_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Resident programs on one Hopper SM: 64K registers (allocated per warp in 256s), 228 KB
    of shared memory (1 KB reserved per program), 64 warps, 32 programs."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 228 * 1024 // (shared + 1024), 64 // num_warps, 32)


def label(launch: Launch, rows: str) -> str:
    """A launch as the table shows it: rows per program, warps, stages, register cap, TMA."""
    o = launch.options
    cap = f", maxnreg {o['maxnreg']}" if "maxnreg" in o else ""
    tma = ", TMA" if launch.constexprs.get("TMA") else ""
    return f"{launch.constexprs[rows]} rows, {o['num_warps']} warps, {o['num_stages']} stages{cap}{tma}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    args = ap.parse_args()
    capability = divmod(args.arch, 10)
    rows = []
    for D in (128, 64):
        H, Hkv = HEADS[D]
        shape = (torch.bfloat16, H, Hkv, D, 64)
        for rotate in (True, False):
            # lazy_prefill's default launch, then 128 rows (8 warps) without a register cap
            for default, options in ((True, {}), (False, dict(block_m=128, maxnreg=0))):
                launch = prefill.launch_config(*shape, rotate=rotate, capability=capability, **options)
                launch = Launch(launch.kernel, dict(launch.constexprs, SPLIT=False), launch.options)
                r = resources(launch, args.arch)
                rows.append(("prefill", D, rotate, f"{'default: ' if default else ''}{label(launch, 'BLOCK_M')}", r))
            for tma in ((True, False) if D == 128 else (False,)):
                launch = decode.launch_config(*shape, rotate=rotate, tma=tma, capability=capability)
                r = resources(launch, args.arch, (64, D) if tma else None)
                rows.append(("decode", D, rotate, f"{'' if tma else 'default: '}{label(launch, 'BLOCK_H')}", r))
    rows.append(("bit_rows", "-", "-", "64 rows of 64 bytes, 4 warps", bit_rows_resources(args.arch)))
    print(f"{sm_arch_from_capability(args.arch)}, triton {triton.__version__}, bf16, page size 64\n")
    print("| kernel | head dim | rotate | config | registers | spill stores / loads (bytes) | shared (bytes) | "
          "programs/SM | async tile loads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kernel, D, rotate, cfg, r in rows:
        print(f"| {kernel} | {D} | {rotate} | {cfg} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
              f"{r['shared']} | {r['programs_per_sm']} | {r['async_tiles']} |")


if __name__ == "__main__":
    main()
