"""``erlay chaos run --all``: every shipped scenario, one after another, and one table.

Each scenario runs as :func:`erlay.chaos.runner.run_scenario` runs it alone, writing its own
report; the table then has one row per scenario: its verdict, its verdicts counted
PASS/FAIL/N/A, how the run ended, the faults injected, detected and recovered, the rollouts
lost (journal) and trained twice (learner ledger), the orphans, goodput (trained tokens/s)
and its ratio to the fault-free run, and the wall time.
The table is printed and written to ``<parent>/chaos-all.md``.  The exit code is 0 only when
every scenario passed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from erlay.chaos.records import lost_rollouts, trained_twice
from erlay.chaos.runner import ROOT, ChaosResult, run_scenario
from erlay.chaos.scenario import list_scenarios, load_scenario

HEADER = ["scenario", "verdict", "pass/fail/N/A", "run", "faults", "detected", "recovered",
          "rollouts lost", "trained twice", "orphans", "goodput (tok/s)", "vs fault-free",
          "failed invariants", "wall (s)"]


def _count(items: list[str] | None) -> str:
    return "no ledger" if items is None else str(len(items))


def row(result: ChaosResult) -> list[Any]:
    """One line of the table for one scenario's result."""
    report, obs = result.report, result.run.observation
    failed = [v.name for v in result.verdicts if v.ok is False]
    good = report["goodput"]
    ratio = good.get("goodput_vs_fault_free")
    counts = report["verdicts"]   # N/A apart: it proved nothing, and is never a pass
    return [result.scenario, "PASS" if result.ok else "FAIL",
            f"{counts['pass']}/{counts['fail']}/{counts['na']}", result.run.status,
            len(report["faults"]), report["detected"]["count"], report["recovered"]["count"],
            len(lost_rollouts(obs)), _count(trained_twice(obs)), len(obs.orphans),
            f"{good['tokens_per_s']:.0f}", "-" if ratio is None else f"{ratio:.2f}",
            ", ".join(failed) or "-", f"{result.run.wall_s:.0f}"]


def table(rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def run_all(*, smoke_only: bool = False, with_baselines: bool = True,
            parent: Path | None = None, say: Any = print) -> int:
    """Run every shipped scenario (or the smoke subset); print and write the table."""
    parent = Path(parent or ROOT / "runs" / "chaos")
    names = [name for name, _, smoke in list_scenarios() if smoke or not smoke_only]
    rows: list[list[Any]] = []
    started = time.time()
    for i, name in enumerate(names, 1):
        say(f"=== chaos {i}/{len(names)}: {name}")
        result = run_scenario(load_scenario(name), parent=parent, say=say,
                              with_baselines=with_baselines)
        rows.append(row(result))
        say("    " + " | ".join(str(c) for c in rows[-1]))
    text = table(rows)
    parent.mkdir(parents=True, exist_ok=True)
    out = parent / "chaos-all.md"
    out.write_text(f"# erlay chaos run --all{' --smoke' if smoke_only else ''}\n\n{text}\n\n"
                   f"{len(rows)} scenarios in {time.time() - started:.0f} s\n",
                   encoding="utf-8")
    say(text)
    passed = sum(r[1] == "PASS" for r in rows)
    say(f"erlay: chaos --all: {passed} of {len(rows)} scenarios passed; table {out}")
    return 0 if passed == len(rows) else 1
