"""scripts/bench_index.py on the CPU with the default model's tiny stand-in: its rows, and with
--trace the two profiled runs' traces and summaries (the H200 figures are in docs/benchmarks.md)."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_index_reports_its_rows_and_traces(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = str(tmp_path)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_index.py"), "--model", "random:tiny", "--docs", "3",
           "--doc-tokens", "128", "--chunk-tokens", "64", "--writers", "2", "--piece-mb", "16", "--trace",
           "--dir", str(tmp_path / "store")]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    table = (tmp_path / "bench_index.md").read_text()
    for row in ("bare forward", "index / min(forward, disk)", "index's timeline", "1 / 2 at once"):
        assert row in table
    values = {k.strip(): v.strip() for k, v in (line.strip("|").split("|", 1) for line in table.splitlines()[2:])}
    timeline = values["index's timeline"]
    assert " fsyncs (" in timeline and " catalog commits (" in timeline  # what the writes spent flushing
    row, written = (float(x.split()[0].replace(",", "")) for x in
                    values["KV per token: a row / written (pages padded)"].split(" / "))
    assert written > row  # 64-token chunks and a preamble in 16-token pages: some padding
    mb_s, tok_s = values["disk, mean of the better before and after"].split(" = ")
    # the disk's tokens/s are its bytes/s over the bytes index writes a token, padding included
    assert abs(float(tok_s.split()[0].replace(",", "")) - float(mb_s.split()[0].replace(",", "")) * 1e6 / written) \
        <= 1e-3 * float(tok_s.split()[0].replace(",", "")) + 1
    for name in ("bare", "index"):
        events = json.load(gzip.open(tmp_path / f"trace-index-{name}.json.gz", "rt"))["traceEvents"]
        assert any(e.get("name") == "lazyrag.encode" for e in events)
        assert f"## {name}, under the profiler" in run.stdout
