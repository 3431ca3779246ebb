"""Gathering a finished run into a :class:`RunObservation`: the run dir (events, metrics,
the learner's ledger, checkpoints) and the journal's transition stream as the runner teed
it.  Reading only; every judgement is in :mod:`erlay.chaos.invariants`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from erlay.actors.config import JobConfig
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind
from erlay.actors.learner.checkpoint_format import (
    SHARDED,
    CheckpointInvalid,
    list_checkpoints,
    load,
    read_manifest,
    verify_files,
)
from erlay.actors.learner.ledger import read_ledger
from erlay.actors.rundir import RunDir
from erlay.chaos.faults import FaultRecord
from erlay.chaos.observation import RunObservation
from erlay.supervisor.events import read_events

DOMAINS = ("learner", "generation", "sandbox", "judge", "environment", "rollout")


def checkpoint_problems(root: Path) -> list[tuple[int, str | None]]:
    """``(step, problem)`` of every checkpoint under ``root`` that looks committed (a
    complete manifest, files of the listed sizes); ``problem`` is None when its content
    hashes verify and it loads (a sharded one, which needs its ranks to load: its hashes
    verify), else why not."""
    out: list[tuple[int, str | None]] = []
    for info in list_checkpoints(root):
        try:
            if info.layout == SHARDED:
                verify_files(info.path, read_manifest(info.path, info.step))
            else:
                load(info.path, verify=True)
        except (CheckpointInvalid, OSError, RuntimeError, ValueError) as exc:
            out.append((info.step, str(exc)))
        else:
            out.append((info.step, None))
    return out


def rl_wall_s(metrics: list[dict[str, Any]]) -> float | None:
    """Seconds from the start of the first RL step's window to the end of the last one:
    the goodput denominator.  None without RL step windows (an older run dir)."""
    starts, ends = [], []
    for m in metrics:
        if m.get("phase") == "rl":
            for key in ("gen_window", "train_window"):
                if isinstance(m.get(key), list | tuple) and len(m[key]) == 2:
                    starts.append(float(m[key][0]))
                    ends.append(float(m[key][1]))
    return max(ends) - min(starts) if starts else None


def observe_run(cfg: JobConfig, run_dir: RunDir, memory: MemoryTransitions | None,
                faults: list[FaultRecord], wall_s: float, status: str, offender: str | None,
                orphans: list[dict[str, Any]], *, consumed: dict[str, int] | None = None,
                dispatched: set[str] | None = None, started_at: float | None = None,
                not_injected: list[str] | None = None) -> RunObservation:
    """The observation of one run.  ``memory`` is the journal's transition stream as the
    runner teed it; None when the driver ran where it could not be teed (a resumed
    subprocess), and then ``consumed`` and ``dispatched`` come from the journal's compacted
    state and the stream-only invariants report that they cannot check."""
    events = read_events(run_dir.events) if run_dir.events.exists() else []
    metrics = run_dir.read_metrics()
    sup = cfg.supervision
    intensity = {"erlay": (sup.root.intensity, sup.root.period)}
    for domain in DOMAINS:
        flags = getattr(sup, domain)
        intensity[f"erlay/{domain}"] = (flags.intensity, flags.period)
    if memory is not None:
        consumed_pairs = [(t.rollout_id, int(t.data["step"]))
                          for t in memory.of(TransitionKind.CONSUMED)]
        dispatched = {t.rollout_id for t in memory.of(TransitionKind.DISPATCHED)}
        tools = [("call" if t.kind is TransitionKind.TOOL_CALL else "result",
                  str(t.data["key"]), t.data.get("result"))
                 for t in memory.items
                 if t.kind in (TransitionKind.TOOL_CALL, TransitionKind.TOOL_RESULT)]
        judged = [(str(t.data["key"]), t.data.get("judgement"))
                  for t in memory.of(TransitionKind.JUDGED)]
    else:
        consumed_pairs = sorted((consumed or {}).items())
        dispatched = set(dispatched or ())
        tools, judged = [], []
    steps = {m["step"] for m in metrics if m.get("phase") == "rl"}
    return RunObservation(
        events=events, metrics=metrics, consumed_transitions=consumed_pairs,
        dispatched_ids=dispatched, tool_events=tools,
        judgements=judged, stream_observed=memory is not None,
        ledger=read_ledger(run_dir.ledger) if run_dir.ledger.exists() else None,
        checkpoints=checkpoint_problems(run_dir.checkpoints),
        steps_trained=len(steps), faults=faults, wall_s=wall_s, rl_wall_s=rl_wall_s(metrics),
        max_staleness=cfg.rollout.max_staleness, intensity=intensity, orphans=orphans,
        status=status, offender=offender, started_at=started_at,
        not_injected=list(not_injected or []))
