"""Generated corpus and query files (seeded: random bytes, truncated JSON, wrong types, huge
fields, empty lines, byte order marks, non-UTF-8, deep nesting) through `index` and `answer`:
none may end in a traceback, and each exits 0 or 3 (bad input)."""

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
