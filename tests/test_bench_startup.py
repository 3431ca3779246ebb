"""bench/startup.py's stage arithmetic, on run directories written here (the benchmark's
runs themselves take minutes: `python bench/startup.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import startup


def _run_dir(tmp_path: Path, *, up: bool = True, rl: bool = True) -> Path:
    events = [{"supervisor": "erlay", "child": "learner", "context": "start",
               "reason": "started", "time": 1005.0}]
    if up:
        events.append({"supervisor": "erlay", "child": "rollout", "context": "start",
                       "reason": "started", "time": 1012.0})
    metrics = [{"phase": "checkpoint", "time": 12.5, "started_at": 1000.0}]
    if rl:
        metrics.append({"phase": "rl", "time": 14.0, "started_at": 1000.0})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return tmp_path


def test_stages_run_from_the_launch_to_the_tree_up_and_the_first_rl_step(tmp_path: Path
                                                                          ) -> None:
    assert startup.stages(994.0, _run_dir(tmp_path)) == {
        "ray_s": 6.0, "boot_s": 12.0, "first_step_s": 20.0}


@pytest.mark.parametrize("missing", ["up", "rl"])
def test_a_run_whose_tree_never_came_up_or_never_stepped_is_an_error(tmp_path: Path,
                                                                     missing: str) -> None:
    with pytest.raises(RuntimeError, match="never came up or no RL step"):
        startup.stages(994.0, _run_dir(tmp_path, **{missing: False}))
