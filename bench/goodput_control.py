"""Benchmark: goodput with the goodput controller on vs off, when the fleet degrades.

Four scenarios on the CPU jobs with 2 engines, each run with ``control.enabled`` true and
false in interleaved pairs (on-off, off-on, ...: the machine's drift falls on both sides):

- ``slow_engine`` (``configs/chaos/control-slow-engine.yaml``): engine-0's decode steps take
  4x as long for the whole run;
- ``flaky_sandbox`` (``control-flaky-sandbox.yaml``): the tool-use job, 20% of sandbox runs
  hang until their wall deadline;
- ``long_tail`` (``control-long-tail.yaml``): 5% of rollouts run 10x longer;
- ``fault_free``: the slow_engine job with nothing injected.

Goodput is erlay's one definition (:mod:`erlay.actors.observe.goodput`): trained tokens per
second of RL wall time.  ``ratio`` = goodput on / goodput off, per pair; the median, min and
max over the pairs.  ``lost`` and ``trained_twice`` are summed over every run (journal vs
ledger, as ``erlay verify`` judges them); a run that did not finish is an error, not a
figure.  Prints a table, then one JSON line:

    {"scenarios": {NAME: {"ratio": {median, min, max, runs}, "on": {...}, "off": {...},
                          "lost": N, "trained_twice": N, "actions": {...}}}, "load": [...]}

    python bench/goodput_control.py [--pairs 3] [--scenarios slow_engine,fault_free]
    python bench/goodput_control.py --smoke     # CI: one short pair of slow_engine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from erlay.chaos.records import lost_rollouts, trained_twice
from erlay.chaos.report import goodput, goodput_wall_s
from erlay.chaos.runner import RunOutcome, run_once
from erlay.chaos.scenario import Scenario, load_scenario

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # bench/ is on sys.path when run as a script

SCENARIOS = {"slow_engine": "control-slow-engine", "flaky_sandbox": "control-flaky-sandbox",
             "long_tail": "control-long-tail", "fault_free": "control-slow-engine"}
TARGETS = {"slow_engine": 1.3, "flaky_sandbox": 1.3, "long_tail": 1.3, "fault_free": 0.98}


def scenario_for(name: str, smoke: bool) -> Scenario:
    scenario = load_scenario(SCENARIOS[name])
    if smoke:   # the smallest size: a few steps, a short warm start
        scenario = scenario.model_copy(update={"overrides": (
            *scenario.overrides, "run.steps=6", "warm_start.steps=10",
            "checkpoint.every_steps=3")})
    return scenario


def one_run(scenario: Scenario, name: str, control: bool, parent: Path,
            index: int) -> dict[str, Any]:
    """One job; its goodput, losses and the controller's actions.  Raises when the job
    did not finish: a figure of a broken run is no figure."""
    on = "on" if control else "off"
    scenario = scenario.model_copy(update={"overrides": (
        *scenario.overrides, f"control.enabled={str(control).lower()}")})
    outcome: RunOutcome = run_once(scenario, None, parent, f"{name}-{on}-{index}",
                                   inject=name != "fault_free")
    if outcome.status != "finished":
        raise RuntimeError(f"{name} ({on}, pair {index}) did not finish: {outcome.status}: "
                           f"{outcome.reason}")
    obs = outcome.observation
    twice = trained_twice(obs)
    if twice is None:
        raise RuntimeError(f"{name} ({on}, pair {index}): the ledger cannot say what was "
                           "trained twice")
    actions = Counter(str(m.get("kind")) for m in obs.metrics if m.get("phase") == "control")
    wall = goodput_wall_s(obs)
    return {"goodput": goodput(obs.metrics, wall), "rl_wall_s": wall,
            "steps": sum(m.get("phase") == "rl" for m in obs.metrics),
            "lost": len(lost_rollouts(obs)), "trained_twice": len(twice),
            "actions": dict(actions), "run_dir": str(outcome.run_dir.path)}


def measure(name: str, pairs: int, parent: Path, smoke: bool,
            say: Any = print) -> dict[str, Any]:
    scenario = scenario_for(name, smoke)
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    ratios = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for control in order:
            got[control] = one_run(scenario, name, control, parent, i)
            runs[control].append(got[control])
            say(f"  {name} pair {i} control {'on ' if control else 'off'}: goodput "
                f"{got[control]['goodput']:.1f} tokens/s over {got[control]['rl_wall_s']:.1f} s"
                f", actions {got[control]['actions']}")
        ratios.append(got[True]["goodput"] / got[False]["goodput"])
    every = runs[True] + runs[False]
    actions: Counter[str] = Counter()
    for run in runs[True]:
        actions.update(run["actions"])
    return {"ratio": spread(ratios, digits=4),
            "on": spread([r["goodput"] for r in runs[True]], digits=1),
            "off": spread([r["goodput"] for r in runs[False]], digits=1),
            "lost": sum(r["lost"] for r in every),
            "trained_twice": sum(r["trained_twice"] for r in every),
            "actions": dict(actions),
            "actions_when_off": sum(sum(r["actions"].values()) for r in runs[False])}


def ceiling(results: dict[str, Any]) -> None:
    """What the controller could gain at most, where the bench measured it: slow_engine's
    job fault-free (``fault_free`` runs it) over slow_engine with the controller off; and
    the share of what the fault cost that the controller won back.  Added to slow_engine's
    figures, printed under the table."""
    slow, clean = results.get("slow_engine"), results.get("fault_free")
    if slow is None or clean is None:
        return
    off, on, best = slow["off"]["median"], slow["on"]["median"], clean["off"]["median"]
    slow["ceiling"] = round(best / off, 4)
    slow["recovered"] = round((on - off) / (best - off), 4) if best > off else None
    print(f"slow_engine: the most any routing could gain here (fault-free / off) is "
          f"{slow['ceiling']:.3f}; the controller won back {slow['recovered']} of the loss")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size: one short pair of slow_engine (CI)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    logging.getLogger("erlay").setLevel(logging.ERROR)
    names = ["slow_engine"] if args.smoke else args.scenarios.split(",")
    pairs = 1 if args.smoke else args.pairs
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    parent = Path(tempfile.mkdtemp(prefix="erlay-goodput-control-"))
    load = [round(os.getloadavg()[0], 2)]
    results = {}
    for name in names:
        print(f"{name}: {pairs} pair(s)", flush=True)
        results[name] = measure(name, pairs, parent, args.smoke,
                                say=lambda line: print(line, flush=True))
        load.append(round(os.getloadavg()[0], 2))
    print(f"\n{'scenario':14s} {'ratio median (min-max)':>24s} {'target':>7s} "
          f"{'on tok/s':>9s} {'off tok/s':>9s} {'lost':>5s} {'twice':>5s}  actions (on)")
    for name, r in results.items():
        ratio = r["ratio"]
        print(f"{name:14s} {ratio['median']:>9.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"
              f"{'':>3s} {'>= ' + str(TARGETS[name]):>7s} {r['on']['median']:>9.1f} "
              f"{r['off']['median']:>9.1f} {r['lost']:>5d} {r['trained_twice']:>5d}  "
              f"{r['actions']}")
    ceiling(results)
    print(f"load average (1 min) at start and after each scenario: {load}; runs in {parent}")
    print(json.dumps({"scenarios": results, "load": load, "pairs": pairs,
                      "smoke": args.smoke}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
