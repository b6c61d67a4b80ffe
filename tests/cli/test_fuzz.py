"""Generated corpus and query files (seeded: random bytes, truncated JSON, wrong types, huge
fields, empty lines, byte order marks, non-UTF-8, deep nesting) through `index` and `answer`:
none may end in a traceback, and each exits 0 or 3 (bad input). Then pathological questions and
documents (empty, whitespace only, 100k characters, control characters, unpaired surrogates,
deeply nested JSON, numbers as ids): each line is answered or indexed, or named by its line."""

import json
import random

import pytest
from cli_tools import TINY, cli, index_docs

CORPUS_FILES, QUERY_FILES = 95, 110  # through `index` and `answer`: 205 files

WRONG = [None, 0, -1, 1.5, True, [], {}, [1, None], {"a": 1}, "", " ", "\x00", 10**30]


def _valid_doc(rng, i):
    return {"id": f"d{i}", "text": " ".join(rng.choice(["alpha", "beta", "rings.", "moon", "\n\n"])
                                           for _ in range(rng.randint(1, 60)))}


def _valid_query(rng, i):
    return {"id": f"q{i}", "question": "What about the rings?",
            rng.choice(["docs", "chunks"]): [rng.choice(["saturn", "nope", "jupiter"])]}


def _mangle(rng, obj, huge):
    """One of the ways a line goes wrong, starting from a valid object."""
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
    text = json.dumps(obj)
    if kind == 1:
        return text[: rng.randint(0, len(text) - 1)].encode()
    if kind == 2:
        return json.dumps({**obj, rng.choice(list(obj) + ["title", "answers"]): rng.choice(WRONG)}).encode()
    if kind == 3:
        return json.dumps({**obj, rng.choice(list(obj)): "x" * huge}).encode()
    if kind == 4:
        return b"\xef\xbb\xbf" + text.encode()
    if kind == 5:
        data = bytearray(text.encode())
        data[rng.randrange(len(data))] = rng.choice([0xff, 0xc3, 0x80, 0xfe])
        return bytes(data)
    if kind == 6:
        return b"[" * rng.randint(1, 5000) + b"]" * rng.randint(0, 3)
    return json.dumps(rng.choice(WRONG + [[obj], "text"])).encode()


def _file(rng, valid, huge, valid_share):
    lines = []
    for i in range(rng.randint(0, 6)):
        if rng.random() < 0.15:
            lines.append(b"" if rng.random() < 0.5 else b"   \t")
        elif rng.random() < valid_share:
            lines.append(json.dumps(valid(rng, i)).encode())
        else:
            lines.append(_mangle(rng, valid(rng, i), huge))
    return b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")


def _check(res, what):
    assert "Traceback" not in res.output, (what, res.output[-2000:])
    assert res.exit_code in (0, 3), (what, res.exit_code, res.output[-2000:])
    return res.exit_code


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    return index_docs(tmp / "s.zarr", tmp, "saturn", "jupiter")


def test_fuzzed_corpus_files_never_end_in_a_traceback(tmp_path):
    rng = random.Random(1234)
    codes = set()
    for n in range(CORPUS_FILES):
        corpus = tmp_path / f"c{n}.{rng.choice(['jsonl', 'jsonl', 'txt', 'md'])}"
        corpus.write_bytes(_file(rng, _valid_doc, rng.choice([2_000, 8_000]), valid_share=0.25))
        args = ["index", corpus, "--store", tmp_path / f"s{n}.zarr", *TINY, "--chunk-tokens", 128, "-q"]
        codes.add(_check(cli(*args, *(["--skip-bad"] if n % 2 else [])), corpus))
    assert codes == {0, 3}  # some files indexed, some refused


def test_fuzzed_query_files_never_end_in_a_traceback(store, tmp_path):
    rng = random.Random(5678)
    codes = set()
    for n in range(QUERY_FILES):
        queries = tmp_path / f"q{n}.jsonl"
        queries.write_bytes(_file(rng, _valid_query, rng.choice([2_000, 1_100_000]), valid_share=0.04))
        codes.add(_check(cli("answer", queries, "--store", store, "--out", tmp_path / f"a{n}.jsonl",
                             "--device", "cpu", "--cache-gb", "0.02", "--max-new-tokens", 1, "-q"), queries))
    assert codes == {0, 3}  # some files answered, some refused


# Pathological fields, each written as one JSONL line (a str is written as it is, raw JSON).
LONG = " ".join(["alpha", "beta", "rings", "moon"] * 25_000)[:100_000]
NESTED = "[" * 100_000 + "]" * 100_000
ODD_TEXTS = {
    "empty": "", "whitespace": " \t\n\r\n ", "100k characters": LONG, "control characters": "a\x00b\x01c\x1b[31md\x7f",
    "lone surrogate": "rings \ud800 moon", "reversed surrogates": "\udc00\ud800", "only a newline": "\n",
    "right-to-left and zero-width": "\u202erings\u200b\u200dmoon\ufeff",
}
ODD_LINES = [
    '{"id": "nested", "question": ' + NESTED + "}", '{"id": "nested-object", ' + '"a": {' * 50_000 + "}" * 50_000 + "}",
    '{"id": 7, "question": "Number as id?", "docs": ["saturn"]}', '{"id": 1e400, "question": "Huge number?"}',
    '{"id": "nan", "question": "NaN answers?", "docs": ["saturn"], "answers": [NaN]}',
    '{"id": "num-question", "question": 12345}', '{"id": "num-docs", "question": "Docs by number?", "docs": [0, 1]}',
    '{"id": "dup", "question": "Once?", "docs": ["saturn"]}', '{"id": "dup", "question": "Twice?", "docs": ["saturn"]}',
]


def pathological_queries(path):
    lines = [json.dumps({"id": f"q-{name}", "question": text, "docs": ["saturn"]}) for name, text in ODD_TEXTS.items()]
    lines += [json.dumps({"id": f"r-{name}", "question": text}) for name, text in ODD_TEXTS.items()]  # retrieved
    lines.append(json.dumps({"id": "x" * 100_000, "question": "A long id?", "docs": ["saturn"]}))
    lines += ODD_LINES
    path.write_text("\n".join(lines) + "\n", errors="surrogatepass")
    return len(lines)


def line_numbers(messages, path):
    """The line numbers that messages of the form `path:line: reason` name."""
    numbers = set()
    for m in messages:
        assert m.startswith(f"{path}:"), m
        numbers.add(int(m[len(str(path)) + 1:].split(":", 1)[0]))
    return numbers


def test_pathological_questions_are_answered_or_reported_by_line(store, tmp_path):
    queries, out = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    count = pathological_queries(queries)
    # a prompt over --max-prompt-tokens is listed as failed, with its line, before it costs a prefill
    res = cli("answer", queries, "--store", store, "--out", out, "--device", "cpu", "--cache-gb", "0.02",
              "--max-new-tokens", 2, "--max-prompt-tokens", 2048, "-q")
    _check(res, queries)
    assert res.exit_code == 0
    reported = [line.removeprefix("warning: ") for line in res.stderr.splitlines() if line.startswith("warning: ")]
    bad = line_numbers(reported, queries)
    answered = {r["id"] for r in map(json.loads, out.read_text().splitlines())}
    errors_file = out.with_name("a.errors.jsonl")
    failed = [json.loads(line) for line in errors_file.read_text().splitlines()] if errors_file.exists() else []
    # every line ends up somewhere: answered, or named by its line (a bad line, or a failed query)
    assert all(isinstance(f.get("line"), int) for f in failed)
    assert len(answered) + len(bad | {f["line"] for f in failed}) == count, (answered, failed, reported)
    assert {"q-control characters", "q-100k characters", "num-docs", "dup"} <= answered | {f["id"] for f in failed}
    assert not {"q-empty", "q-whitespace", "q-lone surrogate", "nested", "num-question"} & answered


def test_pathological_documents_are_indexed_or_reported_by_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    lines = [json.dumps({"id": f"d-{name}", "text": text}) for name, text in ODD_TEXTS.items()]
    lines += [json.dumps({"id": 12, "text": "A number as id."}), json.dumps({"id": "\ud800", "text": "Surrogate id."}),
              json.dumps({"id": "t", "text": "Odd title.", "title": "\udfff"}),
              '{"id": "nested", "text": ' + NESTED + "}", '{"id": "big", "text": "Huge number.", "title": 1e400}']
    corpus.write_text("\n".join(lines) + "\n", errors="surrogatepass")
    store = tmp_path / "s.zarr"
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", 128, "-q")
    _check(res, corpus)
    assert res.exit_code == 3 and line_numbers([res.stderr.strip().removeprefix("error: ")], corpus)
    res = cli("index", corpus, "--store", store, *TINY, "--chunk-tokens", 128, "-q", "--skip-bad", "--json")
    _check(res, corpus)
    assert res.exit_code == 0
    skipped = [line.removeprefix("skipped: ") for line in res.stderr.splitlines() if line.startswith("skipped: ")]
    bad = line_numbers(skipped, corpus)
    result = json.loads(res.stdout)
    assert result["bad_skipped"] == len(bad)
    assert result["documents_total"] + result["documents_empty"] + len(bad) == len(lines)
    assert {5, 10, 11, 12} <= bad  # a lone surrogate in text, id or title; nested JSON
