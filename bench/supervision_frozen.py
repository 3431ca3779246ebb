"""The frozen-child part of ``bench/supervision.py``: from a SIGSTOP of a child's process
until its supervisor acts on it (the ``hang`` event), against the range the docs state:
more than ``heartbeat_s x (misses - 1)`` and at most ``heartbeat_s x (misses + 1)``
(docs/supervision.md, "Failure detection").  Its own module to keep each under ~600 lines;
``bench/supervision.py --only frozen`` runs it alone.

Each figure is one kind of child (``host``: a NodeHost actor holding one in-process child,
under its domain supervisor; ``actor``: an actor child with the engine's progress deadline)
at one heartbeat setting (the shipped one, read from ``configs/cpu.yaml``, and 1 s x 3).
The stop lands at a chosen phase of the heartbeat: run ``i`` of ``n`` stops the child
``i/n`` of a period after the supervisor recorded a heartbeat answer, so run 0 has the
worst phase (the child freezes just after answering) and the runs spread over the period;
``phase`` fixes it instead (a fraction of the period, for every run).
The stopwatch starts at ``os.kill`` and ends at the ``time`` of the supervisor's ``hang``
event as its sink recorded it, not when a poll of the sink saw it.  ``since_answer_ms`` is
the same event's time from that last answer: the silence the supervisor judged, and
``missed_heartbeats`` counts the runs by how many heartbeats had gone unanswered then
(``misses - 1`` or ``misses``: docs/supervision.md says which and why).

A stop that no ``hang`` event follows within twice the bound voids the figure
(:class:`FrozenNotFound`); ``--plant-no-liveness`` switches the heartbeat off to show that
this happens.

This script runs the part alone, as ``bench/supervision.py --only frozen`` with its
arguments (``--smoke``, CI's smoke size: one SIGSTOP per kind at 1 s x 3, half a period
after a heartbeat answer).

    python bench/supervision_frozen.py [--smoke] [--frozen-runs 3,5] [--frozen-kinds host]
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from runstats import spread  # bench/ (a script's own folder is on sys.path)

from erlay.supervisor.events import EventKind, MemorySink, SupervisorEvent
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import local_node_id
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    Liveness,
    SupervisorFlags,
    SupervisorStart,
)
from erlay.supervisor.tree import SupervisionTree

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "configs" / "cpu.yaml"
LOOSE = SupervisorFlags("one_for_one", intensity=1000, period=1)
FROZEN_KINDS = ("host", "actor")
FAST = Liveness(period_s=1.0, misses=3)


class FrozenNotFound(RuntimeError):
    """A SIGSTOP that no ``hang`` event followed within twice its bound: the figure is void."""


class Frozen:
    """The child under test: says its pid; holds a Progress as erlay's children do."""

    def __init__(self) -> None:
        from erlay.supervisor.progress import Progress
        self.progress = Progress()

    def pid(self) -> int:
        return os.getpid()


def _by_value() -> None:
    """Ray's workers cannot import this module from bench/: ship its classes by value."""
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def shipped_liveness() -> dict[str, Liveness]:
    """The shipped heartbeat per kind, from the default config as ``actors/job/driver.py``
    applies it (``_live``): hosts take the sandbox domain's, actor children the generation
    domain's."""
    from erlay.actors.config import load_config
    flags = load_config(str(SHIPPED_CONFIG), []).supervision
    return {kind: Liveness(domain.heartbeat_s, domain.heartbeat_misses)
            for kind, domain in (("host", flags.sandbox), ("actor", flags.generation))}


def bound_s(beat: Liveness) -> float:
    """The documented bound: ``period_s x (misses + 1)``."""
    return beat.period_s * (beat.misses + 1)


def floor_s(beat: Liveness) -> float:
    """The documented floor: no frozen child is declared hung sooner than
    ``period_s x (misses - 1)`` after it froze."""
    return beat.period_s * (beat.misses - 1)


def figure_key(kind: str, beat: Liveness, shipped: Liveness) -> str:
    return f"{kind}_shipped" if beat == shipped else f"{kind}_{beat.period_s:g}sx{beat.misses}"


def _spec(kind: str, beat: Liveness, plant: bool) -> ChildSpec:
    """The child under test with heartbeat ``beat``; ``plant``: with nothing that polls it
    (no heartbeat, and no progress deadline, whose silence rule would find it too)."""
    if kind == "host":
        spec = host_spec("n0", LOOSE, (ChildSpec("obj", InProcessStart(Frozen)),),
                         node_id=local_node_id())
    else:
        spec = ChildSpec("engine", ActorStart(Frozen), deadlines={"decode_step": 30.0})
    if plant:
        return dataclasses.replace(spec, liveness=None, deadlines={})
    return dataclasses.replace(spec, liveness=beat)


def _pid_of(kind: str, ref: Any) -> int:
    import ray
    return int(ray.get((ref.ping if kind == "host" else ref.pid).remote(), timeout=10))


def _fresh_pid(kind: str, ref: Any, incarnation: int, old: int | None, timeout: float) -> int:
    """The pid of incarnation ``incarnation`` once it answers (a restart may be under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ref.incarnation >= incarnation:
                pid = _pid_of(kind, ref)
                if pid != old:
                    return pid
        except Exception:  # restarting: not answering yet is what we wait through
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{ref.path}: incarnation {incarnation} did not answer within "
                       f"{timeout:g} s")


def _heartbeat_age(tree: SupervisionTree, parent: str, cid: str) -> float:
    (row,) = [r for r in tree.which_children(parent) if r["id"] == cid]
    return float(row["heartbeat_age_s"])


def _after_answer(tree: SupervisionTree, parent: str, cid: str, phase_s: float,
                  timeout: float) -> float:
    """Return ``phase_s`` after the supervisor recorded a heartbeat answer from ``cid``:
    the age of its last answer is watched until it drops (a new answer), then slept off.
    Returns when (wall clock) that answer was recorded."""
    deadline = time.monotonic() + timeout
    last = _heartbeat_age(tree, parent, cid)
    while time.monotonic() < deadline:
        time.sleep(0.002)
        age = _heartbeat_age(tree, parent, cid)
        if age < last:
            answered = time.time() - age
            time.sleep(max(0.0, answered + phase_s - time.time()))
            return answered
        last = age
    raise RuntimeError(f"{parent}/{cid}: no heartbeat answer within {timeout:g} s")


def _hang_after(sink: MemorySink, cid: str, seen: int, timeout: float
                ) -> SupervisorEvent | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hangs = [e for e in sink.of(EventKind.HANG) if e.child == cid]
        if len(hangs) > seen:
            return hangs[seen]
        time.sleep(0.02)
    return None


@dataclasses.dataclass(frozen=True)
class FrozenRun:
    """One SIGSTOP: from the stop, and from the child's last heartbeat answer before it,
    to the supervisor's ``hang`` event (ms)."""

    detect_ms: float
    since_answer_ms: float


def bench_frozen(kind: str, beat: Liveness, runs: int, figure: str, *,
                 plant: bool = False, phase: float | None = None) -> list[FrozenRun]:
    """``runs`` SIGSTOPs of one child of ``kind`` with heartbeat ``beat`` (``plant``: with
    nothing polling it), each until its supervisor's ``hang`` event, run ``i`` stopping
    ``phase`` (default ``i / runs``) of a period after a heartbeat answer.  Raises
    FrozenNotFound, naming ``figure``, when no event comes within twice the bound."""
    _by_value()
    sink = MemorySink()
    spec = _spec(kind, beat, plant)
    name = f"bfz{kind[0]}{int(beat.period_s * 1000)}"
    tree = SupervisionTree(name, LOOSE, [ChildSpec("dom", SupervisorStart(LOOSE, (spec,)),
                                                   type="supervisor")], sink=sink).start()
    parent = f"{name}/dom"
    ref = tree.ref(f"{parent}/{spec.id}")
    wait_s = 2 * bound_s(beat)
    out: list[FrozenRun] = []
    pid: int | None = None
    stopped: int | None = None
    try:
        for i in range(runs):
            pid = _fresh_pid(kind, ref, i + 1, pid, 120)
            answered = math.nan  # planted: no heartbeat is sent, nothing to align on
            if not plant:
                at = i / runs if phase is None else phase
                answered = _after_answer(tree, parent, spec.id, beat.period_s * at,
                                         timeout=3 * beat.period_s)
            stopped_at = time.time()
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
            event = _hang_after(sink, spec.id, i, wait_s)
            if event is None:
                raise FrozenNotFound(
                    f"{figure}: no hang event within {wait_s:g} s of the SIGSTOP of "
                    f"{kind} pid {pid} (twice the bound {beat.period_s:g} s x "
                    f"({beat.misses} + 1)); heartbeat {'off (planted)' if plant else 'on'}")
            out.append(FrozenRun((event.time - stopped_at) * 1000,
                                 (event.time - answered) * 1000))
            stopped = None  # the supervisor kills it
    finally:
        if stopped is not None:  # let the tree stop it (an infinity shutdown waits on it)
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        tree.stop()
    return out


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile: the largest value below 100 runs."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def frozen_figure(runs: list[FrozenRun], beat: Liveness, phase: float | None = None
                  ) -> dict[str, Any]:
    """The runs' spread and p99, next to the documented range and the ratio p99 / bound;
    ``since_answer_ms`` is the silence the supervisor judged (from the last answer);
    ``phase`` where the runs stopped the child (``"i/n"``: spread over the period)."""
    ms = [r.detect_ms for r in runs]
    bound = bound_s(beat) * 1000
    top = p99(ms)
    return {**spread(ms, digits=1), "p99": round(top, 1), "heartbeat_s": beat.period_s,
            "misses": beat.misses, "floor_ms": round(floor_s(beat) * 1000, 1),
            "bound_ms": round(bound, 1), "p99_over_bound": round(top / bound, 4),
            "since_answer_ms": spread([r.since_answer_ms for r in runs], digits=1),
            "missed_heartbeats": missed_heartbeats(runs, beat),
            "phase": "i/n" if phase is None else phase}


def missed_heartbeats(runs: list[FrozenRun], beat: Liveness) -> dict[str, int]:
    """Runs by how many heartbeats had gone unanswered when the hang was judged: the
    silence since the last answer spans that many polls plus the answered one's period
    (``misses - 1`` when the judgement came ``misses`` periods after the last answer)."""
    counts: dict[str, int] = {}
    for run in runs:
        key = str(round(run.since_answer_ms / (beat.period_s * 1000)) - 1)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def frozen_figures(runs: tuple[int, int], kinds: tuple[str, ...], plant: bool,
                   phase: float | None = None) -> dict[str, Any]:
    """``frozen_detect_ms``: one figure per kind and setting (1 s x 3 first, then the
    shipped one), ``runs`` = (shipped runs, 1 s x 3 runs); 0 skips a setting.  ``phase``:
    see :func:`bench_frozen`."""
    if max(runs) < 1:
        return {}   # nothing to run: not even the config to read
    shipped = shipped_liveness()
    out: dict[str, Any] = {}
    for kind in kinds:
        for beat, n in ((FAST, runs[1]), (shipped[kind], runs[0])):
            key = figure_key(kind, beat, shipped[kind])
            if n < 1 or key in out:
                continue
            out[key] = frozen_figure(bench_frozen(kind, beat, n, f"frozen_detect_ms {key}",
                                                  plant=plant, phase=phase), beat, phase)
    return out


def outside_range(figures: dict[str, Any]) -> list[str]:
    """A line naming each figure whose p99 exceeds its bound or whose fastest run came in
    under its floor (a child declared hung sooner than the docs allow)."""
    lines = []
    for key, f in figures.items():
        beat = f"{f['heartbeat_s']:g} s x ({f['misses']}"
        if f["p99"] > f["bound_ms"]:
            lines.append(f"frozen_detect_ms {key}: p99 {f['p99']} ms exceeds its bound "
                         f"{f['bound_ms']} ms ({beat} + 1))")
        if f["min"] < f["floor_ms"]:
            lines.append(f"frozen_detect_ms {key}: a run of {f['min']} ms is under its floor "
                         f"{f['floor_ms']} ms ({beat} - 1))")
    return lines


def print_frozen_table(figures: dict[str, Any]) -> None:
    print("frozen_detect_ms: SIGSTOP of the child's process -> its supervisor's hang event "
          "(the event's time); run i of n stops it i/n of a period after a heartbeat answer "
          "(run 0: the worst phase) unless --frozen-phase fixes it; p99 is nearest-rank, the "
          "max below 100 runs")
    for key, f in figures.items():
        print(f"  {key:22s} {f['median']} ({f['min']}-{f['max']}, n={f['runs']})  "
              f"p99 {f['p99']}  range {f['floor_ms']}-{f['bound_ms']} ms = "
              f"{f['heartbeat_s']:g} s x ({f['misses']} -/+ 1)  p99/bound "
              f"{f['p99_over_bound']}")
        since = f["since_answer_ms"]
        missed = ", ".join(f"{k} at {n}" for n, k in f["missed_heartbeats"].items())
        print(f"  {'':22s} from its last heartbeat answer: {since['median']} "
              f"({since['min']}-{since['max']}); runs judged at N unanswered heartbeats: "
              f"{missed}")


def main(argv: list[str] | None = None) -> None:
    """This part alone: ``bench/supervision.py --only frozen`` with these arguments."""
    import supervision  # bench/ (a script's own folder is on sys.path)
    supervision.main(["--only", "frozen", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
