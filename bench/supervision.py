"""Benchmark of the supervision machinery on a local Ray, at the shape erlay ships.

Prints a table that names what each figure measures (from what event to what event, under
what load), then one JSON object as the last line.  Every figure is the median of several
runs with its spread (``{"median", "min", "max", "runs"}``): a target met by one lucky run
is a miss.

- **Start** (``start_ratio_shipped``, ``start_ratio_by_n``): from the first start issued
  until every component has answered a call, with nothing running before.  The hosted side
  starts the hosts the job would (one per domain on this node, host start included) and
  their components inside; the actor side starts one actor per component.  Every start of a
  side is issued at once, each under its own supervisor, so both sides run with all their
  starts in flight.  The ratio is actor time / hosted time.  ``shipped`` is the default
  config's shape (``configs/cpu.yaml``); ``by_n`` scales the workers per domain, with the
  actor count capped at what fits in half this machine's free memory.
- **Restarts**: from the kill (SIGKILL, or the crashing call of an in-process child) until
  the restarted child answers a call, and the answer must carry a new incarnation:
  a stopwatch that ends on the old child's answer, or never, fails the run.
- **Call overhead** (``call_overhead_ratio``, ``call_overhead_ratio_async``): a call of a
  no-op method that returns the actor's ``perf_counter``, through the tree's handle
  (``tree.ref(path).stamp.remote()``, then ``ray.get``) against the same call on a plain Ray
  actor of the same class and options.  Both run in the shipped configuration: the default
  config's actor environment (telemetry on, file exporter) and the driver's telemetry and
  event sinks; failpoints disarmed, as shipped.  ``sync`` is the learner's shape (a threaded
  actor; erlay adds its ``_erlay`` concurrency group), ``async`` the engine's.  Each figure
  is the median of ``--pairs`` (>= 5) interleaved pairs; a pair's ratio is its median
  supervised block over its median plain block, the side going first alternating block by
  block.  ``call_stages_us`` splits a call: ``lookup`` (the attribute read that yields the
  bound method: erlay's whole per-call code on the driver), ``submit`` (``.remote()``),
  ``to_actor`` (until the method starts, on the actor's clock, the same monotonic clock on
  one machine), ``back`` (until ``ray.get`` returns).
- **Idle CPU**: every process of the job (the driver, Ray's gcs, raylet, agents and workers,
  the hosts and what they spawned), over idle windows, at the job's shape with stand-ins for
  the learner and the engine; against the same Ray with no tree.
- **Frozen detection** (``frozen_detect_ms``, ``bench/supervision_frozen.py``): from the
  SIGSTOP of a child's process (a NodeHost actor; an actor child) until its supervisor's
  ``hang`` event (the event's own time), at the shipped heartbeat and at 1 s x 3, run ``i``
  of ``n`` stopping the child ``i/n`` of a period after a heartbeat answer.  Each figure
  carries its p99 (nearest rank: the max below 100 runs) and the documented range,
  ``floor_ms`` = ``heartbeat_s x (misses - 1)`` to ``bound_ms`` = ``heartbeat_s x
  (misses + 1)`` (docs/supervision.md, "Failure detection").  A p99 over the bound, or a
  run under the floor, fails the bench after its table, naming the figure.

    python bench/supervision.py [--quick | --smoke] [--runs 5] [--scale 4,16] [--pairs 7]
                                [--frozen-runs 3,5] [--plant-no-kill FIGURE]
    python bench/supervision.py --only calls [--pairs 7]    # the call figures alone, ~30 s
    python bench/supervision.py --only frozen [--frozen-runs 3,5] [--frozen-kinds host,actor]
                                [--frozen-phase F] [--plant-no-liveness]  # alone, ~3 min
    python bench/supervision.py --smoke [--only calls|frozen]   # CI's smoke size

``--smoke`` is each part once at its smallest: 1 start pair at the shipped shape (no
warm-up pair, no other N), 1 restart trial (3 hosted), 1 call pair of 2 blocks of 10 calls
per shape, 1 idle window of 1 s (1 s after the tree is up, not 3).  The frozen figures are
left out of the whole run's smoke (``--frozen-runs 0,0``): ``bench/supervision_frozen.py
--smoke`` (``--only frozen --smoke``) runs them, 1 SIGSTOP per kind at 1 s x 3 only, half a
period after a heartbeat answer (``--frozen-phase 0.5``: the middle of the documented range,
as the tests run it); a figure outside its range still fails.  Options given explicitly win
over the smoke sizes.

``--plant-no-kill hosted_restart_ms`` (or another restart figure) skips that kill: the run
must then fail, naming the figure whose child never answered with a new incarnation.
``--plant-no-liveness`` switches the heartbeat off for the frozen figures: no ``hang`` event
follows the SIGSTOP, and the run must fail naming the figure instead of reporting a number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import psutil

from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.host import host_spec
from erlay.supervisor.hosted import resolve
from erlay.supervisor.raylocal import ensure_ray, local_node_id, shutdown_ray
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
    WorkerStart,
)
from erlay.supervisor.tree import SupervisionTree
from erlay.supervisor.worker_process import CallOutcome, WorkerCall

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # bench/ (a script's own folder is on sys.path)
from supervision_calls import bench_call_overhead, call_figures, print_call_table
from supervision_frozen import (
    FROZEN_KINDS,
    FrozenNotFound,
    frozen_figures,
    outside_range,
    print_frozen_table,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = REPO / "configs" / "cpu.yaml"
ACTOR_MB = 48          # one idle actor process here (RSS), for the memory cap
LOOSE = SupervisorFlags("one_for_one", intensity=1000, period=1)
POOL = SupervisorFlags("simple_one_for_one", intensity=1000, period=1)
# A subprocess child that answers "<incarnation> <pid>" on a Unix socket once ready.
ANSWERER = ("import os, socket\n"
            "path = os.environ['BENCH_SOCKET']\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try: os.unlink(path)\n"
            "except FileNotFoundError: pass\n"
            "s.bind(path); s.listen(8)\n"
            "answer = f\"{os.environ['ERLAY_INCARNATION']} {os.getpid()}\".encode()\n"
            "os.write(int(os.environ['ERLAY_READY_FD']), b'ready\\n')\n"
            "while True:\n"
            "    c, _ = s.accept(); c.recv(16); c.sendall(answer); c.close()\n")


RESTART_FIGURES = ["hosted_restart_ms", "hosted_inprocess_restart_ms", "actor_restart_ms",
                   "ray_native_restart_ms"]


class NoNewIncarnation(RuntimeError):
    """A restart stopwatch found no answer from a new incarnation: the figure is void."""


class Target:
    """The child under test: answers with its pid and which incarnation in its process."""

    made = 0

    def __init__(self) -> None:
        from erlay.supervisor.progress import Progress
        type(self).made += 1
        self.incarnation = type(self).made
        self.progress = Progress()

    def pid(self) -> int:
        return os.getpid()

    def which(self) -> tuple[int, int]:
        return self.incarnation, os.getpid()

    def nop(self) -> None:
        return None

    def crash(self) -> None:
        raise RuntimeError("bench crash")


class ComponentActor:
    """A hosted component run as its own actor instead: built as a host builds it (the
    factory, then ``setup``), and answering the same calls."""

    def __init__(self, factory: str, args: tuple[Any, ...]) -> None:
        self.obj = resolve(factory)(*args)

    async def erlay_ready(self) -> None:
        if hasattr(self.obj, "setup"):
            await self.obj.setup()

    async def call(self, method: str) -> tuple[Any, int]:
        return getattr(self.obj, method)(), os.getpid()


@dataclass(frozen=True)
class Domain:
    """One fault domain's hosted components on one node, as the job lays them out: in the
    host's process (``worker=False``: the sandbox's workers) or each in a worker process of
    the host (``worker=True``: the judge's and the environment's, user code).  ``probe`` is
    the method a started component answers."""

    name: str           # the template id: workers are <name>-1..N
    factory: str
    args: tuple[Any, ...]
    instances: tuple[tuple[Any, ...], ...]
    worker: bool = False
    probe: str = "stats"

    def child(self) -> ChildSpec:
        start = WorkerStart(self.factory, args=self.args) if self.worker \
            else InProcessStart(self.factory, args=self.args)
        return ChildSpec(self.name, start)


def shipped_domains(workers: int | None = None) -> list[Domain]:
    """The hosted domains of the default config, as ``actors/job/driver.py`` builds them
    for node 0; ``workers`` overrides the workers per domain."""
    from erlay.actors.config import load_config
    from erlay.actors.job.env_worker import EnvironmentSpec
    cfg = load_config(str(SHIPPED_CONFIG), [])
    ns, nj = workers or cfg.sandbox.workers_per_node, workers or cfg.judge.workers_per_node
    ne = workers or cfg.environment.workers_per_node
    return [Domain("sandbox", "erlay.sandbox.worker:SandboxWorker",
                   (dict(cfg.sandbox.limits),), tuple((s,) for s in range(ns))),
            Domain("judge", "erlay.judges.server:JudgeServer",
                   (cfg.judge.cls, dict(cfg.judge.kwargs)), tuple(() for _ in range(nj)),
                   worker=True),
            Domain("environment", "erlay.actors.job.env_worker:EnvironmentServer",
                   (EnvironmentSpec(cfg.environment.cls, dict(cfg.environment.kwargs)),),
                   tuple(() for _ in range(ne)), worker=True, probe="describe")]


def sup(cid: str, *children: ChildSpec, flags: SupervisorFlags = LOOSE) -> ChildSpec:
    return ChildSpec(cid, SupervisorStart(flags, children), type="supervisor")


# ---------------------------------------------------------------------------- start
def _start_all(name: str, units: list[ChildSpec]) -> tuple[SupervisionTree, float]:
    """A tree with one empty supervisor per unit; every unit's start issued at once.
    Returns the tree and the second the starts were issued at."""
    tree = SupervisionTree(name, LOOSE, [sup(f"u{i}") for i in range(len(units))]).start()
    sups = [tree.supervisor(f"{name}/u{i}") for i in range(len(units))]

    async def start() -> None:
        await asyncio.gather(*(s.start_child(u) for s, u in zip(sups, units, strict=True)))

    issued = time.perf_counter()
    tree.run(start, timeout=900)
    return tree, issued


def _teardown(tree: SupervisionTree, pids: set[int]) -> None:
    """Stop the tree and wait for its processes to go, so the next run starts quiet."""
    tree.stop()
    procs = []
    for pid in pids - {os.getpid()}:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    time.sleep(0.5)


def time_hosted_start(name: str, domains: list[Domain]) -> float:
    """Seconds from issuing the hosts' starts until every hosted component answered."""
    import ray
    units = [host_spec(f"{d.name}-0", POOL, (d.child(),), node_id=local_node_id(),
                       instances=d.instances, shutdown="brutal_kill")
             for d in domains]
    tree, issued = _start_all(name, units)
    hosts = [tree.ref(f"{name}/u{i}/{u.id}") for i, u in enumerate(units)]
    pending = []
    for h, d in zip(hosts, domains, strict=True):
        if d.worker:   # one call per worker process: each free one takes one
            pending.append(h.submit.remote([WorkerCall(d.probe)] * len(d.instances)))
        else:
            pending += [h.call.remote(f"{d.name}-{k + 1}", d.probe)
                        for k in range(len(d.instances))]
    answers: list[Any] = []
    for answer in ray.get(pending):
        answers += answer if isinstance(answer, list) else [answer]
    elapsed = time.perf_counter() - issued
    pids = set(ray.get([h.ping.remote() for h in hosts]))
    assert len(answers) == sum(len(d.instances) for d in domains) and len(pids) == len(hosts)
    assert all(a.ok for a in answers if isinstance(a, CallOutcome)), answers
    _teardown(tree, pids)
    return elapsed


def time_actor_start(name: str, domains: list[Domain]) -> float:
    """Seconds from issuing one actor start per component until every one answered."""
    import ray
    units = [ChildSpec(f"{d.name}-{k + 1}", ActorStart(ComponentActor,
                                                       args=(d.factory, (*d.args, *inst))),
                       shutdown="brutal_kill")
             for d in domains for k, inst in enumerate(d.instances)]
    tree, issued = _start_all(name, units)
    probes = [d.probe for d in domains for _ in d.instances]
    answers = ray.get([tree.ref(f"{name}/u{i}/{u.id}").call.remote(probe)
                       for i, (u, probe) in enumerate(zip(units, probes, strict=True))])
    elapsed = time.perf_counter() - issued
    pids = {pid for _, pid in answers}
    assert len(pids) == len(units), "one process per actor component"
    _teardown(tree, pids)
    return elapsed


def start_ratios(domains: list[Domain], runs: int, tag: str, *,
                 warmup: bool = False) -> dict[str, list[float]]:
    """``runs`` pairs, alternating which side goes first so drift hits both; ``warmup`` adds
    a first pair that is not counted (a cluster's first starts pay one-time costs)."""
    out: dict[str, list[float]] = {"actor_ms": [], "hosted_ms": [], "ratio": []}
    for r in range(-1 if warmup else 0, runs):
        order = [("actor", time_actor_start), ("hosted", time_hosted_start)]
        got = dict((side, fn(f"bs{tag}{side[0]}{r + 1}", domains))
                   for side, fn in (order if r % 2 == 0 else order[::-1]))
        if r < 0:
            continue
        out["actor_ms"].append(got["actor"] * 1000)
        out["hosted_ms"].append(got["hosted"] * 1000)
        out["ratio"].append(got["actor"] / got["hosted"])
    return out


def actor_cap() -> int:
    """Actors that fit in half the memory free now, at ACTOR_MB each."""
    return int(psutil.virtual_memory().available * 0.5 / (ACTOR_MB * 2**20))


# -------------------------------------------------------------------------- restarts
def until_new(ask: Callable[[], tuple[int, int]], is_new: Callable[[tuple[int, int]], bool],
              what: str, timeout: float) -> None:
    """Poll ``ask`` until its answer (incarnation, pid) ``is_new``; raise NoNewIncarnation
    past ``timeout``.  Errors while the child restarts are retried."""
    deadline = time.perf_counter() + timeout
    last: Any = None
    while time.perf_counter() < deadline:
        try:
            last = ask()
        except Exception:  # not answering yet is what we wait through
            time.sleep(0.001)
            continue
        if is_new(last):
            return
        time.sleep(0.001)
    raise NoNewIncarnation(f"{what}: no answer from a new incarnation within {timeout:g} s "
                           f"of the kill (last answer: incarnation, pid = {last})")


def ask_socket(path: str) -> tuple[int, int]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1.0)
        s.connect(path)
        s.sendall(b"which")
        inc, pid = s.recv(64).split()
    return int(inc), int(pid)


def bench_hosted_restart(trials: int, plant: str | None) -> tuple[list[float], list[float]]:
    """SIGKILL of a subprocess child, and a crashing call of an in-process child, each until
    the restarted child answers with a new incarnation.  The host holds nothing else."""
    import ray
    workdir = tempfile.TemporaryDirectory(prefix="erlay-bench-")
    sock = os.path.join(workdir.name, "child.sock")
    hosted = (ChildSpec("proc", SubprocessStart((sys.executable, "-S", "-c", ANSWERER),
                                                env={"BENCH_SOCKET": sock}, wait_ready=True)),
              ChildSpec("obj", InProcessStart(Target)))
    tree = SupervisionTree("bhr", LOOSE, [sup("pool", host_spec("n0", LOOSE, hosted,
                                                                node_id=local_node_id()))]).start()
    host = tree.ref("bhr/pool/host@n0")
    sub_ms, obj_ms = [], []
    try:
        for _ in range(trials):
            time.sleep(0.1)
            old = ask_socket(sock)
            started = time.perf_counter()
            if plant != "hosted_restart_ms":
                os.kill(old[1], signal.SIGKILL)
            until_new(lambda: ask_socket(sock), lambda a, o=old: a[0] > o[0] and a[1] != o[1],
                      "hosted_restart_ms", 10)
            sub_ms.append((time.perf_counter() - started) * 1000)
            old = ray.get(host.call.remote("obj", "which"))  # its pid is the host's
            started = time.perf_counter()
            if plant != "hosted_inprocess_restart_ms":
                try:
                    ray.get(host.call.remote("obj", "crash"))
                except Exception:  # the crash is the point
                    pass
            until_new(lambda: ray.get(host.call.remote("obj", "which")),
                      lambda a, o=old: a[0] > o[0], "hosted_inprocess_restart_ms", 10)
            obj_ms.append((time.perf_counter() - started) * 1000)
    finally:
        tree.stop()
        workdir.cleanup()
    return sub_ms, obj_ms


def bench_actor_restart(trials: int, plant: str | None) -> tuple[list[float], list[float]]:
    """SIGKILL of an actor child until its new incarnation answers; and until the
    supervisor's exit event (death detection)."""
    import ray
    sink = MemorySink()
    tree = SupervisionTree("bar", LOOSE, [sup("gen", ChildSpec("engine", ActorStart(Target)))],
                           sink=sink).start()
    ref = tree.ref("bar/gen/engine")
    restart_ms, detect_ms = [], []
    try:
        for _ in range(trials):
            time.sleep(0.5)
            old = (ref.incarnation, ray.get(ref.pid.remote()))
            seen = len(sink.of(EventKind.EXIT))
            killed_at = time.time()
            started = time.perf_counter()
            if plant != "actor_restart_ms":
                os.kill(old[1], signal.SIGKILL)
            until_new(lambda: (ref.incarnation, ray.get(ref.pid.remote(), timeout=5)),
                      lambda a, o=old: a[0] > o[0] and a[1] != o[1], "actor_restart_ms", 30)
            restart_ms.append((time.perf_counter() - started) * 1000)
            exits = sink.of(EventKind.EXIT)
            assert len(exits) == seen + 1, "one exit event per kill"
            detect_ms.append((exits[-1].time - killed_at) * 1000)
    finally:
        tree.stop()
    return restart_ms, detect_ms


def bench_ray_native_restart(trials: int, plant: str | None) -> list[float]:
    """The same kill of a plain Ray actor with ``max_restarts=-1``, until it answers from a
    new process (Ray counts its restarts; the pid says it is new)."""
    import ray
    native = ray.remote(num_cpus=0, max_restarts=-1)(Target).remote()
    out = []
    try:
        for _ in range(trials):
            time.sleep(0.5)
            old = ray.get(native.pid.remote())
            started = time.perf_counter()
            if plant != "ray_native_restart_ms":
                os.kill(old, signal.SIGKILL)
            until_new(lambda: (0, ray.get(native.pid.remote(), timeout=5)),
                      lambda a, o=old: a[1] != o, "ray_native_restart_ms", 30)
            out.append((time.perf_counter() - started) * 1000)
    finally:
        ray.kill(native)
    return out


# --------------------------------------------------------------------------- idle CPU
def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def job_processes() -> dict[int, psutil.Process]:
    """This driver and every process under it: the local Ray it started (gcs_server,
    raylet, agents, workers) and what those spawned."""
    me = psutil.Process()
    return {p.pid: p for p in [me, *me.children(recursive=True)]}


def _part(proc: psutil.Process, actors: set[int]) -> str:
    if proc.pid == os.getpid():
        return "driver"
    try:
        chain = {proc.pid, *(p.pid for p in proc.parents())}
    except psutil.Error:
        return "ray"
    return "tree_actors" if chain & actors else "ray"


def idle_windows(windows: int, seconds: float, actors: set[int],
                 tree_thread: int | None) -> list[dict[str, float]]:
    """CPU % of one core per window: the whole job, by part, and the tree's thread.
    A process that starts inside a window counts with all its CPU; one that ends loses its
    last window's share (counted in ``churn``)."""
    out = []
    for _ in range(windows):
        before = {}
        for pid, proc in job_processes().items():
            try:
                before[pid] = (proc.create_time(), _cpu(proc))
            except psutil.Error:
                pass
        thread0 = _thread_cpu(tree_thread)
        t0 = time.perf_counter()
        time.sleep(seconds)
        wall = time.perf_counter() - t0
        parts = {"driver": 0.0, "ray": 0.0, "tree_actors": 0.0}
        after = job_processes()
        names = set()
        for pid, proc in after.items():
            try:
                cpu, created = _cpu(proc), proc.create_time()
                names.add(proc.name())
            except psutil.Error:
                continue
            start = before.get(pid)
            used = cpu - start[1] if start and start[0] == created else cpu
            parts[_part(proc, actors)] += used
        if not {"gcs_server", "raylet"} <= names:
            raise RuntimeError(f"Ray's gcs_server and raylet are not among the job's "
                               f"processes ({sorted(names)}): idle CPU would leave them out")
        row = {k: v / wall * 100 for k, v in parts.items()}
        row["job"] = sum(row.values())
        row["tree_thread_s"], row["wall_s"] = _thread_cpu(tree_thread) - thread0, wall
        row["processes"] = len(after)
        row["churn"] = len(set(after) ^ set(before))
        out.append(row)
    return out


def _thread_cpu(native_id: int | None) -> float:
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    return 0.0


def bench_idle_cpu(windows: int, seconds: float, settle_s: float = 3.0
                   ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Windows with Ray alone, then with the job's tree idle (``settle_s`` after it is up):
    learner and engine stand-ins (actor children with the job's deadlines) and the shipped
    hosts and workers, every child with the default heartbeat."""
    import ray
    baseline = idle_windows(windows, seconds, set(), None)
    units = [sup("learner", ChildSpec("learner-0", ActorStart(Target),
                                      deadlines={"train_step": 600.0})),
             sup("generation", ChildSpec("engine-0", ActorStart(Target),
                                         deadlines={"decode_step": 30.0}))]
    for d in shipped_domains():
        units.append(sup(d.name, host_spec("node-0", POOL, (d.child(),),
                                           node_id=local_node_id(), instances=d.instances)))
    tree = SupervisionTree("bidle", LOOSE, units).start()
    actors = {ray.get(tree.ref(p).pid.remote())
              for p in ("bidle/learner/learner-0", "bidle/generation/engine-0")}
    actors |= {ray.get(tree.ref(f"bidle/{d.name}/host@node-0").ping.remote())
               for d in shipped_domains()}
    time.sleep(settle_s)
    with_tree = idle_windows(windows, seconds, actors, tree.thread_native_id)
    tree.stop()
    return baseline, with_tree


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer runs and trials")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke size: each part once, at its smallest (the "
                        "frozen figures only with --only frozen)")
    parser.add_argument("--runs", type=int, help="start runs at the shipped shape (default 5)")
    parser.add_argument("--scale", help="workers per domain for start_ratio_by_n "
                        "(components N = 2 x this), default 4,16")
    parser.add_argument("--trials", type=int, help="actor restart trials (default 10; "
                        "hosted ones 3 x this)")
    parser.add_argument("--pairs", type=int, help="interleaved call pairs per shape "
                        "(default 7, at least 5)")
    parser.add_argument("--call-blocks", type=int,
                        help="blocks per side in one call pair (default 10)")
    parser.add_argument("--call-block", type=int, help="calls per block (default 20)")
    parser.add_argument("--only", choices=["calls", "frozen"],
                        help="run one part only (its figures and the load)")
    parser.add_argument("--idle-windows", type=int, help="idle windows (default 4)")
    parser.add_argument("--idle-seconds", type=float, help="seconds per idle window (5)")
    parser.add_argument("--frozen-runs", help="SIGSTOPs per frozen figure at the shipped "
                        "heartbeat and at 1 s x 3, default 3,5 (0 skips a setting)")
    parser.add_argument("--frozen-kinds", default=",".join(FROZEN_KINDS),
                        help="children to freeze: host,actor (default both)")
    parser.add_argument("--frozen-phase", type=float,
                        help="stop every frozen run this fraction of a period after a "
                        "heartbeat answer (default: run i of n at i/n)")
    parser.add_argument("--plant-no-kill", choices=RESTART_FIGURES, dest="plant",
                        help="skip the kill behind this figure: the run must fail")
    parser.add_argument("--plant-no-liveness", action="store_true",
                        help="freeze children with the heartbeat off: the run must fail")
    args = parser.parse_args(argv)
    if args.smoke:   # what is not given explicitly, at its smallest
        args.runs, args.trials, args.pairs = args.runs or 1, args.trials or 1, args.pairs or 1
        args.idle_windows, args.idle_seconds = args.idle_windows or 1, args.idle_seconds or 1.0
        args.frozen_runs = args.frozen_runs or ("0,1" if args.only == "frozen" else "0,0")
        if args.frozen_phase is None:
            args.frozen_phase = 0.5
        args.call_blocks, args.call_block = args.call_blocks or 2, args.call_block or 10
    runs = args.runs or (2 if args.quick else 5)
    scale = [int(x) for x in (args.scale or ("2" if args.quick else "4,16")).split(",")]
    if args.smoke and not args.scale:
        scale = []   # the shipped N alone
    trials = args.trials or (4 if args.quick else 10)
    windows = args.idle_windows or (2 if args.quick else 4)
    window_s = args.idle_seconds or (2.0 if args.quick else 5.0)
    pairs = args.pairs if args.smoke else max(5, args.pairs or 7)
    blocks, block = args.call_blocks or 10, args.call_block or 20
    shipped_runs, fast_runs = (int(x) for x in
                               (args.frozen_runs or ("1,2" if args.quick else "3,5")).split(","))
    kinds = tuple(args.frozen_kinds.split(","))
    if not set(kinds) <= set(FROZEN_KINDS):
        parser.error(f"--frozen-kinds: {args.frozen_kinds} (expected some of host,actor)")
    if args.frozen_phase is not None and not 0 <= args.frozen_phase < 1:
        parser.error(f"--frozen-phase: {args.frozen_phase} (expected 0 <= phase < 1)")
    import logging
    logging.getLogger("erlay").setLevel(logging.ERROR)
    logging.getLogger("erlay.supervisor").setLevel(logging.ERROR)
    began, load0 = time.perf_counter(), os.getloadavg()[0]
    # A Ray already up (a test's) is not ours to shut down.
    ours = ensure_ray(num_cpus=2, include_dashboard=False)["started"]

    def fail(exc: Exception) -> NoReturn:
        print(f"FAILED: {exc}")
        if ours:
            shutdown_ray()
        sys.exit(1)

    if args.only == "calls":
        calls = bench_call_overhead(pairs, blocks, block)
        load1 = os.getloadavg()[0]
        if ours:
            shutdown_ray()
        result = {**call_figures(calls), "load_avg_1m": [round(load0, 2), round(load1, 2)],
                  "wall_s": round(time.perf_counter() - began, 1)}
        print_call_table(result)
        print(json.dumps(result))
        return
    if args.only == "frozen":
        try:
            frozen = frozen_figures((shipped_runs, fast_runs), kinds, args.plant_no_liveness,
                                    args.frozen_phase)
        except FrozenNotFound as exc:
            fail(exc)
        load1 = os.getloadavg()[0]
        if ours:
            shutdown_ray()
        result = {"frozen_detect_ms": frozen,
                  "load_avg_1m": [round(load0, 2), round(load1, 2)],
                  "wall_s": round(time.perf_counter() - began, 1)}
        print_frozen_table(frozen)
        print(f"  load_avg_1m {result['load_avg_1m']} (start, end)")
        print(json.dumps(result))
        exit_outside_range(frozen)
        return
    try:
        sub_ms, obj_ms = bench_hosted_restart(trials * 3, args.plant)
        actor_ms, detect_ms = bench_actor_restart(trials, args.plant)
        native_ms = bench_ray_native_restart(trials, args.plant)
        frozen = frozen_figures((shipped_runs, fast_runs), kinds, args.plant_no_liveness,
                                args.frozen_phase)
    except (NoNewIncarnation, FrozenNotFound) as exc:
        fail(exc)
    shipped = start_ratios(shipped_domains(), runs, "s", warmup=not args.smoke)
    cap = actor_cap()
    by_n = {sum(len(d.instances) for d in shipped_domains()): shipped}
    for workers in scale:
        domains = shipped_domains(min(workers, cap // 2))  # no more actors than fit
        n = sum(len(d.instances) for d in domains)
        by_n[n] = by_n.get(n) or start_ratios(domains, max(2, runs // 2 + 1), str(n))
    calls = bench_call_overhead(pairs, blocks, block)
    idle_ray, idle_tree = bench_idle_cpu(windows, window_s, 1.0 if args.smoke else 3.0)
    load1 = os.getloadavg()[0]
    if ours:
        shutdown_ray()

    def col(rows: list[dict[str, float]], key: str) -> list[float]:
        return [r[key] for r in rows]

    result: dict[str, Any] = {
        "start_ratio_shipped": spread(shipped["ratio"], digits=2),
        "start_shipped_actor_ms": spread(shipped["actor_ms"], digits=1),
        "start_shipped_hosted_ms": spread(shipped["hosted_ms"], digits=1),
        "start_ratio_by_n": {str(n): spread(v["ratio"], digits=2) for n, v in by_n.items()},
        "start_ms_by_n": {str(n): {"actor": round(statistics.median(v["actor_ms"]), 1),
                                   "hosted": round(statistics.median(v["hosted_ms"]), 1)}
                          for n, v in by_n.items()},
        "actor_cap": cap,
        "hosted_restart_ms": spread(sub_ms, digits=1),
        "hosted_inprocess_restart_ms": spread(obj_ms, digits=2),
        "actor_restart_ms": spread(actor_ms, digits=1),
        "ray_native_restart_ms": spread(native_ms, digits=1),
        "death_detect_ms": spread(detect_ms, digits=1),
        "frozen_detect_ms": frozen,
        **call_figures(calls),
        "idle_cpu_percent": spread(col(idle_tree, "job"), digits=2),
        "idle_cpu_ray_alone_percent": spread(col(idle_ray, "job"), digits=2),
        "idle_cpu_by_part": {k: round(statistics.median(col(idle_tree, k)), 2)
                             for k in ("driver", "ray", "tree_actors")},
        # Thread times tick in 10 ms: one figure over every window, not a median.
        "idle_cpu_tree_thread_percent": round(sum(col(idle_tree, "tree_thread_s")) * 100
                                              / sum(col(idle_tree, "wall_s")), 2),
        "idle_processes": int(statistics.median(col(idle_tree, "processes"))),
        "load_avg_1m": [round(load0, 2), round(load1, 2)],
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print_table(result, window_s)
    if frozen:
        print_frozen_table(frozen)
    else:   # --frozen-runs 0,0, as --smoke sets it
        print("frozen_detect_ms: not run (bench/supervision_frozen.py --smoke runs it)")
    print_call_table(result)
    print(json.dumps(result))
    exit_outside_range(frozen)


def exit_outside_range(frozen: dict[str, Any]) -> None:
    """Exit 1, naming each frozen figure outside its documented range (after the table and
    the JSON line, so the numbers that failed are on record)."""
    lines = outside_range(frozen)
    for line in lines:
        print(f"FAILED: {line}")
    if lines:
        sys.exit(1)


def fmt(s: dict[str, Any]) -> str:
    return f"{s['median']} ({s['min']}-{s['max']}, n={s['runs']})"


def print_table(r: dict[str, Any], window_s: float) -> None:

    rows = [
        ("start_ratio_shipped", fmt(r["start_ratio_shipped"]),
         "actor / hosted time, first start issued -> every component answered a call; "
         "default config: sandbox + judge hosts, 1 worker each, vs 2 actors; all starts in "
         "flight at once"),
        ("  actor side ms", fmt(r["start_shipped_actor_ms"]), ""),
        ("  hosted side ms (host start included)", fmt(r["start_shipped_hosted_ms"]), ""),
        *((f"start_ratio_by_n N={n}", fmt(s), f"N components: 2 hosts of N/2 vs N actors "
           f"(actor {r['start_ms_by_n'][n]['actor']} ms, hosted "
           f"{r['start_ms_by_n'][n]['hosted']} ms)")
          for n, s in r["start_ratio_by_n"].items()),
        ("actor_cap", r["actor_cap"], f"largest N run: half the free memory / {ACTOR_MB} MB"),
        ("hosted_restart_ms", fmt(r["hosted_restart_ms"]),
         "SIGKILL of a subprocess child -> its new incarnation answers on its socket; "
         "idle host"),
        ("hosted_inprocess_restart_ms", fmt(r["hosted_inprocess_restart_ms"]),
         "crashing call -> a call answered by the new incarnation"),
        ("actor_restart_ms", fmt(r["actor_restart_ms"]),
         "SIGKILL of an actor child -> the new incarnation answers"),
        ("ray_native_restart_ms", fmt(r["ray_native_restart_ms"]),
         "same kill, plain actor with max_restarts=-1 -> a new process answers"),
        ("death_detect_ms", fmt(r["death_detect_ms"]),
         "SIGKILL of an actor child -> the supervisor's exit event"),
        ("idle_cpu_percent", fmt(r["idle_cpu_percent"]),
         f"% of one core, every process of the job incl. Ray's, {window_s:g} s windows, "
         f"tree idle ({r['idle_processes']} processes)"),
        ("idle_cpu_ray_alone_percent", fmt(r["idle_cpu_ray_alone_percent"]),
         "the same processes before the tree started"),
        ("idle_cpu_by_part", r["idle_cpu_by_part"], "medians of the windows"),
        ("idle_cpu_tree_thread_percent", r["idle_cpu_tree_thread_percent"],
         "the supervisors' own thread (part of driver), over all windows"),
        ("load_avg_1m", r["load_avg_1m"], "at start and end of the bench"),
        ("wall_s", r["wall_s"], ""),
    ]
    print(f"{'figure':40s} {'median (min-max, n)':>28s}  what it measures")
    for name, value, what in rows:
        print(f"{name:40s} {value!s:>28s}  {what}")


if __name__ == "__main__":
    main()
