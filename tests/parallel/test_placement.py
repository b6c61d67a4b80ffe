"""Where engines go, from the cluster's resources (no Ray): a GPU each, or CPU engines that never
ask for the GPUs a cluster declares."""

from pathlib import Path

import pytest

from lazyrag.config import AnswerConfig
from lazyrag.errors import ResourceError
from lazyrag.parallel.cluster import place


def cfg(device: str, n: int = 2) -> AnswerConfig:
    return AnswerConfig(queries=Path("q.jsonl"), device=device, data_parallel=n)


def test_auto_on_a_cluster_with_gpus_gives_each_engine_one_gpu():
    p = place(cfg("auto"), {"GPU": 8.0, "CPU": 64.0})
    assert (p.engines, p.device, p.num_gpus) == (2, "cuda", 1)


def test_cpu_engines_ask_for_no_gpu_even_where_the_cluster_declares_some():
    p = place(cfg("cpu"), {"GPU": 2.0, "CPU": 2.0})
    assert (p.device, p.num_gpus) == ("cpu", 0)
    assert place(cfg("auto"), {"CPU": 2.0}).device == "cpu"


def test_more_gpu_engines_than_gpus_is_refused_with_what_there_is():
    with pytest.raises(ResourceError, match="3 engines need 3 GPUs, one each, but the Ray cluster has 2"):
        place(cfg("auto", 3), {"GPU": 2.0, "CPU": 64.0})
    with pytest.raises(ResourceError, match="has 0; lower --data-parallel or use --device cpu"):
        place(cfg("cuda"), {"CPU": 64.0})
