"""Benchmark of the supervision machinery on a local Ray.

Prints a table, then one JSON object as the last line.  Figures compare things measured in
the same run (ratios), because these machines are shared and noisy.

    python bench/supervision.py [--hosted 1000] [--actors 50] [--trials 15]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

import psutil

from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import ensure_ray, local_node_id
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
)
from erlay.supervisor.tree import SupervisionTree

SLEEPER = ("import os, time\n"
           "os.write(int(os.environ['ERLAY_READY_FD']), b'ready\\n')\n"
           "while True: time.sleep(3600)\n")
LOOSE = SupervisorFlags("one_for_one", intensity=1000, period=1)


class Target:
    """The child under test: answers with its pid."""

    def __init__(self) -> None:
        from erlay.supervisor.progress import Progress
        self.progress = Progress()

    def pid(self) -> int:
        return os.getpid()

    def nop(self) -> None:
        return None

    def crash(self) -> None:
        raise RuntimeError("bench crash")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def until(fn: Any, timeout: float = 60) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            if fn():
                return (time.perf_counter() - start) * 1000
        except Exception:
            pass
        time.sleep(0.002)
    raise TimeoutError("no recovery")


def sup(cid: str, *children: ChildSpec, flags: SupervisorFlags = LOOSE) -> ChildSpec:
    return ChildSpec(cid, SupervisorStart(flags, children), type="supervisor")


def bench_hosted_start(n: int) -> float:
    import ray
    template = ChildSpec("w", InProcessStart(Target), restart="temporary")
    host_flags = SupervisorFlags("simple_one_for_one", intensity=1000, period=1)
    tree = SupervisionTree("bh", LOOSE, [sup("pool", host_spec("n0", host_flags, (template,),
                                                               node_id=local_node_id()))]).start()
    host = tree.ref("bh/pool/host@n0")
    started = time.perf_counter()
    ray.get([host.start_child.remote(None, ()) for _ in range(n)])
    per_child = (time.perf_counter() - started) * 1000 / n
    assert ray.get(host.count_children.remote())["active"] == n
    tree.stop()
    return per_child


def bench_actor_start(n: int) -> float:
    children = [ChildSpec(f"a{i}", ActorStart(Target)) for i in range(n)]
    started = time.perf_counter()
    tree = SupervisionTree("ba", LOOSE, [sup("gen", *children)]).start(timeout=900)
    per_child = (time.perf_counter() - started) * 1000 / n
    tree.stop()
    return per_child


def bench_hosted_restart(trials: int) -> tuple[list[float], list[float]]:
    import ray
    hosted = (ChildSpec("proc", SubprocessStart((sys.executable, "-S", "-c", SLEEPER),
                                                wait_ready=True)),
              ChildSpec("obj", InProcessStart(Target)))
    tree = SupervisionTree("bhr", LOOSE, [sup("pool", host_spec("n0", LOOSE, hosted,
                                                                node_id=local_node_id()))]).start()
    host = tree.ref("bhr/pool/host@n0")
    sub_ms, obj_ms = [], []
    for _ in range(trials):
        time.sleep(0.1)
        before = ray.get(host.process_groups.remote())[0]
        started = time.perf_counter()
        ray.get(host.signal_child.remote("proc", signal.SIGKILL))
        until(lambda b=before: (g := ray.get(host.process_groups.remote())) and g[0] != b)
        sub_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        try:
            ray.get(host.call.remote("obj", "crash"))
        except Exception:
            pass
        until(lambda: ray.get(host.call.remote("obj", "pid")) > 0)
        obj_ms.append((time.perf_counter() - started) * 1000)
    tree.stop()
    return sub_ms, obj_ms


def bench_actor_restart(trials: int) -> tuple[list[float], list[float]]:
    import ray
    sink = MemorySink()
    tree = SupervisionTree("bar", LOOSE, [sup("gen", ChildSpec("engine", ActorStart(Target)))],
                           sink=sink).start()
    ref = tree.ref("bar/gen/engine")
    restart_ms, detect_ms = [], []
    for _ in range(trials):
        time.sleep(1.0)
        pid = ray.get(ref.pid.remote())
        seen = len(sink.of(EventKind.EXIT))
        killed_at = time.time()
        started = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        until(lambda p=pid: ray.get(ref.pid.remote(), timeout=5) != p)
        restart_ms.append((time.perf_counter() - started) * 1000)
        exits = sink.of(EventKind.EXIT)
        assert len(exits) == seen + 1, "one exit event per kill"
        detect_ms.append((exits[-1].time - killed_at) * 1000)
    tree.stop()
    return restart_ms, detect_ms


def bench_ray_native_restart(trials: int) -> list[float]:
    import ray
    native = ray.remote(num_cpus=0, max_restarts=-1)(Target).remote()
    out = []
    for _ in range(trials):
        time.sleep(1.0)
        pid = ray.get(native.pid.remote())
        started = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        until(lambda p=pid: ray.get(native.pid.remote(), timeout=5) != p)
        out.append((time.perf_counter() - started) * 1000)
    ray.kill(native)
    return out


def bench_call_overhead(calls: int) -> tuple[float, float]:
    import ray
    tree = SupervisionTree("bco", LOOSE, [ChildSpec("engine", ActorStart(Target))]).start()
    ref = tree.ref("bco/engine")
    raw = ray.remote(num_cpus=0)(Target).remote()
    ray.get([raw.nop.remote(), ref.nop.remote()])
    supervised, plain = [], []
    block = 20
    for _ in range(calls // (2 * block)):  # interleave short blocks so drift hits both
        started = time.perf_counter()
        for _ in range(block):
            ray.get(ref.nop.remote())
        supervised.append((time.perf_counter() - started) / block)
        started = time.perf_counter()
        for _ in range(block):
            ray.get(raw.nop.remote())
        plain.append((time.perf_counter() - started) / block)
    tree.stop()
    ray.kill(raw)
    return statistics.median(supervised) * 1e6, statistics.median(plain) * 1e6


def _thread_cpu(proc: psutil.Process, native_id: int | None) -> float:
    for thread in proc.threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    return 0.0


def bench_idle_cpu(seconds: float) -> dict[str, float]:
    """CPU while nothing fails: the supervisors' own thread, the whole driver process (Ray's
    threads included) against the same driver before the tree started, and one host."""
    import ray
    me = psutil.Process()

    def sample() -> tuple[float, float]:
        return sum(me.cpu_times()[:2]), time.perf_counter()

    c0, t0 = sample()
    time.sleep(seconds / 2)
    c1, t1 = sample()
    baseline = (c1 - c0) / (t1 - t0) * 100
    engines = [ChildSpec(f"e{i}", ActorStart(Target), deadlines={"decode_step": 5.0})
               for i in range(2)]
    hosted = tuple(ChildSpec(f"w{i}", InProcessStart(Target)) for i in range(10))
    tree = SupervisionTree("bidle", LOOSE, [
        sup("gen", *engines),
        sup("pool", host_spec("n0", LOOSE, hosted, node_id=local_node_id()))]).start()
    host_proc = psutil.Process(ray.get(tree.ref("bidle/pool/host@n0").ping.remote()))
    tid = tree.thread_native_id
    time.sleep(2)
    (c0, t0), h0, s0 = sample(), sum(host_proc.cpu_times()[:2]), _thread_cpu(me, tid)
    time.sleep(seconds)
    (c1, t1), h1, s1 = sample(), sum(host_proc.cpu_times()[:2]), _thread_cpu(me, tid)
    tree.stop()
    wall = t1 - t0
    return {"tree_thread": (s1 - s0) / wall * 100, "driver": (c1 - c0) / wall * 100,
            "driver_before_tree": baseline, "host": (h1 - h0) / wall * 100}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosted", type=int, default=1000)
    parser.add_argument("--actors", type=int, default=50)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--calls", type=int, default=8000)
    parser.add_argument("--idle-seconds", type=float, default=20)
    args = parser.parse_args()
    import logging
    logging.getLogger("erlay.supervisor").setLevel(logging.ERROR)
    ensure_ray(num_cpus=2, include_dashboard=False)

    hosted_start = bench_hosted_start(args.hosted)
    actor_start = bench_actor_start(args.actors)
    sub_ms, obj_ms = bench_hosted_restart(args.trials * 2)
    actor_ms, detect_ms = bench_actor_restart(args.trials)
    native_ms = bench_ray_native_restart(args.trials)
    sup_us, raw_us = bench_call_overhead(args.calls)
    idle = bench_idle_cpu(args.idle_seconds)

    result = {
        "hosted_start_ms_per_child": round(hosted_start, 3),
        "actor_start_ms_per_child": round(actor_start, 1),
        "start_ratio": round(actor_start / hosted_start, 1),
        "hosted_restart_ms_p50": round(statistics.median(sub_ms), 1),
        "hosted_restart_ms_p99": round(pct(sub_ms, 0.99), 1),
        "hosted_inprocess_restart_ms_p50": round(statistics.median(obj_ms), 2),
        "actor_restart_ms_p50": round(statistics.median(actor_ms), 1),
        "actor_restart_ms_p99": round(pct(actor_ms, 0.99), 1),
        "ray_native_restart_ms_p50": round(statistics.median(native_ms), 1),
        "death_detect_ms_p50": round(statistics.median(detect_ms), 1),
        "call_overhead_ratio": round(sup_us / raw_us, 3),
        "idle_cpu_percent": round(idle["tree_thread"], 2),
        "idle_cpu_percent_driver": round(idle["driver"], 2),
        "idle_cpu_percent_driver_before_tree": round(idle["driver_before_tree"], 2),
        "idle_cpu_percent_host": round(idle["host"], 2),
    }
    targets = {"start_ratio": ">= 100", "hosted_restart_ms_p50": "<= 50",
               "actor_restart_ms_p50": f"< ray_native ({result['ray_native_restart_ms_p50']})",
               "death_detect_ms_p50": "<= 100", "call_overhead_ratio": "<= 1.1",
               "idle_cpu_percent": "< 1"}
    print(f"{'figure':34s} {'measured':>12s}  target")
    for key, value in result.items():
        print(f"{key:34s} {value:>12}  {targets.get(key, '')}")
    print(f"(supervised call {sup_us:.0f} us vs raw {raw_us:.0f} us; hosted restarts are SIGKILL "
          f"of a subprocess child; in-process is a crashing call)")
    print(json.dumps(result))
    import ray
    ray.shutdown()


if __name__ == "__main__":
    main()
