"""The driver of `answer --data-parallel N` and `answer --ray-address ADDR`: engine actors on
Ray, fed by the router, with this process the one writer of the answers file.

The driver resolves every query's chunks (docs to chunk ids, or BM25) as one engine would,
plans the queries over the engines (lazyrag/parallel/router.py) and keeps IN_FLIGHT batches
submitted to each engine, which answers them as one open stream (lazyrag/parallel/engines.py).
Each engine has one `collect` call pending at a time, which returns the rows finished since the
last; each row is appended to --out as it comes back (in finishing order), and the run's record
is saved as in the one-engine path, so a re-run resumes the same way. An engine that dies is
started again and its queries not yet back are sent again; what it finished but the driver
never collected is answered again, and nothing is written twice.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from lazyrag.commands.answer_run import AnswerRun
from lazyrag.commands.queries import ChunkResolver, Query, in_prompt_order
from lazyrag.config import AnswerConfig
from lazyrag.failures import one_line
from lazyrag.parallel.cluster import Placement, connect, place
from lazyrag.parallel.engines import EngineActor
from lazyrag.parallel.router import Router
from lazyrag.parallel.stats import EngineStats, sum_counters
from lazyrag.store import Store, StoreError, StoreMismatch

# Batches of --batch-size queries submitted to an engine and not yet back: more than a batch
# waits in its inbox, so a finished request's place is taken at the next step and the engine's
# batch drains only at the end of the work.
IN_FLIGHT = 3
# Calls an engine actor serves at once: a collect waiting for rows, a submit, and start or close.
ACTOR_CALLS = 3
MAX_RESTARTS = 3  # per engine; one more death ends the run
WAIT_S = 0.5      # the longest a collect waits for rows, and the driver before looking for a signal to stop
CLOSE_WAIT_S = 10  # for the engines to end their streams and give back their GPU and store at the end


class EngineFailed(RuntimeError):
    """An engine died more than MAX_RESTARTS times."""


def answer_parallel(run: AnswerRun, todo: list[Query]) -> None:
    """Answer `todo` with cfg.data_parallel engine actors, writing through `run`."""
    cfg = run.cfg
    owns_ray = connect(cfg.ray_address)
    engines = None
    try:
        placement = place(cfg, ray.cluster_resources())
        work = _resolve(run, todo)
        engines = Engines(placement, _engine_config(cfg, placement), run.store, run.run_id)
        if work:
            engines.start()
        run.engine_stats = engines.record
        router = Router([(qid, chunk_ids) for qid, (_, chunk_ids) in work.items()], placement.engines, cfg.routing,
                        batch=cfg.batch_size, in_flight=IN_FLIGHT)
        run.start()
        completed = False
        try:
            with run.stop:
                _dispatch(run, engines, router, work)
            completed = True
        finally:
            run.end(completed)
        engines.close()
    finally:
        if engines is not None:
            engines.stop()
        if owns_ray:
            ray.shutdown()


def _resolve(run: AnswerRun, todo: list[Query]) -> dict[str, tuple[Query, list[str]]]:
    """Each query with its chunk ids, in file order; one that cannot be resolved goes to the errors file."""
    resolver = ChunkResolver(run.store, run.cfg.top_k)
    resolved = []
    for q in todo:
        try:
            resolved.append((q, resolver.chunks(q)))
        except StoreError as exc:
            run.fail(q, str(exc))
    return {q.id: (q, [c.chunk_id for c in chunks]) for q, chunks, _, _ in in_prompt_order(resolved, run.cfg.prompt_order)}


def _engine_config(cfg: AnswerConfig, placement: Placement) -> AnswerConfig:
    """The run's settings as an engine takes them: its device, and a local store path made
    absolute (every node must see the store at that path)."""
    store = cfg.store.absolute() if isinstance(cfg.store, Path) else cfg.store
    return replace(cfg, device=placement.device, store=store)


def _dispatch(run: AnswerRun, engines: Engines, router: Router, work: dict[str, tuple[Query, list[str]]]) -> None:
    sent: dict[str, tuple[int, list[str]]] = {}  # query id -> (engine, its batch), until it comes back
    back: set[str] = set()                       # query ids answered or failed
    collects: dict[ray.ObjectRef, int] = {}      # each ready engine's pending collect -> engine

    def came_back(qid: str) -> None:
        back.add(qid)
        slot, batch = sent.pop(qid)
        if not any(other in sent for other in batch):
            router.done(slot, batch)

    while not router.finished:
        collecting = set(collects.values())
        for slot in engines.ready():
            actor = engines.actors[slot]
            while batch := router.take(slot):
                # no return value: a submit lost with its engine shows as that engine's failed collect
                actor.submit.options(num_returns=0).remote([work[qid] for qid in batch])
                sent.update((qid, (slot, batch)) for qid in batch)
            if slot not in collecting:
                collects[actor.collect.remote(WAIT_S)] = slot
        done, _ = ray.wait([*collects, *engines.starting], num_returns=1, timeout=WAIT_S)
        run.stop.check()
        for ref in done:
            if ref in engines.starting:
                engines.settle(ref)
                continue
            slot = collects.pop(ref)
            try:
                result = _get(ref)
            except RayActorError as exc:
                for qid in router.requeue(slot, answered=back):
                    del sent[qid]
                engines.restart(slot, exc)
                continue
            stats = engines.stats[slot]
            if result["cache"] is not None:
                stats.counters = result["cache"]
            for qid, reason in result["errors"]:
                came_back(qid)
                run.fail(work[qid][0], reason)
            for row in result["rows"]:
                came_back(row["id"])
                stats.answered(row)
                run.write(row)


def _get(ref: ray.ObjectRef):
    """ray.get, an error raised inside an engine re-raised as itself, so that it ends the run
    with its own message and exit code (a ResourceError for a --cache-gb too small, ...)."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise


class Engines:
    """The run's engine actors, one per slot: started, checked against the driver's store,
    started again when one dies, and each one's stats."""

    def __init__(self, placement: Placement, cfg: AnswerConfig, store: Store, run_id: str):
        self.placement, self.cfg = placement, cfg
        self.expect = (store.store_id, store.settings.fingerprint)
        self.model = store.settings.model
        self.actors: list = [None] * placement.engines
        self.starting: dict[ray.ObjectRef, int] = {}  # start call -> slot
        self.stats = [EngineStats() for _ in range(placement.engines)]
        self._remote = ray.remote(EngineActor)
        self._run = run_id[:8]

    def start(self) -> None:
        """Start every engine and wait until all are ready."""
        for slot in range(self.placement.engines):
            self._spawn(slot)
        while self.starting:
            done, _ = ray.wait(list(self.starting), num_returns=1)
            self.settle(done[0])

    def ready(self) -> list[int]:
        starting = set(self.starting.values())
        return [slot for slot in range(len(self.actors)) if slot not in starting]

    def settle(self, ref: ray.ObjectRef) -> None:
        """A start call came back: the engine is ready, or it died and starts again.
        StoreMismatch when it reads another store than the driver."""
        slot = self.starting.pop(ref)
        try:
            info = _get(ref)
        except RayActorError as exc:
            self.restart(slot, exc)
            return
        if (info["store_id"], info["fingerprint"]) != self.expect:
            raise StoreMismatch(
                f"engine {slot} on {info['node']} opened a store with id {info['store_id']} and model fingerprint "
                f"{info['fingerprint'][:16]} at {self.cfg.store}, not the driver's ({self.expect[0]}, "
                f"{self.expect[1][:16]}); every engine must read the same store: use a shared file system or "
                "object storage")
        stats = self.stats[slot]
        stats.device, stats.node, self.model = info["device"], info["node"], info["model"]

    def restart(self, slot: int, exc: RayActorError) -> None:
        """The engine in `slot` died: start a new one (EngineFailed past MAX_RESTARTS)."""
        stats = self.stats[slot]
        if stats.restarts >= MAX_RESTARTS:
            raise EngineFailed(f"engine {slot} died {stats.restarts + 1} times; the last time: "
                               f"{one_line(str(exc))[:300]}")
        ray.kill(self.actors[slot], no_restart=True)
        stats.restarted()
        self._spawn(slot)

    def close(self) -> None:
        """Every query is back: each engine ends its stream and gives back its GPU and store
        (CLOSE_WAIT_S at most; `stop` kills them after)."""
        closing = [actor.close.remote() for actor in self.actors if actor is not None]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S)

    def stop(self) -> None:
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def record(self) -> dict:
        """The run record's model, device, summed cache counters and `engines`."""
        return {"model": self.model, "device": f"{self.placement.engines} x {self.placement.device}",
                "cache": sum_counters([s.cache().to_json() for s in self.stats]).to_json(),
                "engines": [s.to_json(slot) for slot, s in enumerate(self.stats)]}

    def _spawn(self, slot: int) -> None:
        # named, so that `ray list actors` shows which run and engine each actor is
        name = f"lazyrag-engine-{self._run}-{slot}-{self.stats[slot].restarts}"
        actor = self._remote.options(name=name, num_gpus=self.placement.num_gpus, num_cpus=self.placement.num_cpus,
                                     max_concurrency=ACTOR_CALLS).remote(self.cfg)
        self.actors[slot] = actor
        self.starting[actor.start.remote()] = slot
