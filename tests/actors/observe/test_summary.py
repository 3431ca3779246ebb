"""summary.md counts trained tokens and the samples not trained as goodput defines them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from erlay.actors.observe.summary import write_summary
from erlay.actors.rundir import RunDir


def rl(step: int, **counts: Any) -> dict[str, Any]:
    return {"phase": "rl", "step": step, "reward_mean": 0.5, "samples": 8, "gen_tokens": 80,
            "sandbox_calls": 0, **counts}


def test_the_summary_counts_trained_tokens_once_per_step_and_not_trained_by_kind(
        tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.append_metrics({"phase": "warm_start", "step": 0})
    run.append_metrics(rl(0, trained_tokens=30, user_errors=1, judge_failed=0, masked_stale=2))
    run.append_metrics(rl(1, trained_tokens=20, user_errors=0, judge_failed=1, masked_stale=0))
    # step 1 fed again after a learner rewind: its last record is the one that counts
    run.append_metrics(rl(1, trained_tokens=25, user_errors=0, judge_failed=3, masked_stale=0))
    text = write_summary(run, "finished", 10.0)
    assert "- trained tokens: 55 (each RL step once)\n" in text
    assert "- samples not trained: 6 (user_errors 1, judge_failed 3, masked_stale 2)\n" in text
    assert "judge_marked" not in text


def test_an_old_run_dirs_judge_marked_is_counted_as_judge_failed(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.append_metrics(rl(0, judge_marked=2, user_errors=1, dropped=4))
    text = write_summary(run, "finished", 10.0)
    assert "- trained tokens: 0 (each RL step once)\n" in text
    assert "- samples not trained: 4 (user_errors 1, judge_failed 2, masked_stale 1)\n" in text
