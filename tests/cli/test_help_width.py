"""Every command's --help is readable in an 80-column terminal: no line runs past 80 columns, and
each option's text has a column of at least 30 characters (not a sliver beside wide option names)."""
import re

import pytest
import typer

from cli_tools import cli

from lazyrag.cli import app

WIDTH, NARROWEST_TEXT = 80, 30
COMMANDS = sorted(typer.main.get_command(app).commands)
ENV = {"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)}


def text_columns(help_text: str) -> list[int]:
    """Where each line of option text starts in the Options section: beside the option's names
    (after a gap of two spaces or more) or on a line of its own, indented."""
    section = help_text.split("\nOptions:\n", 1)[1]
    starts = []
    for line in section.splitlines():
        if not line.strip() or not line.startswith(" "):
            break  # the section ends at a blank or unindented line
        beside = re.match(r"(  -\S.*?\s{2,})\S", line)
        if beside:
            starts.append(len(beside.group(1)))
        elif not line.startswith("  -"):
            starts.append(len(line) - len(line.lstrip()))
    return starts


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS], ids=lambda c: " ".join(c) or "lazyrag")
def test_help_fits_80_columns_with_a_wide_text_column(command):
    res = cli(*command, "--help", env=ENV)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    starts = text_columns(res.stdout)
    assert starts, res.stdout
    assert WIDTH - max(starts) >= NARROWEST_TEXT, res.stdout


def test_every_command_is_measured():
    assert {"index", "answer", "bench", "stats", "check", "compact"} <= set(COMMANDS)
