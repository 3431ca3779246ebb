"""External fault injectors: what the chaos runner does to a running job.

Each injector acts on one running :class:`~erlay.actors.job.driver.Job` through its supervision tree
and returns the :class:`~erlay.chaos.faults.FaultRecord` of what it did, stamped with the time it
acted. Targets are tree paths or glob patterns over them (``erlay/generation/engine-*``); a
pattern picks one matching child, round robin, so repeated faults spread over the domain.

Every injector targets only this machine: signals go to pids the tree reports for this node,
``ray.kill`` to this job's actors, sandbox attacks run inside the job's own sandbox.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import os
import signal
import threading
import time
from typing import Any

import ray

from erlay.actors.job.driver import Job
from erlay.chaos.faults import FaultRecord, domain_of
from erlay.supervisor import failpoints

log = logging.getLogger("erlay.chaos")

SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigterm": signal.SIGTERM}

# Where a failpoint lives when the scenario does not say: the processes that run that code.
FAILPOINT_HOMES = {
    "generation.decode_step": "erlay/generation/engine-*",
    "generation.weight_update": "erlay/generation/engine-*",
    "sandbox.exec": "erlay/sandbox/host@*",
    "sandbox.user_code": "erlay/sandbox/host@*",
    "generation.long_tail": "erlay/generation/engine-*",
    # The judge's and the environment's code runs in worker processes of their hosts: a
    # host armed arms its workers (erlay.supervisor.host.NodeHost.erlay_failpoints_changed).
    "judge.score": "erlay/judge/host@*",
    "judge.verdict": "erlay/judge/host@*",
    "judge.user_code": "erlay/judge/host@*",
    "judge.llm_generate": "erlay/judge/host@*",
    "environment.call": "erlay/environment/host@*",
    "learner.train_step": "erlay/learner/learner-*",
    "learner.checkpoint": "erlay/learner/learner-0",
    "learner.checkpoint_before_swap": "erlay/learner/learner-0",
    "learner.checkpoint_mid_swap": "erlay/learner/learner-0",
    "learner.checkpoint_after_swap": "erlay/learner/learner-0",
    "learner.checkpoint_before_cleanup": "erlay/learner/learner-0",
    "rollout.dispatch": "driver",
    "rollout.after_train": "driver",
    "host.spawn": "erlay/sandbox/host@*",
}


def tree_paths(job: Job) -> list[str]:
    """Every child path of the job's tree that runs in a process of its own: actor children,
    hosts, and the subprocess children of hosts (in-process hosted children share their
    host's process and are reached through it)."""
    assert job.tree is not None
    snapshot = job.tree.snapshot()
    out: list[str] = []

    def walk(rows: list[dict[str, Any]], prefix: str) -> None:
        for row in rows:
            path = f"{prefix}/{row['id']}"
            if row.get("strategy") and not (row.get("info") or {}).get("pid"):
                walk(row.get("children") or [], path)  # a supervisor: look inside
                continue
            out.append(path)
            for child in row.get("children") or []:  # a host's subprocess children
                if (child.get("info") or {}).get("kind") == "subprocess":
                    out.append(f"{path}/{child['id']}")
    walk(snapshot["children"], snapshot["path"])
    return out


def _process_infos(job: Job) -> dict[str, dict[str, Any]]:
    """Path -> ``info`` (pid, node id) of every child of the job's tree that has a process."""
    assert job.tree is not None
    snapshot = job.tree.snapshot()
    out: dict[str, dict[str, Any]] = {}

    def walk(rows: list[dict[str, Any]], prefix: str) -> None:
        for row in rows:
            path = f"{prefix}/{row['id']}"
            if (row.get("info") or {}).get("pid"):
                out[path] = row["info"]
            walk(row.get("children") or [], path)
    walk(snapshot["children"], snapshot["path"])
    return out


class Injector:
    """Injects the faults of one chaos run into ``job``; keeps the records in order."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.records: list[FaultRecord] = []
        self._ids = itertools.count()
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._timers: list[threading.Timer] = []
        self.attack_results: list[dict[str, Any]] = []

    # ------------------------------------------------------------------- targets
    def resolve(self, pattern: str) -> str:
        """One running child path matching ``pattern`` (round robin over the matches)."""
        matches = sorted(p for p in tree_paths(self.job) if fnmatch.fnmatchcase(p, pattern))
        if not matches:
            raise LookupError(f"no running child matches {pattern!r}")
        turn = next(self._round_robin.setdefault(pattern, itertools.count()))
        return matches[turn % len(matches)]

    def _pid(self, path: str) -> int:
        assert self.job.tree is not None
        hosted = _hosted(path)
        if hosted is not None:  # a subprocess child of a host: the host knows its pid
            host, child = hosted
            rows = ray.get(self.job.tree.ref(host).actor.which_children.remote(), timeout=30)
            row = next((r for r in rows if r["id"] == child), None)
            if row is None or not (row.get("info") or {}).get("pid"):
                raise LookupError(f"{path} is not a running subprocess child of {host}")
            return int(row["info"]["pid"])
        info = self.job.tree.ref(path).process.info
        if not info.get("pid"):
            raise LookupError(f"{path} reports no pid")
        node = info.get("node_id")   # None: the child did not say; take it as this node
        if node is not None and node != ray.get_runtime_context().get_node_id():
            raise LookupError(f"{path} runs on another node; signals stay on this machine")
        return int(info["pid"])

    def _checkpoint_writer(self, path: str, timeout_s: float = 60.0) -> tuple[int, int]:
        """``(pid, step)`` of learner rank ``path``'s checkpoint writer, polled until it holds
        a save (LookupError after ``timeout_s``)."""
        assert self.job.tree is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            actor = self.job.tree.ref(path).actor
            writer = ray.get(actor.checkpoint_writer.remote(), timeout=30)
            if writer is not None:
                return int(writer["pid"]), int(writer["step"])
            time.sleep(0.05)
        raise LookupError(f"{path} held no checkpoint save within {timeout_s:g} s")

    def _record(self, kind: str, target: str, expect: str, detail: str = "") -> FaultRecord:
        record = FaultRecord(id=next(self._ids), kind=kind, target=target,
                             domain=domain_of(target), at=time.time(), expect=expect,
                             detail=detail)
        self.records.append(record)
        log.warning("chaos: injected %s into %s (%s)", kind, target, detail or expect)
        return record

    # ----------------------------------------------------------------- injectors
    def wait_for_phase(self, path: str, phase: str, timeout_s: float = 3.0) -> bool:
        """Wait until ``path``, or a child it hosts, holds work in ``phase``, so a fault lands
        mid-work; False if that did not happen within ``timeout_s``.

        An actor child is asked itself (its ``_erlay_progress``, what its supervisor's
        heartbeat reads), every 10 ms: the tree's snapshot shows the phase its supervisor
        last heard, up to a heartbeat old, and a decode step shorter than that is missed
        there.  A host, or a child it hosts, is read from the snapshot."""
        assert self.job.tree is not None
        deadline = time.monotonic() + timeout_s
        below_host = _hosted(path) is not None or path.rsplit("/", 1)[-1].startswith("host@")
        actor = None if below_host else self._actor(path)
        while time.monotonic() < deadline:
            try:
                if actor is not None:
                    live = ray.get(actor._erlay_progress.remote(), timeout=1.0)
                    if live and live.get("phase") == phase:
                        return True
                elif _holds_phase(self.job.tree.snapshot(timeout=5), path, phase):
                    return True
            except Exception:  # noqa: BLE001 - restarting: keep waiting
                pass
            time.sleep(0.01)
        return False

    def _actor(self, path: str) -> Any:
        """The Ray actor of the actor child at ``path``, or None (a host's subtree, a child
        between incarnations, an in-process child)."""
        assert self.job.tree is not None
        try:
            actor = self.job.tree.ref(path).actor
        except Exception:  # noqa: BLE001 - not an actor child now: the snapshot decides
            return None
        return actor if hasattr(actor, "_erlay_progress") else None

    def signal(self, kind: str, pattern: str, *, stop_s: float | None = None,
               expect: str = "restart", during: str | None = None,
               process: str = "child", wait_s: float = 3.0) -> FaultRecord:
        """SIGKILL, SIGTERM or SIGSTOP (then SIGCONT after ``stop_s``; never, if None: a
        hang for the child's progress deadline to find) of one child's process; with
        ``during``, once the child holds work in that phase (waiting up to ``wait_s``).
        ``process="checkpoint_writer"``
        signals a learner rank's checkpoint writer instead, once it holds a save."""
        path = self.resolve(pattern)
        missed = ""
        if during is not None and not self.wait_for_phase(path, during, wait_s):
            log.warning("chaos: %s never entered %s; signalling it anyway", path, during)
            missed = f", outside {during} (not seen in it within the wait)"
        pid = self._pid(path)
        if process == "checkpoint_writer":
            pid, step = self._checkpoint_writer(path)
            missed += f" (its checkpoint writer, mid-save of step {step})"
        os.kill(pid, SIGNALS[kind])
        if kind == "sigstop" and stop_s is not None:
            timer = threading.Timer(stop_s, _sigcont, args=(pid,))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
        return self._record(kind, path, expect, f"pid {pid}" + (
            f", SIGCONT after {stop_s:g} s" if kind == "sigstop" and stop_s is not None
            else "") + missed)

    def ray_kill(self, pattern: str, expect: str = "restart") -> FaultRecord:
        """``ray.kill`` of an actor child or a host (Ray's own way to lose an actor)."""
        path = self.resolve(pattern)
        assert self.job.tree is not None
        ray.kill(self.job.tree.ref(path).actor, no_restart=True)
        return self._record("ray_kill", path, expect)

    def failpoint(self, name: str, spec: dict[str, Any], where: str | None = None,
                  expect: str = "restart") -> FaultRecord:
        """Arm failpoint ``name`` in the process(es) at ``where`` (a pattern; every match is
        armed), or in this driver process for ``driver``."""
        where = where or FAILPOINT_HOMES.get(name, "driver")
        detail = f"{name} {spec}"
        if where == "driver":
            failpoints.arm_spec(name, failpoints.FailpointSpec.from_dict(spec))
            return self._record("failpoint", "erlay/rollout/coordinator"
                                if name.startswith("rollout.") else "driver", expect, detail)
        assert self.job.tree is not None
        # Actors only: a worker process of a host is armed through its host.
        targets = sorted(p for p in tree_paths(self.job)
                         if fnmatch.fnmatchcase(p, where) and _hosted(p) is None)
        if not targets:
            raise LookupError(f"no running child matches {where!r}")
        for path in targets:
            ray.get(self.job.tree.ref(path).actor._erlay_failpoints.remote("arm", name, spec),
                    timeout=30)
        target = targets[0] if len(targets) == 1 else where
        return self._record("failpoint", target, expect, detail)

    def delay(self, pattern: str, site: str, delay_s: float, count: int | None = None,
              probability: float | None = None) -> FaultRecord:
        """Slow calls: a ``delay`` at failpoint ``site`` in every process matching
        ``pattern``."""
        spec: dict[str, Any] = {"action": "delay", "delay_s": delay_s}
        if count is not None:
            spec["count"] = count
        if probability is not None:
            spec["probability"] = probability
        record = self.failpoint(site, spec, pattern, expect="absorbed")
        self.records[-1] = record = _replace(record, kind="delay")
        return record

    def user_error(self, plugin: str, mode: str, probability: float = 1.0,
                   count: int | None = None, seed: int | None = None,
                   freeze_s: float = 300.0) -> FaultRecord:
        """The user's own code fails: the environment's calls or the judge's ``score``, in
        the worker processes of every environment or judge host, raise, hang, return
        garbage or freeze their process (hold the GIL for ``freeze_s``), on a share
        ``probability`` of calls.  A ``count`` counts per worker process, and a process
        started later is armed only when there is none (see ``NodeHost``)."""
        action = {"raise": "raise", "hang": "hang", "bad_return": "corrupt",
                  "freeze": "freeze"}[mode]
        spec: dict[str, Any] = {"action": action}
        if mode == "freeze":
            spec["delay_s"] = freeze_s
        if probability < 1:
            spec.update(probability=probability, seed=seed if seed is not None else 0)
        if count is not None:
            spec["count"] = count
        name = "environment.call" if plugin == "environment" else "judge.user_code"
        record = self.failpoint(name, spec, FAILPOINT_HOMES[name], expect="absorbed")
        self.records[-1] = record = _replace(record, kind="user_error",
                                             detail=f"{plugin} {mode} {spec}")
        return record

    def partial(self, pattern: str, fraction: float, seed: int = 0) -> FaultRecord:
        """A judge or sandbox that fails ``fraction`` of its calls at random: the judge's
        code raises, or the sandbox fails the run (``sandbox.exec`` corrupt: an
        infrastructure failure of that run)."""
        spec = {"probability": fraction, "seed": seed}
        if pattern.startswith("erlay/judge/"):
            record = self.failpoint("judge.user_code", {"action": "raise", **spec}, pattern,
                                    expect="absorbed")
        else:
            record = self.failpoint("sandbox.exec", {"action": "corrupt", **spec}, pattern,
                                    expect="absorbed")
        self.records[-1] = record = _replace(record, kind="partial")
        return record

    def sandbox_attack(self, attack: str, code: str) -> FaultRecord:
        """Run hostile code as a tool call through the job's own sandbox client: the worker
        must turn it into a typed result and survive."""
        record = self._record("sandbox_attack", "erlay/sandbox/host@node-0", "absorbed", attack)
        try:
            future = self.job.tool_call(f"chaos-{record.id}/{attack}", code)
        except LookupError:   # no coordinator running: nothing was injected
            self.records.pop()
            raise

        def outcome(done: Any) -> None:
            try:
                result = done.result()
                log.warning("chaos: %s -> %s", attack, result.get("outcome"))
                self.attack_results.append({"attack": attack, **result})
            except Exception as exc:  # noqa: BLE001 - recorded: the invariant reads it
                self.attack_results.append({"attack": attack, "error": repr(exc)})
        future.add_done_callback(outcome)
        return record

    def node_loss(self, cluster: Any) -> FaultRecord:
        """Remove a worker node (never the head, which the driver is attached to) of a local
        multi-node ``ray.cluster_utils.Cluster``, as if the machine died."""
        head = cluster.head_node
        workers = [n for n in cluster.worker_nodes if n is not head]
        if not workers:
            raise LookupError("the cluster has no worker node left to lose")
        node = workers[0]
        infos = _process_infos(self.job)
        hosts = [p for p, info in infos.items()
                 if "host@" in p.rsplit("/", 1)[-1] and info.get("node_id") == node.node_id]
        log.debug("chaos: node %s holds %s; children by node: %s", node.node_id[:12], hosts,
                 {p: str(i.get("node_id"))[:12] for p, i in infos.items()})
        cluster.remove_node(node, allow_graceful=False)
        # Attributed to the sandbox domain's host on that node when there is one: it is the
        # child whose restart elsewhere shows the loss was handled.
        target = next((p for p in hosts if p.startswith("erlay/sandbox/")),
                      hosts[0] if hosts else "erlay/sandbox/host@*")
        return self._record("node_loss", target, "restart", f"node {node.node_id[:12]}, "
                            f"hosts {', '.join(hosts) or 'none'}")

    def close(self) -> None:
        """Cancel pending SIGCONTs' timers (sending them now) and disarm local failpoints."""
        for timer in self._timers:
            if timer.is_alive():
                timer.cancel()
                args = timer.args or ()
                if args:
                    _sigcont(int(args[0]))
        failpoints.disarm_all()


def _holds_phase(snapshot: dict[str, Any], path: str, phase: str) -> bool:
    def find(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
        for row in rows:
            here = f"{prefix}/{row['id']}"
            if here == path:
                return row
            if path.startswith(here + "/"):
                return find(row.get("children") or [], here)
        return None

    def busy(row: dict[str, Any]) -> bool:
        return row.get("phase") == phase or any(busy(c) for c in row.get("children") or [])

    row = find(snapshot["children"], snapshot["path"])
    return row is not None and busy(row)


def _hosted(path: str) -> tuple[str, str] | None:
    """``(host path, child id)`` for a path below a host (``.../host@node-0/proc-1``)."""
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("host@"):
            return "/".join(parts[:i + 1]), parts[-1]
    return None


def _replace(record: FaultRecord, **changes: Any) -> FaultRecord:
    import dataclasses
    return dataclasses.replace(record, **changes)


def _sigcont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
