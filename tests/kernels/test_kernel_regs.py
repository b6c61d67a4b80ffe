"""scripts/kernel_regs.py: compiles the kernels for sm_90a without a GPU and reads ptxas's report."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernel_regs_table():
    from lazyrag.kernels import tuning

    # the script compiles: it runs in a fresh process without TRITON_INTERPRET
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_regs.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| prefill") or line.startswith("| decode")]
    bits = [line for line in run.stdout.splitlines() if line.startswith("| bit_rows")]
    assert len(bits) == 1 and "| 0 / 0 |" in bits[0], bits  # compiles for sm_90a, spills nothing
    assert len(rows) >= 12
    for row in rows:
        regs = int(row[4])
        stores, loads = (int(x) for x in row[5].split("/"))
        assert 0 < regs <= 255 and stores >= 0 and loads >= 0 and int(row[6]) > 0 and int(row[7]) >= 1
        # compiled as a launch specialises it, every kernel's key loop loads its K/V tiles
        # asynchronously (compiled without the launch's alignment marks, none does)
        assert int(row[8]) >= 2, row
    # lazy_prefill and lazy_decode size their split counts by the resident programs per SM
    # the tuning table assumes for their default launches: as ptxas allocates them for sm_90a
    for kernel, table in (("prefill", tuning.prefill), ("decode", tuning.decode)):
        from_ptxas = {int(r[1]): int(r[7]) for r in rows
                      if r[0] == kernel and r[2] == "True" and r[3].startswith("default:")}
        assert from_ptxas == {D: table(D, tuning.HOPPER).programs_per_sm for D in (128, 64)}, kernel
