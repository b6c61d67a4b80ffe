"""The engine fails a request alone for an error that concerns it (lazyrag/serve/faults.py): token
ids outside the vocabulary, out of memory in its prefill or decode, a batch retried one at a time;
everything it held is given back, and an error that concerns every request still ends the run
(random:tiny on the CPU)."""

import pytest
import torch
from serve_stores import make_store, request

from lazyrag.models.prompt import PromptFormat
from lazyrag.serve import Engine, Recompute, faults
from lazyrag.serve.faults import BadTokens, concerns_request
from lazyrag.store import ChunkReadError, StoreError


def test_what_concerns_one_request_and_what_ends_the_run():
    assert concerns_request(torch.OutOfMemoryError("CUDA out of memory"))
    assert concerns_request(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9"))
    assert concerns_request(ChunkReadError("chunk c is corrupt", "c", "s"))
    assert concerns_request(BadTokens("token 999"))
    assert not concerns_request(StoreError("the store is gone"))
    assert not concerns_request(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not concerns_request(KeyboardInterrupt())
    assert not concerns_request(AttributeError("a bug"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = make_store(tmp_path_factory.mktemp("faults"), "random:tiny")
    yield s
    s.close()


def requests(store, tiny):
    fmt = PromptFormat(tiny.tokenizer)
    reqs = [request(store, fmt, "nile", ["nile", "iron"], "How long?", 3),
            request(store, fmt, "iron", ["iron", "nile"], "Which symbol?", 3),
            request(store, fmt, "tokyo", ["tokyo", "bach"], "When?", 3)]
    reqs[1].question_ids = reqs[1].question_ids + [len(tiny.tokenizer) + 5]  # no such token
    return reqs


@pytest.mark.parametrize("mode", ["lazy", "block", "full"])
def test_a_request_with_a_token_outside_the_vocabulary_fails_alone(store, tiny, mode):
    engine = Engine(tiny, store, mode, cache_bytes=8 << 20, batch_size=3, recompute=Recompute(0.5))
    free_before = engine.cache.available_pages()
    done, failed = {}, []
    engine.run(requests(store, tiny), lambda s: done.__setitem__(s.id, s.generated),
               on_error=lambda s, e: failed.append((s.id, e)))
    assert sorted(done) == ["nile", "tokyo"]
    assert [sid for sid, _ in failed] == ["iron"] and isinstance(failed[0][1], BadTokens)
    assert engine.cache.available_pages() == free_before  # nothing it held is left held
    alone = {}
    engine.run([r for r in requests(store, tiny) if r.id != "iron"], lambda s: alone.__setitem__(s.id, s.generated))
    assert alone == done  # the others answer as they do without it
    with pytest.raises(BadTokens):  # without on_error the error ends the run
        engine.run(requests(store, tiny), lambda s: None)
    engine.close()


def test_out_of_memory_in_decode_fails_that_sequence_and_the_batch_decodes_on(store, tiny, monkeypatch):
    reqs = [r for r in requests(store, tiny) if r.id != "iron"]
    engine = Engine(tiny, store, "lazy", cache_bytes=8 << 20, batch_size=3)
    clean = {}
    engine.run(reqs, lambda s: clean.__setitem__(s.id, s.generated))
    monkeypatch.setenv(faults.INJECT_OOM_VAR, "tokyo:decode")
    done, failed = {}, []
    engine.run([r for r in requests(store, tiny) if r.id != "iron"], lambda s: done.__setitem__(s.id, s.generated),
               on_error=lambda s, e: failed.append(s.id))
    assert failed == ["tokyo"] and done == {"nile": clean["nile"]}
    monkeypatch.setenv(faults.INJECT_OOM_VAR, "tokyo")
    with pytest.raises(torch.OutOfMemoryError):  # alone and without on_error: the run ends
        engine.run(reqs[1:], lambda s: None)
    engine.close()
