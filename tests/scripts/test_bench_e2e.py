"""scripts/bench_e2e.py end to end on the CPU with a tiny model: the benchmark itself must run
(its numbers here mean nothing; the H200 runs are in docs/benchmarks.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_e2e_runs_every_workload(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the PyTorch reference kernels
    env["OUT"] = str(tmp_path / "out")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "8",
           "--doc-tokens", "64", "--requests", "12", "--full-requests", "4", "--poisson-requests", "6",
           "--rates", "0.9", "--rounds", "2", "--sweep-docs", "4", "--cache-gb", "0.5", "--batch-size", "4",
           "--warm", "--eager-too"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]
    assert [r["mode"] for r in res["closed"]] == ["lazy", "block", "full"]
    assert [r["mode"] for r in res["uniform"]] == ["lazy", "block"]
    assert len(res["earlier_rounds"]) == 4  # round 1 of closed and uniform, both modes
    assert all(r["requests"] == 12 for r in res["closed"][:2] + res["uniform"] + res["eager"] + res["warm"])
    assert all(r["hit_ratio"] == 1.0 and r["warm"] for r in res["warm"])  # nothing left to read after warming
    assert all(r["hit_ratio"] < 1.0 for r in res["closed"][:2])  # a cold run misses every chunk once
    assert {r["mode"] for r in res["poisson"]} == {"lazy", "block"}
    assert {r["mode"] for r in res["sweep"]} == {"lazy", "block"}
    assert "**ratios** zipf" in run.stdout


def test_bench_e2e_batch_sweep_with_recompute(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path / "out")
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the benchmark's stores go: deleted when it ends
    (tmp_path / "tmp").mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "6",
           "--doc-tokens", "96", "--requests", "6", "--full-requests", "3", "--cache-gb", "0.5",
           "--recompute", "0.3", "--batch-sizes", "2,4", "--page-size", "32", "--sweep-requests", "4,6",
           "--uniform-too"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]["batch_sweep"]
    configs = [("zipf", "lazy", 0.0, False, "given"), ("zipf", "full", 0.0, False, "given"),
               ("zipf", "lazy", 0.3, True, "given"), ("zipf", "lazy", 0.3, True, "popular"),
               ("zipf", "lazy", 0.3, False, "given"), ("zipf", "block", 0.3, False, "given"),
               ("uniform", "lazy", 0.0, False, "given"), ("uniform", "lazy", 0.3, True, "given"),
               ("uniform", "lazy", 0.3, True, "popular"), ("uniform", "lazy", 0.3, False, "given")]
    assert [(r["sweep_requests"], r["workload"], r["mode"], r["recompute"], r["reuse"], r["order"], r["batch_size"])
            for r in rows] == [(n, *c, b) for n in (4, 6) for c in configs for b in (2, 4)]
    assert all(r["requests"] == (3 if r["mode"] == "full" else r["sweep_requests"]) for r in rows)
    assert all(r["page_size"] == 32 for r in rows)
    recomputing = [r for r in rows if r["recompute"] and r["mode"] == "lazy"]
    assert all(r["recomputed_tokens_per_req"] > 0 and r["recompute_floor_ms_per_req"] > 0 for r in recomputing)
    assert all(r["reused_tokens_per_req"] == 0 for r in recomputing if not r["reuse"])
    assert "| tiny | zipf | 6 | cold | block | 0.3 attention |" in run.stdout
    assert "| tiny | zipf | 4 | cold | lazy | 0.3 attention | reuse, popular |" in run.stdout
    assert list((tmp_path / "tmp").glob("lazyrag-e2e-*")) == []


def test_bench_e2e_host_tier_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path / "out")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "8",
           "--doc-tokens", "64", "--requests", "6", "--batch-size", "3", "--cache-gb", "0.5", "--skip-full",
           "--host-tier", "5"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    without, with_tier = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]["host_tier"]
    assert without["cache_gb"] == with_tier["cache_gb"] and without["host_cache_gb"] == 0 < with_tier["host_cache_gb"]
    assert without["host_hits"] == 0 < with_tier["host_hits"]  # misses the small GPU cache evicted come back
    assert "**ratio** host tier" in run.stdout and "read wait share" in run.stdout


def test_bench_e2e_from_disk_rows_beside_the_disk_rate(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path / "out")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "6",
           "--doc-tokens", "96", "--requests", "6", "--cache-gb", "0.5", "--recompute", "0", "--skip-full",
           "--skip-block", "--batch-sizes", "4", "--page-size", "32", "--warm", "--from-disk"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]["batch_sweep"]
    assert [(r["warm"], r["disk"]) for r in rows] == [(False, False), (True, False), (False, True)]
    disk = rows[-1]
    assert disk["bytes_read"] == rows[0]["bytes_read"] > 0  # every chunk read again, from the disk
    assert disk["disk_gb_s"] > 0 and disk["disk_sample_bytes"] > 0
    seconds = disk["bytes_read"] / (disk["disk_gb_s"] * 1e9)
    assert abs(disk["disk_bound_req_per_s"] - 6 / seconds) < 1e-3 * disk["disk_bound_req_per_s"] + 1e-3
    assert "| tiny | zipf | 6 | cold, from disk | lazy | 0 |" in run.stdout
    assert "from disk / min(page cache, disk bound)" in run.stdout


def test_bench_e2e_cold_variants_and_step_log_variants(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path / "out")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--models", "random:tiny", "--docs", "6",
           "--doc-tokens", "64", "--requests", "4", "--cache-gb", "0.5", "--skip-full", "--skip-block",
           "--recompute", "0", "--batch-sizes", "2", "--batch-size", "2", "--host-checksums-too",
           "--lookahead-too", "3", "--step-log", "4", "--staging-gb", "0.5"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())["results"][0]
    assert [r["mode"] for r in res["batch_sweep"]] == ["lazy", "lazy, crc32c on the host", "lazy, look-ahead 3"]
    assert all("error" not in r for r in res["batch_sweep"])
    assert set(res["step_log"]) == {"cold", "warm", "cold, 0.5 GB of staging", "cold, crc32c on the host"}
    cold = res["step_log"]["cold"]
    assert cold["loads"] > 0 and cold["allocations"] == {}  # no CUDA: nothing to count
    step = cold["prefills"][0]
    assert step["sequences"] > 0 and 0 < step["cpu_ms"] <= step["host_ms"] * 1.05 + 1
    assert all(step[k] >= 0 for k in ("cut_ms", "plan_ms", "pack_ms", "upload_ms", "graphs_ms", "gil_late_max_ms"))
    assert cold["gil_late_ms"]["p50"] <= cold["gil_late_ms"]["max"]


def bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e_module", ROOT / "scripts" / "bench_e2e.py")
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    return bench


def test_loader_defaults_patches_the_named_defaults_and_restores_them():
    from lazyrag.serve.loader import ChunkLoader

    bench = bench_module()
    before = ChunkLoader.__init__.__defaults__
    names = ChunkLoader.__init__.__code__.co_varnames[1: ChunkLoader.__init__.__code__.co_argcount]
    with bench.loader_defaults(check_on_device=False, staging_bytes=123):
        patched = dict(zip(names[len(names) - len(before):], ChunkLoader.__init__.__defaults__))
        assert patched["check_on_device"] is False and patched["staging_bytes"] == 123
        assert patched["host_cache_bytes"] == 0 and patched["read_threads"] is None
    assert ChunkLoader.__init__.__defaults__ == before


def test_full_collections_counts_only_the_oldest_generation_inside_the_context():
    import gc

    bench = bench_module()
    seen = {}
    with bench.full_collections(seen):
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)  # after the context: not counted
    assert seen["count"] == 2 and 0 < seen["max_ms"] <= seen["ms"]


def test_the_sweep_table_sets_each_cold_run_against_the_warm_run_of_its_requests():
    def row(n, warm, mode, batch, rate, disk=False):
        return {"sweep_requests": n, "requests": n, "warm": warm, "mode": mode, "recompute": 0.0, "disk": disk,
                "batch_size": batch, "req_per_s": rate, "ttft_ms": {"mean": 1.0}}

    rows = [row(200, False, "lazy", 64, 150.0), row(200, False, "lazy", 128, 170.0),
            row(200, False, "lazy, crc32c on the host", 128, 160.0), row(1000, False, "lazy", 128, 240.0),
            row(200, True, "lazy", 64, 190.0), row(200, True, "lazy", 128, 200.0),
            row(1000, True, "lazy", 128, 300.0), row(200, False, "lazy", 128, 100.0, disk=True)]
    lines = bench_module().sweep_table([{"model": "random:tiny", "batch_sweep": rows}]).splitlines()

    def ratio(requests, cache, mode):
        line = next(x for x in lines if x.startswith(f"| tiny | zipf | {requests} | {cache} | {mode} |"))
        return line.split(" | ")[9]

    assert ratio(200, "cold", "lazy") == "0.85x"  # best against best: 170 / 200
    assert ratio(200, "cold", "lazy, crc32c on the host") == "0.80x"
    assert ratio(1000, "cold", "lazy") == "0.80x"
    assert ratio(200, "cold, from disk", "lazy") == "0.50x"
    assert ratio(200, "warm", "lazy") == ""


def test_kernel_time_counts_overlapping_kernels_once():
    bench = bench_module()
    assert bench.covered_us([]) == 0
    assert bench.covered_us([(5, 9), (0, 2), (1, 3), (6, 7), (9, 10)]) == 3 + 5  # 0-3 and 5-10
    table = bench.profile_table([{"model": "random:x", "profile": {
        "lazy": {"req_per_s": 1.0, "seconds": 2.0, "gpu_busy_share": 1.04, "kernels_busy_share": 0.8, "h2d_copy_s": 0.2,
                 "host_sync_wait_s": 0.1},
        "block": {"req_per_s": 1.0, "seconds": 2.0, "gpu_busy_share": 0.5, "h2d_copy_s": 0.2, "host_sync_wait_s": 0.1}}}])
    assert "| x | lazy | 1.0 | 2.00 | 104% | 80% |" in table and "| x | block | 1.0 | 2.00 | 50% | - |" in table
