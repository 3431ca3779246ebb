"""``erlay chaos selftest``: every chaos invariant proves it can fail.

A clean run directory is written by erlay's real writers (the journal, the learner ledger,
the checkpoint writer, the metrics and events files), watched by a real
:class:`~erlay.chaos.processes.ProcessWatch`, and gathered by the same code the chaos runner
uses (:func:`erlay.chaos.gather.observe_run`).  Every invariant runs twice:

- on the clean run, where it must pass (a failure there is a *false alarm*; N/A only where
  the invariant does not apply, which the clean run is built to avoid: it has a fault-free
  baseline, ``max_staleness`` 0 and one fault);
- on a copy with one violation planted for it (a lost rollout, a rollout trained twice, a
  stale sample trained, a step out of order, a tool call executed twice, a judgement changed
  on replay, a torn checkpoint that looks complete, a real orphan process, ...), where it
  must FAIL (*caught*).

Prints a table, then one JSON line ``{"invariants": N, "planted": N, "caught": N,
"false_alarms": 0}``; exits 0 only when every invariant has a plant, every plant is caught,
and nothing raised a false alarm.  Takes seconds, starts no Ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from erlay.actors.config import JobConfig, load_config
from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import MemoryTransitions, Transition, TransitionKind
from erlay.actors.learner.checkpoint_format import step_dir_name, write_checkpoint_dir
from erlay.actors.learner.ledger import LearnerLedger, read_ledger
from erlay.actors.observe.goodput import StepCounts
from erlay.actors.rundir import RunDir
from erlay.chaos.faults import FaultRecord
from erlay.chaos.gather import checkpoint_problems, observe_run
from erlay.chaos.invariants import INVARIANTS, check_all
from erlay.chaos.observation import RunObservation
from erlay.chaos.processes import ProcessWatch
from erlay.supervisor.events import EventKind, JsonlSink, SupervisorEvent, read_events

STEPS, ROLLOUTS = 4, 4
ENGINE = "erlay/generation/engine-0"
K = TransitionKind


@dataclasses.dataclass
class Built:
    """The clean run: its config, run dir, teed journal stream and observation inputs."""

    cfg: JobConfig
    run_dir: RunDir
    memory: MemoryTransitions
    fault: FaultRecord
    orphans: list[dict[str, Any]]


def _rid(step: int, k: int) -> str:
    return f"r{step:05d}-g000-{k}"


class _Sample:
    judged_ok, user_error, judge_kind, poison = True, None, "", 0


def build_clean(root: Path) -> Built:
    """Write a clean four-step run under ``root`` with erlay's own writers."""
    cfg = load_config(None, ["rollout.max_staleness=0", f"run.storage={root}"])
    run_dir = RunDir.create(root, "selftest")
    memory = MemoryTransitions()
    ledger = LearnerLedger(run_dir.ledger)
    events = JsonlSink(run_dir.events)
    t0 = time.time()
    fault = FaultRecord(0, "sigkill", ENGINE, "generation", t0 + 1.0, "restart", "planted")
    events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.EXIT,
                                "killed: SIGKILL", 0, t0 + 1.2))
    events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.RESTART,
                                "restarted", 1, t0 + 1.3))
    events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.START,
                                "started", 1, t0 + 1.5))
    events.close()
    ledger.started(0, False)
    with Journal.open(run_dir.journal) as journal:
        def record(t: Transition) -> None:
            journal.record(t)
            memory.record(t)
        for step in range(STEPS):
            counts = StepCounts()
            ids = [_rid(step, k) for k in range(ROLLOUTS)]
            for k, rid in enumerate(ids):
                record(Transition(K.DISPATCHED, rid, {"step": step, "version": step}))
                record(Transition(K.CHUNK, rid, {"turn": 0, "start": 0, "token_ids": [1, 2],
                                                  "logprobs": [-0.1, -0.2], "version": step}))
                record(Transition(K.TOOL_CALL, rid, {"key": f"{rid}/tool0", "code": "1+1"}))
                record(Transition(K.TOOL_RESULT, rid, {"key": f"{rid}/tool0",
                                                       "result": {"stdout": "2"}}))
                record(Transition(K.JUDGED, rid, {"key": f"{rid}/judge",
                                                  "judgement": {"reward": float(k % 2)}}))
                record(Transition(K.COMPLETED, rid, {"reward": float(k % 2)}))
                counts.add(_Sample(), True, 2)
            ledger.trained(step, step, ids, [[step, step]] * len(ids), [[True, True]] * len(ids))
            for rid in ids:
                record(Transition(K.CONSUMED, rid, {"step": step, "version": step + 1}))
            run_dir.append_metrics({"phase": "rl", "step": step, "time": 2.0 + step,
                                    "reward_mean": 0.5, "tokens_digest": f"digest-{step}",
                                    "staleness_max": 0, **counts.to_dict(),
                                    "gen_window": [t0 + step, t0 + step + 0.5],
                                    "train_window": [t0 + step + 0.5, t0 + step + 1.0]})
            if step % 2 == 1:   # the learner's checkpoint after steps 1 and 3
                run_dir.checkpoints.mkdir(exist_ok=True)
                write_checkpoint_dir(run_dir.checkpoints / step_dir_name(step + 1), step + 1,
                                     {"w": torch.full((64,), float(step))}, {})
    return Built(cfg, run_dir, memory, fault, [])


def observe(b: Built, **changes: Any) -> RunObservation:
    """The observation of ``b`` as the runner gathers it, with ``changes`` applied."""
    obs = observe_run(b.cfg, b.run_dir, b.memory, [b.fault], 10.0, "finished", None,
                      b.orphans, started_at=None)
    return dataclasses.replace(obs, **changes)


def _copy(b: Built, root: Path, name: str) -> Built:
    target = root / name
    shutil.copytree(b.run_dir.path, target)
    memory = MemoryTransitions()
    for t in b.memory.items:
        memory.record(t)
    return dataclasses.replace(b, run_dir=RunDir(target), memory=memory)


def _without(memory: MemoryTransitions, keep: Callable[[Transition], bool]) -> None:
    memory.items[:] = [t for t in memory.items if keep(t)]


def _rewrite_ledger(b: Built, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
                    ) -> None:
    records = edit(read_ledger(b.run_dir.ledger))
    b.run_dir.ledger.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rewrite_metrics(b: Built, edit: Callable[[dict[str, Any]], None]) -> None:
    records = b.run_dir.read_metrics()
    for rec in records:
        edit(rec)
    b.run_dir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))


def _orphan(b: Built) -> list[dict[str, Any]]:
    """Start a real process that escapes into its own session and outlives its parent, as a
    leaked sandbox would, and let a ProcessWatch find it; it is killed afterwards."""
    watch = ProcessWatch(sample_s=0.05).start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    time.sleep(0.3)
    found = watch.orphans(grace_s=0.5)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    return found


def _plants(b: Built, root: Path) -> dict[str, RunObservation]:
    """One planted violation per invariant: the observation of a copy of the clean run."""
    p: dict[str, RunObservation] = {}
    lost = _copy(b, root, "lost")
    _without(lost.memory, lambda t: not (t.kind is K.CONSUMED and t.rollout_id == _rid(1, 2)))
    p["no_rollout_lost"] = observe(lost)
    dup = _copy(b, root, "dup")
    dup.memory.record(Transition(K.CONSUMED, _rid(1, 0), {"step": 2, "version": 3}))
    p["no_duplicate_consumption"] = observe(dup)
    twice = _copy(b, root, "twice")   # step 2 trained again with no restore between
    _rewrite_ledger(twice, lambda rs: [*rs, next(r for r in rs if r.get("step") == 2
                                                 and "event" not in r)])
    p["exactly_once"] = observe(twice)
    stale = _copy(b, root, "stale")

    def older(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in rs:
            if r.get("step") == 3 and "trained" in r:
                for row in r["trained"]:
                    if row[0] == _rid(3, 0):
                        row[1] = r["version"] - 1   # trained one version late
        return rs
    _rewrite_ledger(stale, older)
    p["staleness_within_bound"] = observe(stale)
    order = _copy(b, root, "order")
    _rewrite_ledger(order, lambda rs: [rs[0], rs[1], rs[3], rs[2], *rs[4:]])
    p["steps_in_order"] = observe(order)
    tool = _copy(b, root, "tool")     # a replay that ran the call despite its journaled result
    tool.memory.record(Transition(K.TOOL_CALL, _rid(0, 1), {"key": f"{_rid(0, 1)}/tool0",
                                                            "code": "1+1"}))
    tool.memory.record(Transition(K.TOOL_RESULT, _rid(0, 1), {"key": f"{_rid(0, 1)}/tool0",
                                                              "result": {"stdout": "2"}}))
    p["tool_calls_once"] = observe(tool)
    judge = _copy(b, root, "judge")
    judge.memory.record(Transition(K.JUDGED, _rid(2, 1), {"key": f"{_rid(2, 1)}/judge",
                                                          "judgement": {"reward": 0.0}}))
    p["judgements_stable"] = observe(judge)
    torn = _copy(b, root, "torn")     # same size, manifest intact: it looks complete
    state = torn.run_dir.checkpoints / step_dir_name(4) / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    p["checkpoints_intact"] = observe(torn)
    digest = _copy(b, root, "digest")
    _rewrite_metrics(digest, lambda r: r.update(tokens_digest="other")
                     if r.get("step") == 2 else None)
    p["replay_identical"] = observe(digest)
    unseen = _copy(b, root, "unseen")
    kept = [e for e in read_events(unseen.run_dir.events) if e.context is not EventKind.EXIT]
    unseen.run_dir.events.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in kept))
    p["faults_detected"] = observe(unseen)
    loop = _copy(b, root, "loop")
    sink = JsonlSink(loop.run_dir.events)
    for i in range(b.cfg.supervision.generation.intensity + 1):
        sink.emit(SupervisorEvent("erlay/generation", "engine-1", EventKind.RESTART,
                                  "restarted", i, b.fault.at + 2.0 + 0.1 * i))
    sink.close()
    p["restart_intensity_respected"] = observe(loop)
    p["no_orphans"] = observe(b, orphans=_orphan(b))
    worse = _copy(b, root, "worse")
    _rewrite_metrics(worse, lambda r: r.update(reward_mean=0.0) if "reward_mean" in r else None)
    p["reward_within_tolerance"] = observe(worse)
    p["expected_end"] = observe(b, status="failed")
    p["faults_injected"] = observe(b, not_injected=["faults.1 (sigkill erlay/learner/"
                                                    "learner-0): never fired"])
    unjudged = _copy(b, root, "unjudged")

    def unjudge(r: dict[str, Any]) -> None:
        if r.get("phase") == "rl":
            r.update(judge_failed=2, trained_samples=r["trained_samples"] - 2)
    _rewrite_metrics(unjudged, unjudge)
    p["samples_judged"] = observe(unjudged)
    return p


def run_selftest(keep: Path | None = None, out: Any = print) -> dict[str, int]:
    """Run the selftest, print its table and JSON line through ``out``; return the JSON."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="erlay-selftest-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        clean = build_clean(root)
        assert all(problem is None for _, problem in checkpoint_problems(
            clean.run_dir.checkpoints))
        baseline = observe(clean)
        clean_verdicts = {v.name: v for v in check_all(observe(clean), fault_free=baseline)}
        plants = _plants(clean, root)
        rows, caught, false_alarms = [], 0, 0
        for name in INVARIANTS:
            ok = clean_verdicts[name]
            false_alarms += ok.ok is not True
            planted = plants.get(name)
            verdict = None if planted is None else next(
                v for v in check_all(planted, fault_free=baseline) if v.name == name)
            hit = verdict is not None and verdict.ok is False
            caught += hit
            rows.append((name, ok.status, "-" if verdict is None else verdict.status,
                         "yes" if hit else "NO", (verdict.detail if verdict else
                                                  "no violation planted")[:90]))
        out(f"{'invariant':30s} {'clean':6s} {'planted':8s} {'caught':7s} detail")
        for name, clean_status, planted_status, hit, detail in rows:
            out(f"{name:30s} {clean_status:6s} {planted_status:8s} {hit:7s} {detail}")
        for name, v in clean_verdicts.items():
            if v.ok is not True:
                out(f"false alarm: {name}: {v.status}: {v.detail}")
        result = {"invariants": len(INVARIANTS), "planted": len(plants), "caught": caught,
                  "false_alarms": false_alarms}
        out(json.dumps(result))
        return result
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def passed(result: dict[str, int]) -> bool:
    """Whether the selftest proves every invariant: all planted, all caught, no alarm."""
    return (result["caught"] == result["planted"] == result["invariants"]
            and result["false_alarms"] == 0)
