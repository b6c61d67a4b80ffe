"""Staging buffers pinned ahead: `answer` has a loader's first buffers made on a thread of their
own while its model loads, kept for the process, and a reader that finds none ready waits for
that thread instead of pinning beside it. The buffers here are fakes that record who made them;
the GPU tests pin real ones."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from serve_stores import make_store

from lazyrag.serve import loader
from lazyrag.serve import staging as staging_module
from lazyrag.serve.loader import pin_staging_ahead
from lazyrag.serve.staging import Staging, staging_shape, wait_staging_pinned


class FakeBuffer:
    made: list = []
    delay = 0.0
    fail_on: set = set()  # thread names whose makes fail

    def __init__(self, nbytes, pin=False):
        time.sleep(self.delay)
        name = threading.current_thread().name
        if name in self.fail_on:
            raise RuntimeError("cannot pin")
        self.nbytes, self.pin, self.thread = nbytes, pin, name
        FakeBuffer.made.append(self)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a new process does: nothing pinned, nothing owed."""
    monkeypatch.setattr(staging_module, "SharedBuffer", FakeBuffer)
    monkeypatch.setattr(Staging, "_spare", {})
    monkeypatch.setattr(Staging, "_owed", {})
    monkeypatch.setattr(FakeBuffer, "made", [])
    monkeypatch.setattr(FakeBuffer, "delay", 0.0)
    monkeypatch.setattr(FakeBuffer, "fail_on", set())


def wait_until(done, timeout=5.0):
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "the pinning thread did not finish"
        time.sleep(0.001)


def ready(nbytes):
    return len(Staging._spare.get((nbytes, True), []))


def test_buffers_pinned_ahead_are_made_on_their_own_thread_and_used_by_readers():
    Staging.pin_ahead(1024, 3)
    wait_until(lambda: ready(1024) == 3)
    assert {b.thread for b in FakeBuffer.made} == {"lazyrag-pin"} and all(b.pin for b in FakeBuffer.made)
    staging = Staging(1024, 3, pin=True)
    got = [staging.writable(staging.take()) for _ in range(3)]
    assert sorted(map(id, got)) == sorted(map(id, FakeBuffer.made))  # the pinned ones, none made anew
    assert len(FakeBuffer.made) == 3


def test_without_pinning_ahead_a_reader_makes_its_buffer():
    staging = Staging(1024, 3, pin=True)
    buf = staging.writable(staging.take())
    assert buf.thread == threading.current_thread().name and len(FakeBuffer.made) == 1


def test_buffers_the_process_holds_are_not_pinned_again():
    Staging.pin_ahead(1024, 2)
    wait_until(lambda: ready(1024) == 2)
    first = Staging(1024, 2, pin=True)
    for b in [first.writable(first.take()) for _ in range(2)]:
        first.give(b)
    first.close()
    Staging.pin_ahead(1024, 3)  # one more than the process holds
    wait_until(lambda: ready(1024) == 3)
    assert len(FakeBuffer.made) == 3
    Staging.pin_ahead(2048, 1)  # another size is another pool
    wait_until(lambda: ready(2048) == 1)
    assert len(FakeBuffer.made) == 4 and FakeBuffer.made[-1].nbytes == 2048


def test_a_reader_waits_for_the_buffer_being_pinned_rather_than_pinning_its_own():
    FakeBuffer.delay = 0.05
    Staging.pin_ahead(1024, 2)
    staging = Staging(1024, 4, pin=True)
    got = staging.writable(staging.take())  # asked before the pinning thread is done
    assert got.thread == "lazyrag-pin"
    staging.writable(staging.take())
    assert {b.thread for b in FakeBuffer.made} == {"lazyrag-pin"}
    third = staging.writable(staging.take())  # none owed any more: made here
    assert third.thread == threading.current_thread().name


def test_when_pinning_ahead_fails_readers_make_their_own_and_see_the_error():
    FakeBuffer.fail_on = {"lazyrag-pin"}
    Staging.pin_ahead(1024, 3)
    wait_until(lambda: not Staging._owed.get((1024, True)))
    staging = Staging(1024, 3, pin=True)
    buf = staging.writable(staging.take())  # no wait for buffers nobody will make
    assert buf.thread == threading.current_thread().name
    FakeBuffer.fail_on = {threading.current_thread().name}
    with pytest.raises(RuntimeError, match="cannot pin"):
        staging.writable(staging.take())


def test_pin_staging_ahead_pins_the_loaders_first_buffers_on_a_gpu_only(tmp_path, tiny, monkeypatch):
    shared = []  # handed to the reader process as they are made, so that it maps them before any read
    monkeypatch.setattr(loader, "shared_read_process", lambda threads: SimpleNamespace(share=shared.append))
    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    nbytes, count = staging_shape(store)
    assert nbytes == store.max_padded_length() * store.settings.row_bytes and count >= 2
    pin_staging_ahead(store, torch.device("cpu"))
    assert FakeBuffer.made == []  # nothing to pin without a GPU
    monkeypatch.setattr(loader, "chunk_read_threads", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # no GPU here
    FakeBuffer.delay = 0.02
    pin_staging_ahead(store, torch.device("cuda"))
    wait_staging_pinned()
    assert 2 < store.num_chunks < count and ready(nbytes) == 2  # two per chunk read at once
    monkeypatch.setattr(loader, "chunk_read_threads", lambda: 100)
    pin_staging_ahead(store, torch.device("cuda", 0))
    wait_staging_pinned()
    assert ready(nbytes) == store.num_chunks  # one per stored chunk at most
    pin_staging_ahead(store, torch.device("cuda", 0), staging_bytes=nbytes * 2)  # the budget: held already
    wait_staging_pinned()
    assert len(FakeBuffer.made) == store.num_chunks and {b.nbytes for b in FakeBuffer.made} == {nbytes}
    assert shared == FakeBuffer.made


def test_answer_starts_pinning_before_its_model_loads(tmp_path, tiny, monkeypatch):
    from lazyrag.commands import answer_engine
    from lazyrag.config import AnswerConfig

    store = make_store(tmp_path, "random:tiny", chunk_tokens=48, dtype="bf16")
    calls = []
    load = answer_engine.load_model_for
    monkeypatch.setattr(answer_engine, "pin_staging_ahead", lambda s, device: calls.append(("pin", device.type)))
    monkeypatch.setattr(answer_engine, "load_model_for", lambda s, cfg: calls.append("load") or load(s, cfg))
    answer_engine.QueryEngine(store, AnswerConfig(queries=tmp_path / "q.jsonl", store=store.path, device="cpu"))
    assert calls == [("pin", "cpu"), "load"]


def test_readers_do_not_wait_for_a_pinning_thread_that_failed_to_start(monkeypatch):
    def no_device(device):
        raise ValueError("no such device")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    Staging.pin_ahead(1024, 3, torch.device("cuda", 5))
    wait_until(lambda: not Staging._owed.get((1024, True)))
    staging = Staging(1024, 3, pin=True)
    assert staging.writable(staging.take()).thread == threading.current_thread().name


def test_an_unindexed_cuda_device_pins_on_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device needs an index"))
    Staging.pin_ahead(1024, 2, torch.device("cuda"))  # what `--device auto` resolves to
    wait_until(lambda: ready(1024) == 2)
