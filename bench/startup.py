"""Benchmark of a job's start-up: from ``erlay run`` to the tree up and to the first RL step.

Each run is the command a user types, ``erlay run configs/cpu.yaml`` (the shipped tree: one
learner, one engine, a sandbox and a judge host, the coordinator), with ``run.steps=1`` and
no warm start: the warm start is training, not start-up, and is left out so the figures are
the start-up alone.  Runs alternate between ``supervision.boot_ahead=true`` (shipped) and
``false`` (every actor created only after the one before it is up, as OTP starts children),
so both sides see the same machine; each figure is the median of ``--pairs`` pairs with its
spread.

Stages, all on the wall clock of this one machine:

- ``ray_s``: from the command's launch until the job has Ray (CLI import, config, Ray start);
  the run's ``started_at``.
- ``boot_s``: from there until the tree is up: the root's last domain (``rollout``) reported
  started, which is when ``erlay status`` shows every component running.
- ``first_step_s``: from the launch until the first RL step's record is written.

``boot_speedup`` is the median of the pairs' ``boot_s`` ratios (in turn / ahead); the run
fails (exit 1) below :data:`TARGET` (1.25), and ``--plant-in-turn`` runs both sides in turn,
which must fail it.

    python bench/startup.py [--pairs 3] [--plant-in-turn] [--config FILE] [a.b=c ...]
    python bench/startup.py --smoke     # CI's smoke size: one run, the shipped side

``--smoke`` is one run of the shipped side (boot ahead) alone, its first RL step at its
smallest (``SMOKE_OVERRIDES``: 2 prompts x 2 rollouts): the same command, run directory and
stages, in half a pair's time (a pair, its in-turn side booting one actor after another,
takes about a minute here).  With no in-turn side there is no ``boot_speedup``: the JSON
says null and ``"verdict": "not judged"``, and the run exits 0 unless the run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from runstats import spread  # bench/ (a script's own folder is on sys.path)
except ImportError:              # imported as bench.startup (tests)
    from bench.runstats import spread

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "cpu.yaml"
TARGET = 1.25  # boot_speedup: the learner's and the engine's loads overlap on 2 cores
SMOKE_OVERRIDES = ("rollout.prompts_per_step=2", "rollout.group_size=2")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stages(launched: float, run_dir: Path) -> dict[str, float]:
    """The stage times of one finished run, from its events and metrics."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    started_at = metrics[0]["started_at"]
    up = [e["time"] for e in events if e["supervisor"] == "erlay" and e["child"] == "rollout"
          and e["context"] == "start" and e["reason"] == "started"]
    first = [m["time"] for m in metrics if m.get("phase") == "rl"]
    if not up or not first:
        raise RuntimeError(f"{run_dir}: the tree never came up or no RL step was written")
    return {"ray_s": started_at - launched, "boot_s": up[0] - started_at,
            "first_step_s": started_at + first[0] - launched}


def one_run(storage: Path, side: str, ahead: bool, index: int, config: Path = CONFIG,
            extra: tuple[str, ...] = ()) -> dict[str, float]:
    name = f"startup-{index}-{side}"  # the side's name: planted, both sides run in turn
    cmd = [str(Path(sys.executable).with_name("erlay")), "run", str(config), "run.steps=1",
           "warm_start.steps=0", f"run.name={name}",
           f"supervision.boot_ahead={'true' if ahead else 'false'}", *extra]
    env = {**os.environ, "ERLAY_STORAGE": str(storage)}
    launched = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr[-2000:]}")
    run_dirs = list(storage.glob(f"{name}-*"))
    if len(run_dirs) != 1:
        raise RuntimeError(f"{name}: expected one run directory, found {run_dirs}")
    return stages(launched, run_dirs[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (a.b=c)")
    ap.add_argument("--plant-in-turn", action="store_true",
                    help="run the boot-ahead side in turn too: boot_speedup must then fail")
    ap.add_argument("--smoke", action="store_true",
                    help="CI's smoke size: one run of the shipped side, no verdict")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs: at least 1")
    if args.smoke and args.plant_in_turn:
        ap.error("--plant-in-turn needs both sides of a pair: not with --smoke")
    if args.smoke:
        args.pairs = 1
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="erlay-startup-") as tmp:
        for i in range(args.pairs):
            order = (True,) if args.smoke else (True, False) if i % 2 == 0 else (False, True)
            pair: dict[bool, dict[str, float]] = {}
            for ahead in order:
                side = "ahead" if ahead else "in-turn"
                pair[ahead] = one_run(Path(tmp), side, ahead and not args.plant_in_turn, i,
                                      args.config, tuple(args.overrides))
                runs[ahead].append(pair[ahead])
                print(f"pair {i + 1}/{args.pairs} boot_ahead={ahead}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in pair[ahead].items()),
                      file=sys.stderr, flush=True)
            if len(pair) == 2:
                ratios.append(pair[False]["boot_s"] / pair[True]["boot_s"])
    result: dict[str, Any] = {"bench": "startup", "config": str(args.config),
                              "overrides": args.overrides,
                              "pairs": 0 if args.smoke else args.pairs,
                              "planted_in_turn": args.plant_in_turn, "smoke": args.smoke}
    print(f"{'stage':<14}{'boot_ahead (shipped)':>26}{'in turn':>26}")
    for stage in ("ray_s", "boot_s", "first_step_s"):
        on, off = (spread([r[stage] for r in runs[side]], digits=2) if runs[side] else None
                   for side in (True, False))
        result[stage] = {"boot_ahead": on, "in_turn": off}
        print(f"{stage:<14}{_fmt(on):>26}{_fmt(off):>26}")
    result["boot_speedup"] = spread(ratios, digits=3) if ratios else None
    result["target"] = TARGET
    result["verdict"] = ("not judged" if result["boot_speedup"] is None else
                         "pass" if result["boot_speedup"]["median"] >= TARGET else "fail")
    print(f"boot_speedup (in turn / ahead, per pair): {_fmt(result['boot_speedup'])}")
    print(json.dumps(result))
    return 1 if result["verdict"] == "fail" else 0


def _fmt(s: dict[str, Any] | None) -> str:
    if s is None:
        return "- (not run)"
    return f"{s['median']} ({s['min']}-{s['max']}, n={s['runs']})"


if __name__ == "__main__":
    sys.exit(main())
