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

    python bench/chaos_goodput.py [--scenario mixed-soak]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from erlay.chaos.records import lost_rollouts, trained_twice
from erlay.chaos.report import percentiles
from erlay.chaos.runner import ChaosResult, run_scenario
from erlay.chaos.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="mixed-soak")
    args = parser.parse_args()
    logging.getLogger("erlay").setLevel(logging.ERROR)
    scenario = load_scenario(args.scenario)
    parent = Path(tempfile.mkdtemp(prefix="erlay-chaos-bench-"))
    result = run_scenario(scenario, parent=parent, say=lambda line: print(line, flush=True))
    out = figures(result)
    targets = {"rollouts_lost": "0", "trained_twice": "0", "orphans": "0",
               "goodput_vs_fault_free": ">= 0.90", "goodput_vs_job_restart": ">= 2"}
    print(f"report: {result.report_paths[1]}")
    print(f"{'figure':28s} {'measured':>12}  target")
    for key, value in out.items():
        print(f"{key:28s} {value!s:>12}  {targets.get(key, '')}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
