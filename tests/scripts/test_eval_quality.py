"""scripts/eval_quality.py's splits: news questions that share popular documents, and the MuSiQue
selection questions alone."""

import argparse
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


def load_script():
    spec = importlib.util.spec_from_file_location("eval_quality", ROOT / "scripts" / "eval_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (DATA / "news").is_dir(), reason="needs ../shared/data/news")
def test_each_shared_news_prompt_holds_its_own_document_and_four_from_a_popular_pool(tmp_path):
    script = load_script()
    args = argparse.Namespace(data=DATA, work=tmp_path, news_limit=20)
    rows = script.shared_news_queries(args, pool=20)
    own = {r["id"]: r["id"].replace("news-q", "news-") for r in rows}
    assert len(rows) == 20
    pool = set()
    for r in rows:
        assert len(r["docs"]) == len(set(r["docs"])) == 5 and own[r["id"]] in r["docs"]
        pool |= set(r["docs"]) - {own[r["id"]]}
    assert len(pool) <= 20 and not pool & set(own.values())
    uses = Counter(d for r in rows for d in r["docs"])
    assert uses.most_common(1)[0][1] >= 15  # Zipf(2.1): the most popular document is in most prompts
    written = (tmp_path / "news-shared-corpus.jsonl").read_text().splitlines()
    assert len(written) == len(uses)
    assert rows == script.shared_news_queries(args, pool=20)  # seeded


@pytest.mark.skipif(not (DATA / "musique").is_dir(), reason="needs ../shared/data/musique")
def test_the_selection_split_alone_takes_the_first_questions_and_only_their_documents(tmp_path):
    script = load_script()
    args = argparse.Namespace(data=DATA, work=tmp_path, per_split=5)
    both = script.musique_queries(args)
    select = script.musique_queries(args, report=False)
    assert select == both[:5] and len(both) == 10  # 1-5, then 76-80
    written = [json.loads(line)["id"] for line in (tmp_path / "musique-select-corpus.jsonl").read_text().splitlines()]
    assert sorted(written) == sorted({d for q in select for d in q["docs"]})
