"""lazyrag/workload.py: the paper's synthetic workload is seeded, and Zipf popularity is skewed
where uniform is not."""
from collections import Counter

from lazyrag.workload import PAPER, SYNTHETIC, Workload, documents, queries


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    w = Workload(docs=20, doc_tokens=64)
    assert documents(w, seed=0) == documents(w, seed=0)
    assert queries(w, 30, seed=1) == queries(w, 30, seed=1)
    assert queries(w, 30, seed=1) != queries(w, 30, seed=2)
    assert documents(w, seed=0) != documents(w, seed=3)


def test_documents_and_queries_have_the_asked_sizes():
    w = Workload(docs=12, doc_tokens=100, per_prompt=4, question_tokens=20)
    docs = documents(w)
    assert [d["id"] for d in docs] == [f"doc{i:03d}" for i in range(12)]
    assert all(len(d["text"]) == 100 and d["text"].replace(" ", "").isalpha() for d in docs)
    qs = queries(w, 50)
    assert len({q["id"] for q in qs}) == 50
    assert all(len(q["question"]) == 20 for q in qs)
    assert all(len(q["docs"]) == 4 == len(set(q["docs"])) and set(q["docs"]) <= {d["id"] for d in docs} for q in qs)


def test_zipf_popularity_is_skewed_and_uniform_is_not():
    def top_share(w: Workload) -> float:
        uses = Counter(d for q in queries(w, 400) for d in q["docs"])
        return sum(n for _, n in uses.most_common(10)) / sum(uses.values())

    zipf, uniform = top_share(SYNTHETIC["paper"]), top_share(SYNTHETIC["uniform"])
    assert PAPER.alpha == 2.1 and SYNTHETIC["uniform"].alpha is None
    # the 10 most used of 100 documents: most references under Zipf(2.1); near a tenth under uniform
    # (the 10 most used of a uniform draw are a little above it)
    assert zipf > 0.7 and 0.08 < uniform < 0.2
    # the most popular document under Zipf is doc000, named by most queries
    first = Counter(d for q in queries(PAPER, 400) for d in q["docs"]).most_common(1)[0]
    assert first[0] == "doc000" and first[1] > 300
