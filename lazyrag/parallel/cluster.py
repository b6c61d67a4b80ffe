"""Ray for `answer --data-parallel N` and `--ray-address ADDR`: the options checked before the
store opens, Ray started or joined, and where the engines go.

Placement: each engine is one Ray actor. Under `--device auto` on a cluster with GPUs, and
under `--device cuda`, each asks Ray for one GPU, so the N engines sit one per GPU across the
cluster's nodes; Ray makes that GPU the actor's only visible device, which the engine loads the
model onto as `cuda`. Under `--device cpu`, or `auto` on a cluster without GPUs, engines ask
Ray for CPUs only and run on the CPU, whatever GPUs the cluster declares: GPUs Ray merely
counts (a test cluster's logical ones) are never taken by a CPU engine.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import click

from lazyrag.config import AnswerConfig
from lazyrag.errors import ResourceError

RAY_MISSING = "--data-parallel and --ray-address need Ray: pip install 'lazyrag[ray]'"
# Ray counts CPUs for placement only; a fraction lets engines share a small machine with Ray's
# own workers. (Ray then sets OMP_NUM_THREADS=1: a CPU engine runs torch on one thread.)
CPUS_PER_ENGINE = 0.5


def check_options(cfg: AnswerConfig) -> None:
    """Usage errors (exit 2) found before the store opens: Ray not installed, options that do not
    go with engine actors."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise click.UsageError(RAY_MISSING) from None
    if cfg.audit:
        raise click.UsageError("--audit needs the run's requests in one process: audit a run without "
                               "--data-parallel or --ray-address")
    if re.fullmatch(r"cuda:\d+", cfg.device):
        raise click.BadParameter(f"{cfg.device} names one GPU, but each engine gets a GPU of its own; "
                                 "use auto or cuda", param_hint="'--device'")


@dataclass(frozen=True)
class Placement:
    engines: int
    device: str      # what each engine loads the model onto: "cuda" (the one GPU Ray gave it) or "cpu"
    num_gpus: int    # Ray resources each engine asks for
    num_cpus: float


def place(cfg: AnswerConfig, resources: dict[str, float]) -> Placement:
    """Where cfg.data_parallel engines go on a cluster with these total resources
    (ray.cluster_resources()); ResourceError when it cannot hold them."""
    n = cfg.data_parallel
    gpus, cpus = int(resources.get("GPU", 0)), resources.get("CPU", 0)
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0):
        if gpus < n:
            raise ResourceError(f"{n} engines need {n} GPUs, one each, but the Ray cluster has {gpus}; "
                                f"lower --data-parallel{' or use --device cpu' if not gpus else ''}")
        return Placement(n, "cuda", num_gpus=1, num_cpus=CPUS_PER_ENGINE)
    if cpus < n * CPUS_PER_ENGINE:
        raise ResourceError(f"{n} CPU engines need {n * CPUS_PER_ENGINE:g} CPUs of the Ray cluster, "
                            f"which has {cpus:g}; lower --data-parallel")
    return Placement(n, "cpu", num_gpus=0, num_cpus=CPUS_PER_ENGINE)


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` ("auto": the one this machine belongs to), or start a
    local instance of its own when it is None (even where a cluster runs on this machine), unless
    this process already uses Ray, which it then keeps. True when this call connected, so the
    caller disconnects at the end."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    return True
