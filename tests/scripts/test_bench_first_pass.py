"""scripts/bench_first_pass.py on the CPU with a tiny model: its fresh processes run and report
(nothing is pinned on the CPU; the H200 figures are in docs/benchmarks.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_first_pass_runs_its_fresh_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path)
    env["TMPDIR"] = str(tmp_path)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_first_pass.py"), "--model", "random:tiny", "--docs", "6",
           "--doc-tokens", "64", "--requests", "8", "--batch-size", "4", "--cache-gb", "0.5", "--repeats", "1",
           "--under-reads-too"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_first_pass.json").read_text())
    assert [r["pinned"] for r in rows] == ["ahead, while the model loads", "under the first reads"]
    assert all(r["first_s"] > 0 and r["second_s"] > 0 and r["buffers"] > 0 for r in rows)
    assert "first pass speed / second" in (tmp_path / "bench_first_pass.md").read_text()
    assert not list(tmp_path.glob("lazyrag-e2e-first-*"))  # the store is deleted
