"""Benchmark: every policy objective on the CPU default, the same seed, budget and config
otherwise (``algorithm.name`` is the only override).

Prints a table, then one JSON object as the last line, keyed by objective:

    python bench/algorithms.py [--runs N] [--only grpo,dapo] [--smoke] [override ...]

Per objective: ``reward_start`` and ``reward_end`` (the mean reward of the first and of the
last tenth of the RL steps, as ``bench/learning.py`` reports them), ``wall_s`` (the whole
job, Ray's start included: what ``erlay run`` takes), and what the objective did differently:
``filtered_samples`` and ``fill_rounds`` (dapo's dynamic sampling), ``trained_tokens``.  With
``--runs N`` each figure is the median of N runs (objectives interleaved, so a slow spell
of the machine hits them alike), with its ``*_runs`` list beside it.  ``load_avg`` is the
machine's 1/5/15-minute load when the objective's last run ended.

Targets (issue 39): every objective ``reward_end >= 0.85`` and ``wall_s <= 600``; grpo
still ``>= 0.9``.  ``--smoke`` runs each objective for two short steps: it checks the
benchmark runs, not the figures (CI).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from erlay.actors.learner.objectives import ALGORITHMS
from erlay.actors.observe.summary import reward_window
from erlay.actors.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script: bench/ is not a package on the path
    sys.path.insert(0, str(ROOT))
from bench.learning import run_job  # noqa: E402

SMOKE = ["run.steps=2", "warm_start.steps=2", "warm_start.examples=16",
         "rollout.prompts_per_step=2", "rollout.group_size=4", "checkpoint.every_steps=2"]
TARGETS = {"reward_end": ">= 0.85 (grpo >= 0.9)", "wall_s": "<= 600"}


def figures(run_dir: RunDir, wall_s: float, status: str) -> dict[str, Any]:
    """One run's figures from its metrics.jsonl."""
    steps = run_dir.rl_steps()
    rewards = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
    start, end = reward_window(rewards)
    return {"reward_start": round(start, 4), "reward_end": round(end, 4),
            "wall_s": round(wall_s, 1), "steps": len(steps), "status": status,
            "trained_tokens": sum(int(m.get("trained_tokens") or 0) for m in steps),
            "filtered_samples": sum(int(m.get("filtered") or 0) for m in steps),
            "fill_rounds": sum(int(m.get("fill_rounds") or 0) for m in steps)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each numeric figure over ``runs``, each with its runs beside it when
    there are several; ``status`` is ``finished`` only if every run finished."""
    out: dict[str, Any] = {}
    for key in ("reward_start", "reward_end", "wall_s", "steps", "trained_tokens",
                "filtered_samples", "fill_rounds"):
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 4)
        if len(runs) > 1:
            out[f"{key}_runs"] = values
    bad = sorted({r["status"] for r in runs} - {"finished"})
    out["status"] = "finished" if not bad else ",".join(bad)
    return out


def meets(name: str, fig: dict[str, Any]) -> bool:
    floor = 0.9 if name == "grpo" else 0.85
    return fig["status"] == "finished" and fig["reward_end"] >= floor and fig["wall_s"] <= 600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    parser.add_argument("--runs", type=int, default=1, help="runs of each objective")
    parser.add_argument("--only", default="", help="comma-separated objectives (default all)")
    parser.add_argument("--smoke", action="store_true", help="two tiny steps each (CI)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ALGORITHMS)
    unknown = sorted(set(names) - set(ALGORITHMS))
    if unknown or args.runs < 1:
        parser.error(f"unknown objective(s) {', '.join(unknown)}" if unknown
                     else "--runs must be >= 1")
    logging.getLogger("erlay").setLevel(logging.ERROR)
    overrides = [*(SMOKE if args.smoke else []), *args.overrides]
    parent = Path(tempfile.mkdtemp(prefix="erlay-bench-algorithms-"))
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load: dict[str, list[float]] = {}
    for i in range(args.runs):
        for name in names:
            result, run_dir = run_job(Path(args.config), [*overrides, f"algorithm.name={name}"],
                                      parent, f"{name}-{i}")
            runs[name].append(figures(run_dir, result.wall_s, result.status))
            load[name] = [round(x, 2) for x in os.getloadavg()]
            print(f"# {name} run {i}: {runs[name][-1]}", file=sys.stderr, flush=True)
    out = {name: {**summarise(runs[name]), "load_avg": load[name]} for name in names}
    print(f"run directories under {parent}; {args.runs} run(s) each"
          + (" (smoke: the figures mean nothing)" if args.smoke else ""))
    print(f"{'objective':14s} {'reward_start':>12s} {'reward_end':>10s} {'wall_s':>8s} "
          f"{'filtered':>9s} {'met':>4s}   targets: reward_end {TARGETS['reward_end']}, "
          f"wall_s {TARGETS['wall_s']}")
    for name, fig in out.items():
        print(f"{name:14s} {fig['reward_start']:12.3f} {fig['reward_end']:10.3f} "
              f"{fig['wall_s']:8.1f} {fig['filtered_samples']:9.0f} "
              f"{'yes' if meets(name, fig) else 'no':>4s}")
    print(json.dumps(out))
    if any(fig["status"] != "finished" for fig in out.values()):
        sys.exit(1)   # a job that failed is never a benchmark that passed


if __name__ == "__main__":
    main()
