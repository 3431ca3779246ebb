"""Benchmark: the mixed soak (a fault every ~20 s across every domain) and its baselines.

Runs ``configs/chaos/mixed-soak.yaml`` with ``erlay chaos``'s runner: a fault-free run, a
whole-job-restart run (``supervision.mode=job_restart``: any failure restarts every domain
from the last checkpoint and throws in-flight work away) with the same faults, and the run
with erlay's local recovery.  Prints the report table, then one JSON object as the last line:

- ``faults_injected``; ``rollouts_lost`` (dispatched rollouts of trained steps that never
  reached CONSUMED in the journal), ``trained_twice`` (rollouts the learner's ledger shows
  fed more than once in its surviving timeline), ``orphans`` (targets: 0)
- goodput as erlay defines it (erlay.actors.observe.goodput: trained tokens per second of
  RL wall time) for the run and both baselines, and the ratios ``goodput_vs_fault_free``
  (target >= 0.90) and ``goodput_vs_job_restart`` (target >= 2)
- the samples not trained, by reason (``not_trained_*``)
- ``recovery_ms_p50``, ``recovery_ms_p99``: injection until the target child served again

    python bench/chaos_goodput.py [--scenario mixed-soak] [--runs 3]
    python bench/chaos_goodput.py --smoke   # the smallest size (CI)

With ``--runs N`` the scenario and its baselines run N times; the last line then holds the
counts summed over the runs and each ratio and rate as median/min/max/runs.

``--smoke`` (:func:`smoke_scenario`) runs the scenario's job once, on a real local Ray, at
the smallest size (``SMOKE_OVERRIDES``), with only its first fault, fired once at RL step 1,
and without the baselines (the runner's CI smoke mode: each baseline is another whole job),
so the goodput ratios are null.  It exits 1 if the job did not finish or the fault was not
injected; its figures say nothing about the targets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from erlay.chaos.records import lost_rollouts, trained_twice
from erlay.chaos.report import percentiles
from erlay.chaos.runner import ChaosResult, run_scenario
from erlay.chaos.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # noqa: E402 - bench/ is on sys.path when run as a script


def figures(result: ChaosResult) -> dict[str, Any]:
    obs = result.run.observation
    twice = trained_twice(obs)
    recovery = [f["recovery_ms"] for f in result.report["faults"]
                if f.get("recovery_ms") is not None]
    spread = percentiles(recovery)
    good = result.report["goodput"]
    return {
        "faults_injected": len(result.run.faults),
        "faults_detected": result.report["detected"]["count"],
        "faults_recovered": result.report["recovered"]["count"],
        "rollouts_lost": len(lost_rollouts(obs)),
        "trained_twice": None if twice is None else len(twice),
        "orphans": len(obs.orphans),
        "goodput_vs_fault_free": _round(good.get("goodput_vs_fault_free")),
        "goodput_vs_job_restart": _round(good.get("goodput_vs_job_restart")),
        "recovery_ms_p50": _round(spread["p50"], 1),
        "recovery_ms_p99": _round(spread["p99"], 1),
        "goodput_tokens_per_s": _round(good["tokens_per_s"], 1),
        "fault_free_goodput_tokens_per_s": _round(result.report["baselines"].get(
            "fault_free", {}).get("goodput"), 1),
        "job_restart_goodput_tokens_per_s": _round(result.report["baselines"].get(
            "job_restart", {}).get("goodput"), 1),
        **{f"not_trained_{k}": v for k, v in good["not_trained"].items()},
        "invariants_failed": [v.name for v in result.verdicts if v.ok is False],
        "status": result.run.status,
    }


def _round(value: Any, digits: int = 3) -> Any:
    return round(value, digits) if isinstance(value, float) else value


# The smallest job that still trains: a checkpoint every step, two RL steps after the fault.
SMOKE_OVERRIDES = ("run.steps=3", "warm_start.steps=1", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "checkpoint.every_steps=1",
                   "environment.workers_per_node=1", "sandbox.workers_per_node=1")


def smoke_scenario(scenario: Scenario) -> Scenario:
    """``scenario`` at the smallest size: its overrides plus ``SMOKE_OVERRIDES``, its first
    fault fired once at RL step 1 (validated again, like a scenario file), no baselines."""
    data = scenario.model_dump(by_alias=True)
    fault = {**data["faults"][0], "at": None, "every": None, "start": None, "random": None,
             "count": None, "at_step": 1}
    return Scenario.model_validate({**data, "overrides": [*data["overrides"], *SMOKE_OVERRIDES],
                                    "faults": [fault], "baselines": [], "duration_s": 60.0})


TARGETS = {"rollouts_lost": "0", "trained_twice": "0", "orphans": "0",
           "goodput_vs_fault_free": ">= 0.90", "goodput_vs_job_restart": ">= 2"}
# Figures summed over the runs (a count that must be 0 in every run), and those reported as
# median (min-max) over the runs.
SUMMED = ("faults_injected", "faults_detected", "faults_recovered", "rollouts_lost",
          "trained_twice", "orphans")
SPREAD = ("goodput_vs_fault_free", "goodput_vs_job_restart", "goodput_tokens_per_s",
          "fault_free_goodput_tokens_per_s", "job_restart_goodput_tokens_per_s",
          "recovery_ms_p50", "recovery_ms_p99")


def combine(runs: list[dict[str, Any]], loads: list[float]) -> dict[str, Any]:
    """The figures of ``runs`` (each :func:`figures`): counts summed, ratios and rates as
    median/min/max/runs, each run's own figures kept under ``runs``."""
    out: dict[str, Any] = {"runs": len(runs), "load": loads}
    for key in SUMMED:
        values = [r[key] for r in runs]
        out[key] = None if any(v is None for v in values) else sum(values)
    for key in SPREAD:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        out[key] = spread(values, digits=3) if values else None
    out["statuses"] = [r["status"] for r in runs]
    out["invariants_failed"] = sorted({name for r in runs for name in r["invariants_failed"]})
    out["each"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="mixed-soak")
    parser.add_argument("--runs", type=int, default=1,
                        help="invocations of the scenario and its baselines (medians with "
                        "their spread when more than one)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): one run of the job alone, tiny, with "
                        "the scenario's first fault at RL step 1")
    args = parser.parse_args()
    logging.getLogger("erlay").setLevel(logging.ERROR)
    scenario = load_scenario(args.scenario)
    if args.smoke:
        scenario, args.runs = smoke_scenario(scenario), 1
    runs, loads = [], [round(os.getloadavg()[0], 2)]
    for i in range(args.runs):
        parent = Path(tempfile.mkdtemp(prefix="erlay-chaos-bench-"))
        result = run_scenario(scenario, parent=parent, with_baselines=not args.smoke,
                              say=lambda line: print(line, flush=True))
        runs.append(figures(result))
        loads.append(round(os.getloadavg()[0], 2))
        print(f"run {i}: report {result.report_paths[1]}", flush=True)
        print(f"{'figure':28s} {'measured':>12}  target")
        for key, value in runs[-1].items():
            print(f"{key:28s} {value!s:>12}  {TARGETS.get(key, '')}")
    if args.runs == 1:
        print(json.dumps(runs[0]))
        if args.smoke and (runs[0]["status"] != "finished" or not runs[0]["faults_injected"]):
            sys.exit(1)   # nothing size-dependent: the job or the injection is broken
        return
    out = combine(runs, loads)
    print(f"\nover {args.runs} runs (load average at start and after each: {loads})")
    for key in (*SUMMED, *SPREAD):
        print(f"{key:34s} {out[key]!s:>50}  {TARGETS.get(key, '')}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
