"""bench/engine_restart.py: its stage arithmetic (pure, with planted gaps), and its smallest
run (CI's smoke run): one engine SIGKILLed mid-decode in the shipped two-engine job, whose
restart must adopt the warm spare and be seen through to a served rollout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.engine_restart import STAGES, Unmeasured, restart_stages
from tests.paths import REPO

FRESH = {"kill": 100.0, "exit_seen": 100.1, "restart_begun": 102.1, "imports_started": 103.0,
         "imports_done": 105.0, "model_built": 110.0, "warmed": 110.1, "started": 110.5,
         "weights_loaded": 110.6, "dispatched": 111.0, "first_admitted": 111.1}


def test_a_fresh_restarts_stages_add_up_to_its_total() -> None:
    stages = restart_stages(FRESH)
    assert stages["restart_s"] == pytest.approx(11.1)
    assert sum(stages[s] for s in STAGES) == pytest.approx(stages["restart_s"])
    assert stages["model_build"] == pytest.approx(5.0)
    assert stages["restart_delay"] == pytest.approx(2.0)


def test_a_spare_built_before_the_kill_puts_nothing_of_its_start_on_the_path() -> None:
    spare = {**FRESH, "restart_begun": 100.1, "imports_started": 40.0, "imports_done": 42.0,
             "model_built": 47.0, "warmed": 47.1, "started": 100.2}
    stages = restart_stages(spare)
    for stage in ("actor_start", "imports", "model_build", "warm_up"):
        assert stages[stage] == 0.0
    assert stages["ready"] == pytest.approx(0.1)
    assert stages["restart_s"] == pytest.approx(11.1)   # the first rollout came at 111.1


def test_a_backend_without_boot_marks_folds_them_into_ready() -> None:
    vllm = {k: v for k, v in FRESH.items() if k not in
            ("imports_started", "imports_done", "model_built", "warmed", "first_admitted")}
    stages = restart_stages(vllm)
    assert stages["ready"] == pytest.approx(110.5 - 102.1)
    assert stages["restart_s"] == pytest.approx(11.0)


@pytest.mark.parametrize("gap", ["exit_seen", "started", "weights_loaded", "dispatched"])
def test_a_restart_missing_a_required_moment_is_unmeasured(gap: str) -> None:
    """Planted: the replacement never served (no dispatch), was never admitted, never
    started, or its exit was never seen: no figure, an error."""
    with pytest.raises(Unmeasured, match=gap):
        restart_stages({k: v for k, v in FRESH.items() if k != gap})


@pytest.mark.ray
def test_the_smallest_run_adopts_the_spare_and_prints_its_json_line() -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "engine_restart.py"),
                           "--smoke"], capture_output=True, text=True, timeout=400, cwd=REPO,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "torch" and out["kills"] == 1
    assert out["restart_s"]["runs"] == 1 and out["adopted"] == 1, out
    assert set(out["stages_s"]) == set(STAGES)
    assert out["stages_s"]["model_build"]["median"] == 0.0   # the spare built it earlier
