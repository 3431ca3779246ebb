"""Gathering a chaos run into a :class:`RunObservation`: the run directory's durable
evidence, read by the same code as ``erlay verify`` (:func:`erlay.chaos.evidence.observe_dir`),
with what only the runner knows (the faults it injected, the run's end, the processes left
behind).  Reading only; every judgement is in :mod:`erlay.chaos.invariants`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from erlay.actors.config import JobConfig
from erlay.actors.rundir import RunDir
from erlay.chaos.evidence import checkpoint_problems, observe_dir
from erlay.chaos.faults import FaultRecord
from erlay.chaos.observation import RunObservation

__all__ = ["checkpoint_problems", "observe_run", "rl_wall_s"]


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


def observe_run(cfg: JobConfig, run_dir: RunDir, faults: list[FaultRecord], wall_s: float,
                status: str, offender: str | None, orphans: list[dict[str, Any]], *,
                started_at: float | None = None,
                not_injected: list[str] | None = None) -> RunObservation:
    """The observation of one chaos run: its run directory's durable evidence, with the
    runner's own facts (``status`` is the runner's, which knows a stall)."""
    obs = observe_dir(run_dir.path, cfg)
    return dataclasses.replace(
        obs, faults=list(faults), wall_s=wall_s, rl_wall_s=rl_wall_s(obs.metrics),
        status=status, offender=offender,
        orphans=[*orphans, *kv_leftovers(cfg, run_dir.path.name)], started_at=started_at,
        not_injected=list(not_injected or []))


def kv_leftovers(cfg: JobConfig, run_id: str) -> list[dict[str, Any]]:
    """The run's KV hand-off caches, if the run left them on this node (its node runtime
    removes them when it ends): an orphan as much as a leftover process is."""
    handoff = cfg.engine.kv_handoff
    path = Path(handoff.root) / run_id
    if cfg.engine.backend != "torch" or not handoff.enabled or not path.exists():
        return []
    files = [p for p in path.rglob("*") if p.is_file()]
    return [{"pid": None, "cmdline": f"KV hand-off caches left behind: {path} "
                                     f"({len(files)} file(s))"}]
