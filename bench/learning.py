"""Benchmark: the CPU default RL job, run to completion on a local Ray.

Prints a table, then one JSON object as the last line.

    python bench/learning.py [--config configs/cpu.yaml] [override ...]
    python bench/learning.py --smoke   # the smallest size (CI)

``--smoke`` runs the main job alone, to completion on a real local Ray, at the smallest size
(``SMOKE_OVERRIDES``: two RL steps of two groups of two, one warm-start step, one
environment worker; overrides given after it win): the built-in job, the tool-use job and the
telemetry pairs are skipped (each is another whole job, most of whose time is the start of
its actors).  Its figures say nothing about the targets.

Then runs the same task on the built-in model (``--builtin-config``, default
``configs/cpu-builtin.yaml``) and reports its figures as ``builtin_*`` with the ratios
``hf_over_builtin_learner_step`` and ``hf_over_builtin_samples_per_s``.  ``learner_step_s`` is
the median RL step's train call (batch sent to new weights published).

Also runs a short tool-use job in the same invocation, so the sandbox path is measured too
(``tool_use_sandbox_calls``): the arithmetic default makes no tool calls.

``telemetry_overhead`` (wall: RL samples/s off / on) and ``telemetry_cpu_overhead`` (CPU
seconds per trained sample in every process of the job, on / off) come from
``bench/telemetry.py`` (its docstring says how they are measured): ``--overhead-pairs`` pairs
of short jobs, telemetry off (``telemetry.exporter=none``, no Ray metrics) and on (the
shipped default), the order alternating; each figure is the median over the pairs, with its
spread.  Both jobs of a pair use the same seeds and the same work per step; which policy
version makes which token depends on timing (one-step off-policy), so their tokens may
differ.

``gen_train_overlap`` is the share of the RL wall time during which generation and training
both ran: the measure of (union of the steps' generation windows) ∩ (union of their training
windows), over the time from the first window's start to the last window's end.  The
coordinator writes each RL step's ``gen_window`` (the step's first rollout dispatched to its
last rollout finished) and ``train_window`` (the train call sent to the new weights
published) into metrics.jsonl, in wall-clock seconds.  0 means the phases strictly
alternated, 1 that both ran all the time.  ``gen_busy`` and ``train_busy`` are each union's
share of the same wall time.  (Before issue 16 it was (generation + training seconds) /
step seconds, which counts time twice whenever two steps' generation overlap.)

``load_avg_at_end`` is the machine's 1/5/15-minute load average when the benchmark ended:
the load the figures were measured under.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job
from erlay.actors.observe.summary import reward_window
from erlay.actors.rundir import RunDir
from erlay.supervisor.raylocal import shutdown_ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from telemetry import OVERHEAD_OVERRIDES, telemetry_figures  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]


def run_job(config: Path, overrides: list[str], parent: Path, name: str) -> tuple[Any, RunDir]:
    cfg = load_config(config, [*overrides, f"run.storage={parent}"])
    run_dir = RunDir.create(parent, name)
    result = Job(cfg, run_dir).run(progress=False)
    shutdown_ray()
    return result, run_dir


Window = tuple[float, float]   # wall-clock seconds, start <= end


def union(windows: Iterable[Sequence[float]]) -> list[Window]:
    """The disjoint, sorted windows covering exactly the time some window of ``windows``
    covers.  Empty and reversed windows cover nothing."""
    merged: list[Window] = []
    for start, end in sorted((float(a), float(b)) for a, b in windows if b > a):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_s(windows: Iterable[Sequence[float]]) -> float:
    """Seconds covered by at least one of ``windows`` (overlaps counted once)."""
    return sum(end - start for start, end in union(windows))


def both_s(a: Iterable[Sequence[float]], b: Iterable[Sequence[float]]) -> float:
    """Seconds during which some window of ``a`` and some window of ``b`` are both open."""
    ua, ub = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def gen_train_overlap(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """``gen_train_overlap``, ``gen_busy`` and ``train_busy`` of RL step records (see the
    module docstring): shares of the wall time from the first window's start to the last
    window's end.  Steps without windows (recovered steps, run directories from before the
    windows were recorded) are left out; all three are None when no step has both."""
    timed = [m for m in steps if m.get("gen_window") and m.get("train_window")]
    gen = [m["gen_window"] for m in timed]
    train = [m["train_window"] for m in timed]
    edges = [t for w in gen + train for t in w]
    wall = max(edges) - min(edges) if edges else 0.0
    if wall <= 0:
        return {"gen_train_overlap": None, "gen_busy": None, "train_busy": None}
    return {"gen_train_overlap": round(both_s(gen, train) / wall, 3),
            "gen_busy": round(covered_s(gen) / wall, 3),
            "train_busy": round(covered_s(train) / wall, 3)}


def figures(run_dir: RunDir, wall_s: float) -> dict[str, Any]:
    steps = run_dir.rl_steps()
    rewards = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
    start, end = reward_window(rewards)
    rl_s = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"] if steps else 0.0
    samples = sum(m["samples"] for m in steps)
    tokens = sum(m["gen_tokens"] for m in steps)
    train_s = sorted(m["train_s"] for m in steps if m.get("train_s") is not None)
    return {
        "reward_start": round(start, 4), "reward_end": round(end, 4), "steps": len(steps),
        "wall_s": round(wall_s, 1), "samples_per_s": round(samples / rl_s, 1),
        "gen_tokens_per_s": round(tokens / rl_s, 1),
        # The learner's train call, from the batch sent to the new weights published: the
        # median over RL steps.
        "learner_step_s": round(train_s[len(train_s) // 2], 4) if train_s else None,
        "sandbox_calls": steps[-1]["sandbox_calls"] if steps else 0,
        **gen_train_overlap(steps),
    }


SMOKE_OVERRIDES = ["run.steps=2", "warm_start.steps=1", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "learner.lr_decay_steps=0",
                   "environment.workers_per_node=1"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    parser.add_argument("--skip-tool-use", action="store_true")
    parser.add_argument("--builtin-config", default=str(ROOT / "configs" / "cpu-builtin.yaml"),
                        help="the same task on the built-in model, run after the main job "
                        "for the HF/built-in ratios ('' skips it)")
    parser.add_argument("--overhead-pairs", type=int, default=6,
                        help="off/on job pairs for telemetry_overhead and "
                        "telemetry_cpu_overhead, the order alternating (0: skip)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): the main job alone, two tiny RL steps")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.smoke:
        args.builtin_config, args.skip_tool_use, args.overhead_pairs = "", True, 0
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    logging.getLogger("erlay").setLevel(logging.ERROR)
    parent = Path(tempfile.mkdtemp(prefix="erlay-bench-"))
    result, run_dir = run_job(Path(args.config), args.overrides, parent, "learning")
    out = figures(run_dir, result.wall_s)
    out["model"] = load_config(Path(args.config), args.overrides).model.hf or "built-in"
    if args.builtin_config:
        result_b, builtin_dir = run_job(Path(args.builtin_config), args.overrides, parent,
                                        "builtin")
        builtin = figures(builtin_dir, result_b.wall_s)
        for key in ("reward_start", "reward_end", "wall_s", "samples_per_s", "learner_step_s"):
            out[f"builtin_{key}"] = builtin[key]
        # HF default / built-in: above 1 for times means the HF model is slower.
        out["hf_over_builtin_learner_step"] = round(out["learner_step_s"]
                                                    / builtin["learner_step_s"], 3)
        out["hf_over_builtin_samples_per_s"] = round(out["samples_per_s"]
                                                     / builtin["samples_per_s"], 3)
    if not args.skip_tool_use:
        _, tool_dir = run_job(ROOT / "configs" / "tool_use.yaml", ["run.steps=5"], parent,
                              "tool-use")
        out["tool_use_sandbox_calls"] = figures(tool_dir, 1.0)["sandbox_calls"]
    if args.overhead_pairs > 0:
        tel = telemetry_figures(Path(args.config), OVERHEAD_OVERRIDES, parent,
                                args.overhead_pairs)
        out.update(telemetry_overhead=tel["telemetry_overhead"]["median"],
                   telemetry_overhead_spread=tel["telemetry_overhead"],
                   telemetry_cpu_overhead=tel["telemetry_cpu_overhead"]["median"],
                   telemetry_cpu_overhead_spread=tel["telemetry_cpu_overhead"],
                   telemetry_spans_per_job=tel["telemetry_spans_per_job"])
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    targets = {"reward_end": ">= 0.9", "wall_s": "<= 600", "telemetry_overhead": "<= 1.03",
               "telemetry_cpu_overhead": "<= 1.03",
               "reward_start": f"reward_end - reward_start >= 0.3 "
                               f"(measured {out['reward_end'] - out['reward_start']:.3f})"}
    print(f"run directory: {run_dir.path} ({result.status})")
    print(f"{'figure':24s} {'measured':>10s}  target")
    for key, value in out.items():
        print(f"{key:24s} {value!s:>10}  {targets.get(key, '')}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
