"""scripts/kernel_regs.py: compiles the kernels for sm_90a without a GPU and reads ptxas's report."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Triton is not imported here: the kernel tests must be the first to import it, under its
# interpreter; the script runs in a fresh process without TRITON_INTERPRET.
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernel_regs_table():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_regs.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines()
            if line.startswith("| prefill") or line.startswith("| decode")]
    assert len(rows) >= 24
    for row in rows:
        regs = int(row[4])
        stores, loads = (int(x) for x in row[5].split("/"))
        assert 0 < regs <= 255 and stores >= 0 and loads >= 0 and int(row[6]) > 0
