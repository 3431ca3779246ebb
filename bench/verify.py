"""Benchmark: how long ``erlay verify RUN_DIR`` takes, and the memory it needs, by run size.

For each size (``--steps`` x ``--rollouts`` rollouts), a run directory is written with
erlay's real writers (the journal with a snapshot and retention at every checkpoint, the
ledger, a checkpoint every 2 steps, events, metrics, summary: ``chaos.selftest.write_run``),
then ``erlay verify RUN_DIR --json`` runs as a user runs it, in a fresh process, from its
launch to its exit (``verify_s``: what the user waits for, the interpreter's start and
imports included), ``--runs`` times; ``peak_rss_mb`` is that process's peak resident memory.
``in_process_s`` is :func:`erlay.chaos.verify.verify` alone (reading and judging, no
start-up).  Every run must exit 0 with every verified invariant PASS: a benchmark of a
verifier that failed is no figure.  Figures are ``{"median", "min", "max", "runs"}``;
``per_100k_rollouts_s`` extrapolates the largest size's in-process median linearly (the
work is linear in records), which says what a week-long run's verify costs.  Prints a
table, then one JSON object as the last line.

    python bench/verify.py [--sizes 50x256,200x256] [--runs 3]
    python bench/verify.py --smoke                       # CI's smoke size: --sizes 3x4 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from erlay.chaos.selftest import write_run
from erlay.chaos.verify import VERIFIED, verify

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # bench/ is on sys.path when run as a script


def measure(steps: int, rollouts: int, runs: int, root: Path) -> dict[str, Any]:
    """Write one run of this size and verify it ``runs`` times, both ways."""
    started = time.perf_counter()
    written = write_run(root, f"bench-{steps}x{rollouts}", steps=steps, rollouts=rollouts)
    write_s = time.perf_counter() - started
    path = written.run_dir.path
    cli, inproc, rss = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "verify",
                               str(path), "--json"], capture_output=True, text=True,
                              timeout=3600)
        cli.append(time.perf_counter() - t0)
        # Children are waited for one at a time, so the maximum so far is this one's or an
        # earlier one's: every run's peak is at most it.
        rss.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        result = json.loads(done.stdout) if done.stdout.strip() else {}
        if done.returncode != 0 or result.get("pass") != len(VERIFIED):
            raise RuntimeError(f"verify of the clean {steps}x{rollouts} run did not pass "
                               f"(exit {done.returncode}): {done.stdout[-800:]}"
                               f"{done.stderr[-800:]}")
        t0 = time.perf_counter()
        ok = verify(path).ok
        inproc.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError(f"in-process verify of {steps}x{rollouts} did not pass")
    journal = sum(f.stat().st_size for f in (path / "journal").iterdir())
    return {"steps": steps, "rollouts": steps * rollouts, "write_s": round(write_s, 2),
            "journal_mb": round(journal / 2**20, 2), "verify_s": spread(cli, digits=3),
            "in_process_s": spread(inproc, digits=3), "peak_rss_mb": round(max(rss), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50x256,200x256",
                        help="comma-separated STEPSxROLLOUTS_PER_STEP")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke size: --sizes 3x4 --runs 1")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.runs = "3x4", 1
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="erlay-bench-verify-") as tmp:
        for steps, rollouts in sizes:
            rows.append(measure(steps, rollouts, args.runs, Path(tmp)))
    print(f"{'rollouts':>9s} {'journal MB':>10s} {'erlay verify s (median, min-max)':>34s} "
          f"{'in-process s':>24s} {'peak RSS MB':>11s}")
    for r in rows:
        v, p = r["verify_s"], r["in_process_s"]
        print(f"{r['rollouts']:9d} {r['journal_mb']:10.2f} "
              f"{v['median']:>14.3f} ({v['min']:.3f}-{v['max']:.3f}) {'':>8s}"
              f"{p['median']:>10.3f} ({p['min']:.3f}-{p['max']:.3f}) {r['peak_rss_mb']:11.1f}")
    largest = rows[-1]
    per_100k = largest["in_process_s"]["median"] * 100_000 / largest["rollouts"]
    print(json.dumps({"sizes": rows, "per_100k_rollouts_s": round(per_100k, 3),
                      "load_avg_start": [round(x, 2) for x in load],
                      "load_avg_end": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
