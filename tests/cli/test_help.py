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
