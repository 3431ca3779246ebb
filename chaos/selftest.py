"""``erlay chaos selftest``: every chaos invariant proves it can fail.

A small run is written by erlay's real writers (the journal with its snapshots and
retention, the learner ledger, the checkpoint writer, the metrics, events and summary
files) while a real :class:`~erlay.chaos.processes.ProcessWatch` watches, and a real child
process stands for an engine that the run's one fault SIGKILLs.  It is gathered by the code
``erlay chaos run`` and ``erlay verify`` use (:func:`erlay.chaos.evidence.observe_dir`) and
judged against a *separate* fault-free run written the same way.  On it every invariant
must PASS (anything else is a *false alarm*).

Then each plant (:data:`PLANTS`, at least one per invariant) writes the run again with one
bug, made the way the bug would make it: the writer skips, repeats or reorders what it
records (a consumption never journaled, a duplicate inside one batch, a ledger missing a
step, a tool call run again after its result, a judgement changed on replay), the fault
misses, a child escapes into its own session; or the files are damaged afterwards as a
disk or an operator would (a deleted journal or events file, a truncated ledger, a torn
checkpoint that looks committed).  Its invariant must FAIL (*caught*).

Prints a table, then one JSON line ``{"invariants", "covered", "planted", "caught",
"false_alarms"}``; exits 0 only when every invariant has a plant, every plant is caught,
there are at least :data:`MIN_PLANTS`, and nothing raised a false alarm.  Takes seconds,
starts no Ray.  ``tests/chaos/test_verify.py`` runs ``erlay verify`` on the same plants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from erlay.actors.config import load_config
from erlay.actors.journal.rollout_id import RolloutId
from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import Transition, TransitionKind
from erlay.actors.learner.checkpoint.format import step_dir_name, write_checkpoint_dir
from erlay.actors.learner.ledger import LearnerLedger
from erlay.actors.observe.goodput import StepCounts
from erlay.actors.observe.summary import write_summary
from erlay.actors.rundir import RunDir
from erlay.chaos.evidence import observe_dir
from erlay.chaos.faults import FaultRecord
from erlay.chaos.invariants import INVARIANTS, check_all
from erlay.chaos.observation import RunObservation
from erlay.chaos.processes import ProcessWatch
from erlay.supervisor.events import EventKind, JsonlSink, SupervisorEvent

STEPS, ROLLOUTS, CHECKPOINT_EVERY = 5, 4, 2
MIN_PLANTS = 20
ENGINE = "erlay/generation/engine-0"
K = TransitionKind

# name -> (the invariant it must fail, the bug).
PLANTS: dict[str, tuple[str, str]] = {
    "consume_skipped": ("no_rollout_lost", "the coordinator never journals one consumption"),
    "journal_deleted": ("no_rollout_lost", "the journal directory is deleted"),
    "consumed_by_two_steps": ("no_duplicate_consumption",
                              "a rollout of step 1 is consumed again by step 2"),
    "duplicate_in_batch": ("exactly_once", "one rollout is fed twice inside one batch"),
    "ledger_step_missing": ("exactly_once", "the learner never records step 2 in its ledger"),
    "ledger_truncated": ("exactly_once", "ledger.jsonl is cut in half"),
    "kept_not_journaled": ("exactly_once", "the last step is checkpointed, then the job dies "
                           "before the journal records its consumption"),
    "stale_trained": ("staleness_within_bound", "a sample one version too old is trained"),
    "steps_swapped": ("steps_in_order", "the learner trains step 3 before step 2"),
    "tool_again": ("tool_calls_once", "a replay runs a tool call after its result"),
    "tool_again_compacted": ("tool_calls_once", "a replay runs a step-0 tool call again "
                             "(its segment compacted away since)"),
    "tool_result_differs": ("tool_calls_once", "one call key gets two different results"),
    "judgement_changed": ("judgements_stable", "a replay judges a sample again, differently"),
    "checkpoint_torn": ("checkpoints_intact", "a byte of a committed checkpoint flips"),
    "checkpoints_deleted": ("checkpoints_intact", "the checkpoints directory is deleted"),
    "replay_diverged": ("replay_identical", "a resumed rollout continues with other tokens"),
    "exit_unseen": ("faults_detected", "no supervisor reports the engine's exit"),
    "restart_loop": ("restart_intensity_respected",
                     "a supervisor restarts past its intensity instead of escalating"),
    "events_deleted": ("restart_intensity_respected", "events.jsonl is deleted"),
    "orphan_escaped": ("no_orphans", "a child double-forks into its own session and stays"),
    "reward_collapsed": ("reward_within_tolerance", "every reward is 0"),
    "run_failed": ("expected_end", "the run ends failed"),
    "fault_missed": ("faults_injected", "the engine had exited before the SIGKILL"),
    "judge_failing": ("samples_judged", "the judge fails half of every step's samples"),
}


@dataclasses.dataclass
class Written:
    """A run the selftest wrote, with what only a runner knows about it."""

    run_dir: RunDir
    faults: list[FaultRecord]
    not_injected: list[str]
    orphans: list[dict[str, Any]]

    def observe(self) -> RunObservation:
        """Its observation, gathered as ``erlay chaos run`` gathers one."""
        obs = observe_dir(self.run_dir.path)
        return dataclasses.replace(obs, faults=self.faults, not_injected=self.not_injected,
                                   orphans=self.orphans, wall_s=10.0)


def _rid(step: int, k: int) -> str:
    return RolloutId(step, k // 16, k % 16).format()   # groups of 16


class _Sample:
    def __init__(self, judged_ok: bool = True) -> None:
        self.judged_ok, self.user_error, self.judge_kind, self.poison = (
            judged_ok, None, "unavailable", 0)   # not the judge's own cause
        self.filtered = False


def _tokens(step: int, k: int, bug: str | None) -> list[int]:
    diverged = bug == "replay_diverged" and step == 2 and k == 1
    return [step + 1, k + 2, 9 if diverged else 3]


def _engine(bug: str | None) -> subprocess.Popen[bytes]:
    """A real child standing for the engine the fault kills."""
    code = "pass" if bug == "fault_missed" else "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code])


def _escape() -> subprocess.Popen[bytes]:
    """A child that makes its own session and double-forks a sleeper into it: the sleeper
    is reparented away, as a leaked sandbox is, and only its session ties it to the run."""
    code = ("import os, time; os.setsid(); time.sleep(0.3)\n"
            "if os.fork() == 0:\n    time.sleep(60)\nos._exit(0)")
    return subprocess.Popen([sys.executable, "-c", code])


def write_run(root: Path, name: str, bug: str | None = None, *, faulted: bool = True,
              steps: int = STEPS, rollouts: int = ROLLOUTS) -> Written:
    """Write a run of ``steps`` steps of ``rollouts`` rollouts named ``name`` under
    ``root`` with erlay's own writers, with the plant ``bug`` (a key of :data:`PLANTS`,
    placed for the default shape) made where the bug would make it."""
    if bug is not None and bug not in PLANTS:
        raise ValueError(f"unknown plant {bug!r}")
    run_dir = RunDir.create(root, name)
    run_dir.config.write_text(f"run: {{name: selftest, steps: {steps}}}\n"
                              "rollout: {max_staleness: 0}\n"
                              f"checkpoint: {{every_steps: {CHECKPOINT_EVERY}}}\n")
    load_config(run_dir.config, [])   # the config the verifier reads must load
    watch = ProcessWatch(sample_s=0.05).start()
    t0 = time.time()
    events = JsonlSink(run_dir.events)
    for domain in ("generation", "learner", "rollout"):
        events.emit(SupervisorEvent("erlay", domain, EventKind.START, "started", 0, t0))
    faults: list[FaultRecord] = []
    not_injected: list[str] = []
    if faulted:
        engine = _engine(bug)
        time.sleep(0.2)
        os.kill(engine.pid, signal.SIGKILL)
        code = engine.wait()
        at = time.time()
        faults.append(FaultRecord(0, "sigkill", ENGINE, "generation", at, "restart",
                                  f"pid {engine.pid}"))
        if code != -signal.SIGKILL:
            not_injected.append(f"faults.0 (sigkill {ENGINE}): exited with {code} first")
        if bug != "exit_unseen":
            events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.EXIT,
                                        "killed: SIGKILL", 0, at + 0.1))
        events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.RESTART,
                                    "restarted", 1, at + 0.2))
        events.emit(SupervisorEvent("erlay/generation", "engine-0", EventKind.START,
                                    "started", 1, at + 0.3))
        if bug == "restart_loop":
            for i in range(6):
                events.emit(SupervisorEvent("erlay/generation", "engine-1", EventKind.RESTART,
                                            "restarted", i, at + 0.4 + 0.1 * i))
    events.close()
    escaped = _escape() if bug == "orphan_escaped" else None
    ledger = LearnerLedger(run_dir.ledger)
    ledger.started(0, False)
    status = "finished"
    with Journal.open(run_dir.journal, snapshot_every=None) as journal:
        order = [0, 1, 3, 2, 4] if bug == "steps_swapped" else list(range(steps))
        for step in order:
            status = _step(run_dir, journal, ledger, step, bug, t0, steps, rollouts)
            if status != "finished":
                break
    if escaped is not None:
        escaped.wait()
        time.sleep(0.2)
    orphans = watch.orphans(grace_s=0.5)
    for orphan in orphans:   # found: now end it
        try:
            os.killpg(os.getsid(int(orphan["pid"])), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    write_summary(run_dir, "failed" if bug == "run_failed" else status, time.time() - t0)
    _damage(run_dir, bug)
    return Written(run_dir, faults, not_injected, orphans)


def _step(run_dir: RunDir, journal: Journal, ledger: LearnerLedger, step: int,
          bug: str | None, t0: float, steps: int, rollouts: int) -> str:
    """One RL step: its rollouts journaled, trained (ledger), consumed, reported and, every
    ``CHECKPOINT_EVERY`` steps and at the end, checkpointed with a journal snapshot.
    Returns ``failed`` when the plant kills the job here."""
    counts = StepCounts()
    ids = [_rid(step, k) for k in range(rollouts)]
    digest = hashlib.sha256()
    for k, rid in enumerate(ids):
        tokens = _tokens(step, k, bug)
        digest.update(json.dumps([rid, tokens]).encode())
        key = f"{rid}/tool0"
        journal.record(Transition(K.DISPATCHED, rid, {"step": step, "version": step}))
        journal.record(Transition(K.CHUNK, rid, {"turn": 0, "start": 0, "token_ids": tokens,
                                                 "logprobs": [-0.1] * 3, "version": step}))
        journal.record(Transition(K.TOOL_CALL, rid, {"key": key, "code": "1+1"}))
        journal.record(Transition(K.TOOL_RESULT, rid, {"key": key, "result": {"stdout": "2"}}))
        if k == 1 and step == {"tool_again": 4, "tool_again_compacted": 0}.get(bug or ""):
            journal.record(Transition(K.TOOL_CALL, rid, {"key": key, "code": "1+1"}))
        if bug == "tool_result_differs" and step == 4 and k == 2:
            journal.record(Transition(K.TOOL_RESULT, rid, {"key": key,
                                                           "result": {"stdout": "3"}}))
        judgement = {"reward": float(k % 2), "ok": True}
        journal.record(Transition(K.JUDGED, rid, {"key": f"{rid}/judge",
                                                  "judgement": judgement}))
        if bug == "judgement_changed" and step == 4 and k == 1:
            journal.record(Transition(K.JUDGED, rid, {"key": f"{rid}/judge",
                                                      "judgement": {"reward": 0.0, "ok": True}}))
        journal.record(Transition(K.COMPLETED, rid, {"reward": float(k % 2)}))
        counts.add(_Sample(judged_ok=not (bug == "judge_failing" and k % 2)), True,
                   0 if bug == "judge_failing" and k % 2 else 3)
    fed = [*ids, ids[0]] if bug == "duplicate_in_batch" and step == 3 else ids
    lag = 1 if bug == "stale_trained" and step == 3 else 0
    if not (bug == "ledger_step_missing" and step == 2):
        ledger.trained(step, step, fed, [[step - lag] * 3] * len(fed), [[True] * 3] * len(fed))
    last = step == steps - 1
    checkpoint = (step + 1) % CHECKPOINT_EVERY == 0 or last
    if bug == "kept_not_journaled" and last:
        _checkpoint(run_dir, journal, step)   # saved before the journal record: the bug
        return "failed"
    for rid in ids:
        if not (bug == "consume_skipped" and rid == _rid(1, 2)):
            journal.record(Transition(K.CONSUMED, rid, {"step": step, "version": step + 1}))
    if bug == "consumed_by_two_steps" and step == 2:
        journal.record(Transition(K.CONSUMED, _rid(1, 0), {"step": 2, "version": 3}))
    journal.flush()
    reward = 0.0 if bug == "reward_collapsed" else 0.5
    run_dir.append_metrics({"phase": "rl", "step": step, "time": 2.0 + step,
                            "reward_mean": reward, "tokens_digest": digest.hexdigest(),
                            "gen_tokens": 3 * rollouts, "staleness_max": 0, **counts.to_dict(),
                            "gen_window": [t0 + step, t0 + step + 0.5],
                            "train_window": [t0 + step + 0.5, t0 + step + 1.0]})
    if checkpoint:
        _checkpoint(run_dir, journal, step)
    return "finished"


def _checkpoint(run_dir: RunDir, journal: Journal, step: int) -> None:
    """The coordinator's checkpoint: a journal snapshot (which compacts and applies
    retention), then the learner's state after ``step``."""
    journal.snapshot()
    run_dir.checkpoints.mkdir(exist_ok=True)
    write_checkpoint_dir(run_dir.checkpoints / step_dir_name(step + 1), step + 1,
                         {"w": torch.full((64,), float(step))}, {})


def _damage(run_dir: RunDir, bug: str | None) -> None:
    """The plants a disk or an operator makes, after the run."""
    if bug == "journal_deleted":
        shutil.rmtree(run_dir.journal)
    elif bug == "events_deleted":
        run_dir.events.unlink()
    elif bug == "checkpoints_deleted":
        shutil.rmtree(run_dir.checkpoints)
    elif bug == "ledger_truncated":
        data = run_dir.ledger.read_bytes()
        run_dir.ledger.write_bytes(data[:len(data) // 2])
    elif bug == "checkpoint_torn":     # same size, manifest intact: it looks complete
        state = run_dir.checkpoints / step_dir_name(STEPS) / "state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))


def judge(obs: RunObservation, fault_free: RunObservation) -> dict[str, Any]:
    """The verdicts on ``obs`` by name, against the fault-free run."""
    return {v.name: v for v in check_all(obs, fault_free=fault_free)}


def run_selftest(keep: Path | None = None, out: Any = print,
                 only: list[str] | None = None) -> dict[str, int]:
    """Run the selftest, print its table and JSON line through ``out``; return the JSON.
    ``only``: these plants alone (a test's shortcut; ``passed`` then says False)."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="erlay-selftest-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        baseline = write_run(root, "fault-free", faulted=False).observe()
        clean = judge(write_run(root, "clean").observe(), baseline)
        rows, caught = [], 0
        for plant, (name, bug) in PLANTS.items():
            if only is not None and plant not in only:
                continue
            verdict = judge(write_run(root, plant, plant).observe(), baseline)[name]
            hit = verdict.ok is False
            caught += hit
            rows.append((plant, name, verdict.status, "yes" if hit else "NO",
                         f"{bug}: {verdict.detail}"[:110]))
        out(f"{'plant':22s} {'invariant':28s} {'verdict':7s} {'caught':6s} bug: detail")
        for row in rows:
            out(f"{row[0]:22s} {row[1]:28s} {row[2]:7s} {row[3]:6s} {row[4]}")
        false_alarms = [v for v in clean.values() if v.ok is not True]
        for v in false_alarms:
            out(f"false alarm on the clean run: {v.name}: {v.status}: {v.detail}")
        covered = {row[1] for row in rows}
        result = {"invariants": len(INVARIANTS), "covered": len(covered & set(INVARIANTS)),
                  "planted": len(rows), "caught": caught, "false_alarms": len(false_alarms)}
        out(json.dumps(result))
        return result
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def passed(result: dict[str, int]) -> bool:
    """Whether the selftest proves every invariant: each covered by a plant, every plant
    caught, at least :data:`MIN_PLANTS` of them, no false alarm on the clean run."""
    return (result["covered"] == result["invariants"]
            and result["caught"] == result["planted"] >= MIN_PLANTS
            and result["false_alarms"] == 0)
