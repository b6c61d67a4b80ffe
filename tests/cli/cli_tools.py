"""What the command-line tests share: the app called in-process, and small random:tiny stores."""

import json
from pathlib import Path

from typer.testing import CliRunner

from lazyrag.cli import app

DEMO = Path(__file__).parents[2] / "examples" / "demo"
TINY = ("--model", "random:tiny", "--device", "cpu")
runner = CliRunner()


def cli(*args, env=None):
    """`lazyrag ARGS`, in-process; stdout and stderr apart, exceptions propagated (a traceback
    escaping the command line fails the test)."""
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env=env)


def demo_docs(*ids):
    rows = [json.loads(line) for line in (DEMO / "corpus.jsonl").read_text().splitlines()]
    return "".join(json.dumps(r) + "\n" for r in rows if r["id"] in ids)


def write_jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def index_docs(store, tmp_path, *ids, kv_dtype="auto"):
    """A random:tiny store of the demo documents `ids`."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(demo_docs(*ids))
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", "256", "--kv-dtype", kv_dtype, "-q")
    assert res.exit_code == 0, res.output
    return store


def answer(queries, store, out, *args):
    """`lazyrag answer` on the CPU with a small pool and short answers."""
    return cli("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--cache-gb", "0.02",
               "--max-new-tokens", "2", *args)


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def last_run(store):
    res = cli("stats", "--store", store, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["runs"][-1]


def corpus_of(tmp_path, **docs):
    """A corpus folder of one .txt file per keyword: name -> text."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for name, text in docs.items():
        (corpus / f"{name}.txt").write_text(text)
    return corpus
