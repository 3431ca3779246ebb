"""bench/algorithms.py at its smallest size (CI): it runs, prints a table and then one JSON
line keyed by objective, and the runs it made pass ``erlay verify``.

The smoke runs the two objectives whose paths through the job differ most from grpo's:
dapo (the coordinator drops and refills groups, and consumes the dropped with weight 0) and
reinforce_pp (per-token advantages, whitened over the batch).  The other four differ only in
the learner's pure functions, which tests/actors/learner/test_objectives.py runs through a
real learner step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from erlay.chaos.verify import verify
from tests.paths import REPO


def test_the_smallest_size_prints_a_table_then_one_json_line_and_verifies() -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "algorithms.py"), "--smoke",
                           "--only", "dapo,reinforce_pp"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[1].startswith("objective") and len(lines) == 5, proc.stdout
    figures = json.loads(lines[-1])
    assert sorted(figures) == ["dapo", "reinforce_pp"]
    for name, fig in figures.items():
        assert fig["status"] == "finished" and fig["steps"] == 2, (name, fig)
        assert {"reward_start", "reward_end", "wall_s", "load_avg"} <= set(fig)
    # Two warm-start steps leave the policy nearly random: most groups score all 0, so
    # dynamic sampling drops and refills.
    assert figures["dapo"]["filtered_samples"] > 0 and figures["dapo"]["fill_rounds"] > 0
    assert figures["reinforce_pp"]["filtered_samples"] == 0
    parent = Path(lines[0].split(" under ", 1)[1].split(";", 1)[0])
    try:
        runs = sorted(p for p in parent.iterdir() if (p / "config.yaml").is_file())
        assert len(runs) == 2, runs
        for run in runs:
            result = verify(run)
            assert result.ok, result.to_dict()
            if run.name.startswith("dapo"):
                exactly = next(v for v in result.verdicts if v.name == "exactly_once")
                assert "consumed with weight 0" in exactly.detail, exactly
    finally:
        shutil.rmtree(parent, ignore_errors=True)
