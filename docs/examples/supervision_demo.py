"""A local supervision tree surviving kills: erlay's OTP core on its own, with no RL.

    python docs/examples/supervision_demo.py [--kills 8] [--interval 0.5]

It uses only the public API of :mod:`erlay.supervisor` (spec, tree, host, events), so it is
also the shortest example of supervising your own components with erlay.

The tree has a root with two domains: ``gen`` holds actor children (dedicated Ray actors) and
``pool`` holds one node host with in-process and subprocess children.  On a schedule the demo
SIGKILLs an actor's process, crashes an in-process child, SIGKILLs a subprocess child and
SIGSTOPs an actor that holds work (a hang, found by its progress deadline).  For each fault it
measures the time until the replacement serves, then prints the tree, the restarts and a
summary, and checks that shutting down left no process behind.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from erlay.supervisor.events import EventKind, FanoutSink, LoggingSink, MemorySink
from erlay.supervisor.host import host_spec
from erlay.supervisor.progress import Progress
from erlay.supervisor.raylocal import ensure_ray, local_node_id, shutdown_ray
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
)
from erlay.supervisor.tree import SupervisionTree

HANG_DEADLINE_S = 1.0
SLEEPER = ("import os, time\n"
           "os.write(int(os.environ['ERLAY_READY_FD']), b'ready\\n')\n"
           "while True: time.sleep(3600)\n")


class DemoEngine:
    """Stands in for a generation engine: answers pings, can hold work without progress."""

    def __init__(self) -> None:
        self.progress = Progress()

    def ping(self) -> int:
        return os.getpid()

    def hold_work(self) -> None:
        self.progress.begin("decode_step", work="demo-rollout")


class DemoWorker:
    """Stands in for a hosted worker (a sandbox or judge worker)."""

    def ping(self) -> int:
        return os.getpid()

    def crash(self) -> None:
        raise RuntimeError("injected crash")


@dataclass
class Fault:
    kind: str
    path: str
    latency_ms: float | None


def build_tree(node_id: str, sink: Any) -> SupervisionTree:
    engines = tuple(ChildSpec(f"engine-{i}", ActorStart(DemoEngine),
                              deadlines={"decode_step": HANG_DEADLINE_S}, progress_poll_s=0.25)
                    for i in range(2))
    hosted = (*(ChildSpec(f"worker-{i}", InProcessStart(DemoWorker)) for i in range(3)),
              *(ChildSpec(f"proc-{i}", SubprocessStart((sys.executable, "-S", "-c", SLEEPER),
                                                       wait_ready=True), shutdown=2.0)
                for i in range(2)))
    flags = SupervisorFlags("one_for_one", intensity=10, period=10)
    return SupervisionTree("erlay", SupervisorFlags("one_for_one", intensity=3, period=10), [
        ChildSpec("gen", SupervisorStart(flags, engines), type="supervisor"),
        ChildSpec("pool", SupervisorStart(flags, (host_spec("node-0", flags, hosted,
                                                            node_id=node_id),)),
                  type="supervisor"),
    ], sink=sink)


def _until(fn: Callable[[], bool], timeout: float) -> float | None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            if fn():
                return (time.perf_counter() - start) * 1000
        except Exception:  # noqa: BLE001 - the child is restarting; keep asking
            pass
        time.sleep(0.005)
    return None


def run_demo(kills: int = 8, interval_s: float = 0.5, out: Any = sys.stdout) -> int:
    """Run the demo; return the process exit code (0 when every fault was recovered)."""
    import ray

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    say("erlay demo: a supervision tree on a local Ray, surviving kills")
    t0 = time.perf_counter()
    ensure_ray(num_cpus=2, include_dashboard=False)
    memory = MemorySink()
    tree = build_tree(local_node_id(), FanoutSink([memory, LoggingSink()]))
    tree.start()
    say(f"started Ray and the tree in {time.perf_counter() - t0:.1f} s\n")
    say(tree.render())
    host = tree.ref("erlay/pool/host@node-0")

    def engine_kill(i: int) -> Fault:
        ref = tree.ref(f"erlay/gen/engine-{i % 2}")
        pid = ray.get(ref.ping.remote())
        os.kill(pid, signal.SIGKILL)
        return Fault("SIGKILL actor", ref.path,
                     _until(lambda: ray.get(ref.ping.remote(), timeout=2) != pid, 30))

    def engine_hang(i: int) -> Fault:
        ref = tree.ref(f"erlay/gen/engine-{i % 2}")
        pid = ray.get(ref.ping.remote())
        ray.get(ref.hold_work.remote())
        os.kill(pid, signal.SIGSTOP)
        return Fault("SIGSTOP actor (hang)", ref.path,
                     _until(lambda: ray.get(ref.ping.remote(), timeout=2) != pid, 30))

    def worker_crash(i: int) -> Fault:
        cid = f"worker-{i % 3}"
        try:
            ray.get(host.call.remote(cid, "crash"))
        except Exception:  # noqa: BLE001 - the crash is the point
            pass
        return Fault("crash in-process child", f"{host.path}/{cid}",
                     _until(lambda: ray.get(host.call.remote(cid, "ping"), timeout=2) > 0, 30))

    def proc_kill(i: int) -> Fault:
        cid = f"proc-{i % 2}"
        before = _incarnation(host, cid)
        ray.get(host.signal_child.remote(cid, signal.SIGKILL))
        return Fault("SIGKILL subprocess child", f"{host.path}/{cid}",
                     _until(lambda: _incarnation(host, cid) > before, 30))

    schedule = [engine_kill, worker_crash, proc_kill, engine_hang]
    faults: list[Fault] = []
    say(f"\ninjecting {kills} faults, one every {interval_s:g} s:")
    for i in range(kills):
        time.sleep(interval_s)
        fault = schedule[i % len(schedule)](i)
        faults.append(fault)
        took = f"{fault.latency_ms:7.1f} ms" if fault.latency_ms is not None else "NOT RECOVERED"
        say(f"  {i + 1:2d}. {fault.kind:26s} {fault.path:34s} serving again after {took}")

    say("")
    say(tree.render())
    groups = ray.get(host.process_groups.remote())
    reason = tree.stop()
    shutdown_ray()
    orphans = [g for g in groups if psutil.pid_exists(g)]
    restarts = memory.of(EventKind.RESTART)
    recovered = [f for f in faults if f.latency_ms is not None]
    say(f"\nrestarts: {len(restarts)} (by child: {_count_by_path(restarts)})")
    for kind in dict.fromkeys(f.kind for f in faults):
        ms = [f.latency_ms for f in faults if f.kind == kind and f.latency_ms is not None]
        if ms:
            say(f"  {kind:26s} p50 {statistics.median(ms):7.1f} ms  max {max(ms):7.1f} ms")
    say(f"tree stopped ({reason}); orphan processes left: {len(orphans)}")
    ok = len(recovered) == len(faults) and not orphans
    say(f"summary: {len(recovered)}/{len(faults)} faults recovered without restarting the "
        f"tree, {len(orphans)} orphans, {time.perf_counter() - t0:.1f} s in all -> "
        f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _incarnation(host: Any, cid: str) -> int:
    import ray
    rows = ray.get(host.which_children.remote(), timeout=2)
    row = next(r for r in rows if r["id"] == cid)
    return int(row["incarnation"]) if row["status"] == "running" else -1


def _count_by_path(events: list[Any]) -> str:
    counts: dict[str, int] = {}
    for e in events:
        counts[e.path] = counts.get(e.path, 0) + 1
    return ", ".join(f"{p.removeprefix('erlay/')}={n}" for p, n in counts.items())


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="a local supervision tree surviving kills")
    parser.add_argument("--kills", type=int, default=8, help="faults to inject (default 8)")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="seconds between faults (default 0.5)")
    args = parser.parse_args(argv)
    return run_demo(kills=args.kills, interval_s=args.interval)


if __name__ == "__main__":
    sys.exit(main())
