"""scripts/kernel_regs.py: compiles the kernels for sm_90a without a GPU and reads ptxas's report."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton ships no ptxas here")
def test_kernel_regs_table():
    # a fresh process: the kernel tests import Triton under its interpreter, which compiles nothing
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_regs.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| prefill") or
            line.startswith("| decode")]
    assert len(rows) == 24
    for row in rows:
        regs = int(row[4])
        stores, loads = (int(x) for x in row[5].split("/"))
        assert 0 < regs <= 255 and stores >= 0 and loads >= 0 and int(row[6]) > 0
