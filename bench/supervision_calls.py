"""The call-overhead part of ``bench/supervision.py``: a call through erlay's supervised
handle against the same call on a plain Ray actor (see that module's docstring, "Call
overhead", for what the figures measure).  Its own module to keep each under ~600 lines;
``bench/supervision.py --only calls`` runs it alone, and so does this script, which passes
its arguments on (``--smoke``, CI's smoke size: 1 pair of 2 blocks of 10 calls per shape).

    python bench/supervision_calls.py [--smoke] [--pairs 7]   # = supervision.py --only calls
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runstats import spread  # bench/ (a script's own folder is on sys.path)

from erlay.supervisor.events import MemorySink
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import SupervisionTree

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "configs" / "cpu.yaml"
LOOSE = SupervisorFlags("one_for_one", intensity=1000, period=1)


def fmt(s: dict[str, Any]) -> str:
    return f"{s['median']} ({s['min']}-{s['max']}, n={s['runs']})"


def _by_value() -> None:
    """Ray's workers cannot import this module from bench/: ship its classes by value."""
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SyncTarget:
    """The learner's shape: a threaded actor, with a Progress as erlay's children have."""

    def __init__(self) -> None:
        from erlay.supervisor.progress import Progress
        self.progress = Progress()

    def stamp(self) -> float:
        return time.perf_counter()


class AsyncTarget(SyncTarget):
    """The engine's shape: an asyncio actor (its methods are coroutines)."""

    async def stamp(self) -> float:  # type: ignore[override]
        return time.perf_counter()


CALL_STAGES = ("lookup_us", "submit_us", "to_actor_us", "back_us")
CALL_SHAPES = {"sync": (SyncTarget, {"train_step": 600.0}),        # the learner's shape
               "async": (AsyncTarget, {"decode_step": 30.0})}   # the engine's shape


def timed_calls(target: Any, n: int) -> list[tuple[float, float, float, float]]:
    """``n`` calls of ``target.stamp``, each split in four stages (seconds): ``lookup``
    (the attribute read that yields the bound method: the supervised handle's whole
    per-call code), ``submit`` (``.remote()`` returns), ``to_actor`` (until the method
    starts in the actor, read from its own ``perf_counter``, the same clock on one
    machine), ``back`` (until ``ray.get`` returns the result)."""
    import ray
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        method = target.stamp
        t1 = time.perf_counter()
        ref = method.remote()
        t2 = time.perf_counter()
        entered = ray.get(ref)
        t3 = time.perf_counter()
        out.append((t1 - t0, t2 - t1, entered - t2, t3 - entered))
    return out


def interleaved_pairs(supervised: Any, plain: Any, pairs: int, blocks: int,
                      block: int) -> dict[str, Any]:
    """``pairs`` pairs; each pair runs ``blocks`` blocks of ``block`` calls on each side,
    the side going first alternating from block to block (and pair to pair), so drift and
    a first-mover cost hit both sides alike.  A pair's ratio is the median supervised block
    over the median plain block (a block's figure: its mean call, all four stages)."""
    ratios: list[float] = []
    rows: dict[str, list[tuple[float, ...]]] = {"supervised": [], "plain": []}
    block_us: dict[str, list[float]] = {"supervised": [], "plain": []}
    for p in range(pairs):
        sides: dict[str, list[float]] = {"supervised": [], "plain": []}
        for b in range(blocks):
            order = [("supervised", supervised), ("plain", plain)]
            for side, target in order if (p + b) % 2 == 0 else order[::-1]:
                got = timed_calls(target, block)
                sides[side].append(sum(map(sum, got)) / block)
                rows[side] += got
        ratios.append(statistics.median(sides["supervised"]) / statistics.median(sides["plain"]))
        for side, values in sides.items():
            block_us[side] += [v * 1e6 for v in values]
    stages = {side: {name: round(statistics.median(col) * 1e6, 1)
                     for name, col in zip(CALL_STAGES, zip(*got, strict=True), strict=True)}
              for side, got in rows.items()}
    return {"ratios": ratios, "stages": stages,
            "call_us": {side: round(statistics.median(v), 1) for side, v in block_us.items()}}


def shipped_call_setup(workdir: str) -> tuple[dict[str, Any], Any, Callable[[], None]]:
    """The job's call-path settings, from the default config: every actor's environment
    (the node section's and ``ERLAY_TELEMETRY``, telemetry on with the file exporter), the
    driver's telemetry started and the tree's event sink with the tracing sink in it, as
    ``actors/job/driver.py`` builds them.  Failpoints stay as shipped: disarmed.  Returns
    the actor options (both sides get them), the sink, and a closer."""
    from erlay.actors.config import load_config
    from erlay.actors.job.node_runtime import actor_env
    from erlay.actors.observe.telemetry import JobTelemetry
    from erlay.supervisor.events import FanoutSink
    cfg = load_config(str(SHIPPED_CONFIG), [])
    job_telemetry = JobTelemetry(cfg.telemetry, Path(workdir), "bench-calls")
    job_telemetry.start()
    env = {**actor_env(cfg.node), **job_telemetry.actor_env()}
    options = {"runtime_env": {"env_vars": env}} if env else {}
    sink = FanoutSink([MemorySink(), job_telemetry.event_sink()])
    return options, sink, job_telemetry.close


def bench_call_overhead(pairs: int, blocks: int, block: int) -> dict[str, dict[str, Any]]:
    """Per shape (sync: the learner's; async: the engine's), a supervised actor child
    called through its tree's handle (``tree.ref(path).stamp.remote()``) against a plain
    Ray actor of the same class and options, in :func:`interleaved_pairs`."""
    import ray
    _by_value()
    workdir = tempfile.TemporaryDirectory(prefix="erlay-bench-calls-")
    options, sink, close = shipped_call_setup(workdir.name)
    children = [ChildSpec(shape, ActorStart(cls, options=options), deadlines=deadlines)
                for shape, (cls, deadlines) in CALL_SHAPES.items()]
    tree = SupervisionTree("bco", LOOSE, children, sink=sink).start()
    out = {}
    try:
        for shape, (cls, _) in CALL_SHAPES.items():
            ref = tree.ref(f"bco/{shape}")
            raw = ray.remote(num_cpus=0)(cls).options(**options).remote()
            for _ in range(2):  # warm both: first calls pay one-time costs
                timed_calls(ref, 50)
                timed_calls(raw, 50)
            out[shape] = interleaved_pairs(ref, raw, pairs, blocks, block)
            ray.kill(raw)
    finally:
        tree.stop()
        close()
        workdir.cleanup()
    return out


def call_figures(calls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The call figures: the sync (learner-shaped) ratio keeps the figure's old name."""
    return {"call_overhead_ratio": spread(calls["sync"]["ratios"], digits=3),
            "call_overhead_ratio_async": spread(calls["async"]["ratios"], digits=3),
            "call_us": {shape: c["call_us"] for shape, c in calls.items()},
            "call_stages_us": {shape: c["stages"] for shape, c in calls.items()}}


def print_call_table(r: dict[str, Any]) -> None:
    print("call overhead: a no-op call (returns the actor's perf_counter) through the "
          "supervised handle vs a plain actor of the same class and options; one ratio per "
          "interleaved pair")
    for shape, key in (("sync", "call_overhead_ratio"), ("async", "call_overhead_ratio_async")):
        us = r["call_us"][shape]
        print(f"  {key:28s} {fmt(r[key]):>28s}  {shape} actor: {us['supervised']} vs "
              f"{us['plain']} us per call (median block)")
        for side, stages in r["call_stages_us"][shape].items():
            print(f"    {side:10s} " + "  ".join(f"{k} {v}" for k, v in stages.items()))
    print(f"  load_avg_1m {r['load_avg_1m']} (start, end)")


def main(argv: list[str] | None = None) -> None:
    """This part alone: ``bench/supervision.py --only calls`` with these arguments."""
    import supervision  # bench/ (a script's own folder is on sys.path)
    supervision.main(["--only", "calls", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
