"""scripts/bench_store.py on the CPU with a tiny store: the benchmark itself must run and read
every chunk it wrote (its numbers here mean nothing; docs/benchmarks.md has the real ones)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_store_reads_back_every_chunk_it_wrote(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_store.py"), "--gib", "0.002", "--layers", "2",
           "--kv-heads", "2", "--head-dim", "16", "--chunk-tokens", "64", "--chunks-per-segment", "16",
           "--threads", "1,3", "--piece-mib", "0.001", "--dir", str(tmp_path), "--bounds", "--json"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout)
    assert res["store"]["chunks"] >= 16 and res["store"]["bytes"] >= 0.002 * 2**30
    for key in ("dd_cold_GBps", "cold_1threads_GBps", "cold_3threads_GBps", "page_cache_1threads_GBps",
                "page_cache_3threads_GBps", "zarr_cold_GBps", "append_GBps"):
        assert res[key] > 0, key
    for key in ("memcpy", "files", "files_crc"):
        assert res["bounds"][f"{key}_1"] > 0 and res["bounds"][f"{key}_3"] > 0, key
    for key in ("first_read_faulted", "first_read_populated", "read_again"):
        assert res["bounds"][key] > 0, key
