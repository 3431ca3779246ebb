"""bench/learner_scale.py at its smallest size (``--smoke``, a tiny model): its last line is
the JSON the issue names, two fsdp2 ranks each hold about half of what one holds, the sharded
step is equivalent to one whole learner's, and a planted drift on one rank makes
``equivalent`` false."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_bench(*extra: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "learner_scale.py"),
                           "--smoke", *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_ranks_hold_half_and_take_the_whole_learners_step() -> None:
    result = run_bench()
    assert set(result) == {"ranks_1", "ranks_2", "equivalent"}
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        one, two = result["ranks_1"][key], result["ranks_2"][key]
        assert one > 0 and 0.45 * one <= two <= 0.55 * one, (key, one, two)
    assert result["equivalent"] is True


def test_a_drifted_rank_makes_the_bench_report_not_equivalent() -> None:
    assert run_bench("--perturb", "1e-3")["equivalent"] is False
