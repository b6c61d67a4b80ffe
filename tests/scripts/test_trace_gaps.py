"""scripts/trace_gaps.py: the GPU's idle time in a profiler trace, by the host phase that ran
meanwhile, and how much of its copies ran beside kernels; and bench_e2e --trace, which writes such
traces with the engine's phases labelled, and --step-log, which times the same phases without a
profiler."""
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """A script of scripts/ as a module, loaded from its file (scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trace_gaps = load_script("trace_gaps")


def event(cat, name, ts, dur):
    """A complete event; times in ms (the trace's are us)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts * 1000, "dur": dur * 1000}


def test_idle_time_is_split_by_the_host_phase_around_it(tmp_path):
    events = [event("kernel", "mm", 0, 10), event("kernel", "mm", 5, 10),  # busy 0-15
              event("gpu_memcpy", "HtoD", 40, 20),                        # busy 40-60
              event("kernel", "attn", 90, 10),                            # busy 90-100
              event("gpu_memcpy", "HtoD", 92, 4),                         # a copy beside that kernel
              event("user_annotation", "lazyrag.Runner.prefill", 10, 40),  # 10-50: idle 15-40 inside
              event("user_annotation", "lazyrag.Runner.prefill", 55, 40),  # 55-95: idle 60-90 inside
              event("user_annotation", "lazyrag.Scheduler.schedule", 60, 10),
              event("cpu_op", "aten::mm", 0, 100)]                        # not GPU work
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    text = trace_gaps.summarize(trace_gaps.load(path))
    assert text.startswith("span 100.0 ms, GPU busy 45.0 ms (45.0%), idle 55.0 ms in 2 gaps")
    assert text.splitlines()[1] == "kernels 25.0 ms, copies 24.0 ms, of them 4.0 ms (17%) while kernels ran"
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines()[4:]}
    assert rows["Runner.prefill"] == ["2", "80.0", "55.0 |"]
    assert rows["Scheduler.schedule"] == ["1", "10.0", "10.0 |"]
    assert trace_gaps.overlap(np.array([[10.0, 50.0], [55.0, 95.0]]), np.array([[15.0, 40.0], [60.0, 90.0]])) == 55.0
    assert trace_gaps.merged(np.array([[5.0, 15.0], [0.0, 10.0], [20.0, 30.0]])).tolist() == [[0, 15], [20, 30]]


def test_bench_e2e_writes_labelled_traces(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the PyTorch reference kernels
    env["OUT"] = str(tmp_path / "out")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "6",
           "--doc-tokens", "128", "--requests", "4", "--cache-gb", "0.5", "--recompute", "0.2",
           "--recompute-policy", "attention", "--batch-sizes", "4", "--batch-size", "4", "--skip-full",
           "--profile", "4", "--trace", "--step-log", "4"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for mode in ("lazy", "block"):
        names = {e.get("name") for e in trace_gaps.load(tmp_path / "out" / f"trace-{mode}.json.gz")}
        assert {"lazyrag.Runner.prefill", "lazyrag.Runner.row_attention", "lazyrag.Scheduler.schedule"} <= names
    result = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]
    steps = result["step_log"]  # --step-log: the same phases timed without a profiler
    assert sum(p["sequences"] for p in steps["cold"]["prefills"]) == 4 and steps["cold"]["loads"] > 0
    assert steps["warm"]["loads"] == 0 and steps["warm"]["decode_steps"] > 0
    profiled = result["profile"]
    phases = {k.split(" x")[0]: v for k, v in profiled["lazy"]["host_phases_ms"].items()}
    assert phases["Runner.row_attention"] > 0 and phases["Engine._choose_recompute"] >= phases["Runner.row_attention"]
