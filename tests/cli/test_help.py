"""What the command line says about itself: --version, and help text as written."""

from importlib.metadata import version

from cli_tools import cli


def test_version_prints_the_installed_version():
    res = cli("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"lazyrag {version('lazyrag')}"


def test_data_parallel_help_names_the_extra_it_needs():
    res = cli("answer", "--help", env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "(needs lazyrag[ray])" in res.stdout  # rich markup would eat an unescaped [ray]


def test_stats_of_a_real_run_fits_an_80_column_terminal(tmp_path):
    import os
    import subprocess
    import sys

    from cli_tools import index_docs, write_jsonl

    store = index_docs(tmp_path / "s.zarr", tmp_path, "saturn")
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "q", "question": "Rings?", "docs": ["saturn"]})
    res = cli("answer", queries, "--store", store, "--out", tmp_path / "a.jsonl", "--device", "cpu",
              "--max-new-tokens", 2, "-q")
    assert res.exit_code == 0, res.output
    # a process of its own: the console takes its width from COLUMNS when it is made
    shown = subprocess.run([sys.executable, "-m", "lazyrag.cli", "stats", "--store", store], capture_output=True,
                           text=True, env={**os.environ, "COLUMNS": "80"}, check=True).stdout
    assert "cache memory" in shown and "…" not in shown
    assert max(map(len, shown.splitlines())) <= 80
