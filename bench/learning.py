"""Benchmark: the CPU default RL job, run to completion on a local Ray.

Prints a table, then one JSON object as the last line.

    python bench/learning.py [--config configs/cpu.yaml] [override ...]

Also runs a short tool-use job in the same invocation, so the sandbox path is measured too
(``tool_use_sandbox_calls``): the arithmetic default makes no tool calls.

``telemetry_overhead`` is samples/s with telemetry off (``telemetry.exporter=none``, no Ray
metrics) divided by samples/s with the default exporters on (spans and metrics to files,
Ray metrics, 2% of rollouts traced end to end), over short jobs run alternately off/on, the
median of the pairs.  Both use the same seeds and the same work per step; which policy version
makes which token depends on timing (one-step off-policy), so their tokens may differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job
from erlay.actors.rundir import RunDir, reward_window
from erlay.supervisor.raylocal import shutdown_ray

ROOT = Path(__file__).resolve().parents[1]


def run_job(config: Path, overrides: list[str], parent: Path, name: str) -> tuple[Any, RunDir]:
    cfg = load_config(config, [*overrides, f"run.run_dir={parent}"])
    run_dir = RunDir.create(parent, name)
    result = Job(cfg, run_dir).run(progress=False)
    shutdown_ray()
    return result, run_dir


def figures(run_dir: RunDir, wall_s: float) -> dict[str, Any]:
    steps = run_dir.rl_steps()
    rewards = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
    start, end = reward_window(rewards)
    rl_s = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"] if steps else 0.0
    samples = sum(m["samples"] for m in steps)
    tokens = sum(m["gen_tokens"] for m in steps)
    busy = sum(m["gen_s"] + m["train_s"] for m in steps)
    return {
        "reward_start": round(start, 4), "reward_end": round(end, 4), "steps": len(steps),
        "wall_s": round(wall_s, 1), "samples_per_s": round(samples / rl_s, 1),
        "gen_tokens_per_s": round(tokens / rl_s, 1),
        "sandbox_calls": steps[-1]["sandbox_calls"] if steps else 0,
        "gen_train_overlap": round(busy / sum(m["step_s"] for m in steps), 3),
    }


OVERHEAD_OVERRIDES = ["run.steps=60", "warm_start.steps=60", "learner.lr_decay_steps=0"]
TELEMETRY_OFF = ["telemetry.exporter=none", "telemetry.ray_metrics=false"]


def rl_samples_per_s(run_dir: RunDir) -> float:
    """Samples per second of RL wall time (the warm start and Ray's start excluded)."""
    steps = run_dir.rl_steps()
    return sum(m["samples"] for m in steps) / sum(m["step_s"] for m in steps)


def telemetry_overhead(config: Path, parent: Path, pairs: int) -> dict[str, Any]:
    ratios = []
    for i in range(pairs):
        _, off = run_job(config, [*OVERHEAD_OVERRIDES, *TELEMETRY_OFF], parent, f"off-{i}")
        _, on = run_job(config, OVERHEAD_OVERRIDES, parent, f"on-{i}")
        ratios.append(rl_samples_per_s(off) / rl_samples_per_s(on))
        spans = sum(1 for f in (on.path / "telemetry").glob("spans-*.jsonl")
                    for _ in f.open())
    ratios.sort()
    return {"telemetry_overhead": round(ratios[len(ratios) // 2], 3),
            "telemetry_overhead_pairs": [round(r, 3) for r in ratios],
            "telemetry_spans_per_job": spans}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"))
    parser.add_argument("--skip-tool-use", action="store_true")
    parser.add_argument("--overhead-pairs", type=int, default=3,
                        help="off/on job pairs for telemetry_overhead (0: skip)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.getLogger("erlay").setLevel(logging.ERROR)
    parent = Path(tempfile.mkdtemp(prefix="erlay-bench-"))
    result, run_dir = run_job(Path(args.config), args.overrides, parent, "learning")
    out = figures(run_dir, result.wall_s)
    if not args.skip_tool_use:
        _, tool_dir = run_job(ROOT / "configs" / "tool_use.yaml", ["run.steps=5"], parent,
                              "tool-use")
        out["tool_use_sandbox_calls"] = figures(tool_dir, 1.0)["sandbox_calls"]
    if args.overhead_pairs > 0:
        out.update(telemetry_overhead(Path(args.config), parent, args.overhead_pairs))
    targets = {"reward_end": ">= 0.9", "wall_s": "<= 600", "telemetry_overhead": "<= 1.03",
               "reward_start": f"reward_end - reward_start >= 0.3 "
                               f"(measured {out['reward_end'] - out['reward_start']:.3f})"}
    print(f"run directory: {run_dir.path} ({result.status})")
    print(f"{'figure':24s} {'measured':>10s}  target")
    for key, value in out.items():
        print(f"{key:24s} {value!s:>10}  {targets.get(key, '')}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
