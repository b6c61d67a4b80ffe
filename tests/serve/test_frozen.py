"""objects_frozen: the objects alive when the first engine starts stay frozen until the last ends."""

import gc
import threading

from lazyrag.serve.frozen import objects_frozen


def test_objects_stay_frozen_until_the_last_running_engine_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second():
        first_in.wait()
        with objects_frozen():
            second_in.set()
            first_out.wait()
            seen["after the first left"] = gc.get_freeze_count()

    assert gc.get_freeze_count() == 0
    thread = threading.Thread(target=second)
    thread.start()
    with objects_frozen():
        frozen = gc.get_freeze_count()
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert frozen > 1000 and seen["after the first left"] > frozen // 2  # some frozen objects die meanwhile
    assert gc.get_freeze_count() == 0
