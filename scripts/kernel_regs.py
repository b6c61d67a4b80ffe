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
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lazyrag.kernels import _triton as kt  # noqa: E402

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


def resources(kernel, constexprs: dict, num_warps: int, num_stages: int, arch: int, tma_block=None,
              maxnreg=None) -> dict:
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
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           **({"maxnreg": maxnreg} if maxnreg else {})))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        # the ptxas this Triton version compiles with (the PTX it emits may be too new for another)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o", str(Path(tmp) / "k.cubin")]
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
            "programs_per_sm": programs_per_sm(n_regs, compiled.metadata.shared, num_warps)}


def programs_per_sm(regs: int, shared: int, num_warps: int) -> int:
    """Resident programs on one Hopper SM: 64K registers (allocated per warp in 256s), 228 KB
    of shared memory (1 KB reserved per program), 64 warps, 32 programs."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 228 * 1024 // (shared + 1024), 64 // num_warps, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    args = ap.parse_args()
    bf16 = triton.language.bfloat16
    rows = []
    for D in (128, 64):
        group = HEADS[D][0] // HEADS[D][1]
        for rotate in (True, False):
            # lazy_prefill's defaults (64 rows, 4 warps, PREFILL_TUNING), then 128 rows, 8 warps
            tuning = kt.PREFILL_TUNING[D]
            stages, cap = tuning.get("num_stages", 2), tuning.get("maxnreg")
            for bm, warps, default in ((64, 4, True), (128, 8, False)):
                c = dict(GROUP=group, DTYPE=bf16, PS=64, HALF=D // 2, BLOCK_M=bm, ROTATE=rotate, PREC="tf32",
                         IDX64=False, SPLIT=False)
                cap_here = cap if default else None
                label = (f"{'default: ' if default else ''}{bm} rows, {warps} warps, {stages} stages"
                         f"{f', maxnreg {cap_here}' if cap_here else ''}")
                r = resources(kt._prefill_kernel, c, warps, stages, args.arch, maxnreg=cap_here)
                rows.append(("prefill", D, rotate, label, r))
            warps = 8 if D == 64 else 4  # lazy_decode's default
            for tma in ((True, False) if D == 128 else (False,)):
                c = dict(GROUP=group, DTYPE=bf16, PS=64, HALF=D // 2, BLOCK_H=16, ROTATE=rotate, PREC="tf32",
                         IDX64=False, TMA=tma)
                r = resources(kt._decode_split_kernel, c, warps, 2, args.arch, (64, D) if tma else None)
                label = f"{'' if tma else 'default: '}16 rows, {warps} warps, 2 stages{', TMA' if tma else ''}"
                rows.append(("decode", D, rotate, label, r))
    print(f"sm_{args.arch}a, triton {triton.__version__}, bf16, page size 64\n")
    print("| kernel | head dim | rotate | config | registers | spill stores / loads (bytes) | shared (bytes) | "
          "programs/SM | async tile loads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kernel, D, rotate, cfg, r in rows:
        print(f"| {kernel} | {D} | {rotate} | {cfg} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
              f"{r['shared']} | {r['programs_per_sm']} | {r['async_tiles']} |")


if __name__ == "__main__":
    main()
