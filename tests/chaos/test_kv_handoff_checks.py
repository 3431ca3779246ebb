"""The chaos checks of KV hand-off: the opt-in invariant that failed engines' rollouts adopted
their saved caches, and the leftover check that finds caches a run left on the node."""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.actors.config import load_config
from erlay.chaos.gather import kv_leftovers
from erlay.chaos.invariants import (
    INVARIANTS,
    RunObservation,
    check_all,
    kv_handoff_adopted,
    no_orphans,
)
from erlay.chaos.scenario import load_scenario
from tests.paths import REPO as REPO_ROOT


def rl(step: int, paths: dict[str, int] | None) -> dict[str, object]:
    return {"phase": "rl", "step": step, "samples": 8, "kv_handoff": paths or {}}


def test_adoption_passes_and_the_largest_cumulative_count_of_each_path_is_reported() -> None:
    obs = RunObservation(metrics=[rl(0, None), rl(1, {"adopted": 30, "missing": 2}),
                                  rl(2, {"adopted": 31, "missing": 2})])
    verdict = kv_handoff_adopted(obs)
    assert verdict.ok is True and "adopted 31" in verdict.detail


@pytest.mark.parametrize(("paths", "why"), [
    ({"missing": 5, "version": 1}, "no adoption"),
    ({"adopted": 9, "torn": 1}, "torn"),
    (None, "no evidence"),
])
def test_no_adoption_a_torn_cache_or_no_evidence_fails(paths: dict[str, int] | None,
                                                       why: str) -> None:
    verdict = kv_handoff_adopted(RunObservation(metrics=[rl(0, paths), rl(1, paths)]))
    assert verdict.ok is False, why


def test_the_invariant_is_checked_only_where_a_scenario_names_it() -> None:
    obs = RunObservation(metrics=[rl(0, {"adopted": 1})])
    assert "kv_handoff_adopted" not in INVARIANTS
    assert "kv_handoff_adopted" not in [v.name for v in check_all(obs)]
    named = check_all(obs, selected=["kv_handoff_adopted"])
    assert [(v.name, v.ok) for v in named] == [("kv_handoff_adopted", True)]
    scenario = load_scenario(REPO_ROOT / "configs" / "chaos" / "engine-kill-kv-handoff.yaml")
    assert "kv_handoff_adopted" in scenario.invariants
    assert set(INVARIANTS) <= set(scenario.invariants)


def test_caches_a_run_left_on_the_node_are_orphans(tmp_path: Path) -> None:
    cfg = load_config(REPO_ROOT / "configs" / "cpu.yaml",
                      [f"engine.kv_handoff.root={tmp_path}"])
    assert kv_leftovers(cfg, "run-1") == []
    (tmp_path / "run-1" / "node").mkdir(parents=True)
    (tmp_path / "run-1" / "node" / "slab-1-1.kvs").write_bytes(b"x")
    left = kv_leftovers(cfg, "run-1")
    assert len(left) == 1 and "run-1" in left[0]["cmdline"]
    assert no_orphans(RunObservation(orphans=left)).ok is False
    off = load_config(REPO_ROOT / "configs" / "cpu.yaml",
                      [f"engine.kv_handoff.root={tmp_path}", "engine.kv_handoff.enabled=false"])
    assert kv_leftovers(off, "run-1") == []
