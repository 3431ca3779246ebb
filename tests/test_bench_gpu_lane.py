"""bench/gpu/lane.py, the GPU lane, checked on the CPU at toy size: its JSON's shape, that it
needs only what the device machine has plus the shipped wheels, and that a failing phase
(planted, missing a module, past its budget) is null with its error, in ``failures``, with
a non-zero exit.  No timing is asserted: the figures are the lane's business."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO

LANE = REPO / "bench" / "gpu" / "lane.py"
sys.path.insert(0, str(LANE.parent))
import lane  # noqa: E402  (bench/gpu is not a package)

FIGURES = {"mtp": {"speedup", "best_k", "acceptance", "greedy_identical", "wall_s"},
           "checkpoint": {"exposed_ratio", "exposed_s", "sync_s", "persist_s", "restored",
                          "state_mb"},
           "learner": {"step_s", "first_step_s", "tokens_per_s", "model_params",
                       "loss_finite", "shipped"},
           "colocated": {"stages", "kv_cache_gib", "refit_tensors", "all_finished"}}


def run_lane(tmp_path: Path, *args: str, allow: str | None = "base",
             env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Run the lane on the CPU at toy size; (exit status, last stdout line, file)."""
    out = tmp_path / "lane.json"
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", lane.ALLOW_ENV)}
    environ.update(env or {})
    if allow:
        environ[lane.ALLOW_ENV] = allow
    proc = subprocess.run([sys.executable, str(LANE), "--device", "cpu", "--size", "tiny",
                           "--workdir", str(tmp_path), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=environ)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc.returncode, last, json.loads(out.read_text())


def test_cpu_smoke_runs_every_phase_with_only_the_device_machines_modules(
        tmp_path: Path) -> None:
    code, last, written = run_lane(tmp_path)
    assert code == 0, last["errors"]
    assert last == written
    assert last["failures"] == [] and last["errors"] == {} and last["passed"] is True
    for phase, keys in FIGURES.items():
        assert keys <= set(last[phase]), (phase, sorted(last[phase]))
    # Memory is a CUDA figure: null on the CPU, every other figure present.
    cuda_only = {"learner_shipped_peak_gib", "colocated_kv_cache_gib"}
    assert all(v is not None for k, v in last["figures"].items() if k not in cuda_only), \
        last["figures"]
    assert last["learner"]["shipped"]["tokens_per_s"] > 0
    assert last["mtp"]["greedy_identical"] is True
    assert last["checkpoint"]["restored"] is True
    assert last["learner"]["loss_finite"] is True
    allowed = set(lane.DEVICE_BASE) | set(lane.WHEELS.values()) | {"cython_runtime"}
    assert set(last["modules"]) <= allowed, set(last["modules"]) - allowed
    assert "ray" not in last["modules"]


def test_planted_failure_is_null_with_its_error_and_fails_the_lane(tmp_path: Path) -> None:
    code, last, written = run_lane(tmp_path, "--phases", "learner,checkpoint",
                                   "--plant-failure", "learner")
    assert code == 1 and last == written
    assert last["learner"] is None and "planted failure" in last["errors"]["learner"]
    assert last["failures"] == ["learner"] and last["passed"] is False
    assert last["figures"]["learner_step_s"] is None
    assert last["checkpoint"]["restored"] is True   # the other phase still ran


def test_a_module_the_device_machine_lacks_fails_its_phase_naming_it(tmp_path: Path) -> None:
    code, last, _ = run_lane(tmp_path, "--phases", "checkpoint",
                             allow="base-minus:nvidia_resiliency_ext")
    assert code == 1 and last["checkpoint"] is None
    assert "nvidia_resiliency_ext" in last["errors"]["checkpoint"]


def test_a_phase_past_its_budget_is_killed_and_recorded(tmp_path: Path) -> None:
    code, last, _ = run_lane(tmp_path, "--phases", "checkpoint", "--budget", "checkpoint=0.2")
    assert code == 1 and last["checkpoint"] is None
    assert "timed out" in last["errors"]["checkpoint"]


def test_run_sh_runs_the_lane_and_ends_with_its_json(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if k != lane.ALLOW_ENV}
    environ.update(PYTHON=sys.executable, OUT=str(tmp_path), TMPDIR=str(tmp_path),
                   ERLAY_LANE_SITE=str(tmp_path / "site"))
    proc = subprocess.run(["bash", str(REPO / "bench/gpu/run.sh"), "--device", "cpu",
                           "--size", "tiny", "--phases", "checkpoint"],
                          capture_output=True, text=True, timeout=600, env=environ)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "gpu_lane.json").read_text())
    assert last["checkpoint"]["restored"] is True


@pytest.mark.parametrize("allow", [None, "base"])
def test_ray_and_vllm_are_hidden_and_the_rest_found(allow: str | None) -> None:
    hide = lane.HideModules([importlib.machinery.PathFinder], lane.hidden_rule(allow))
    assert hide.find_spec("ray") is None and hide.find_spec("vllm.engine") is None
    assert hide.find_spec("json") is not None and hide.find_spec("torch") is not None
    assert (hide.find_spec("pandas") is None) == (allow == "base")  # not on the device


def test_every_shipped_wheel_is_pinned() -> None:
    assert all("==" in wheel for wheel in lane.WHEELS)
    proc = subprocess.run([sys.executable, str(LANE), "--print-wheels"], capture_output=True,
                          text=True, check=True)
    assert proc.stdout.split() == list(lane.WHEELS)


def test_run_sh_without_cuda_says_gpu_false_and_exits_0(tmp_path: Path) -> None:
    """`bash bench/gpu/run.sh` as written, on a machine without a GPU (this one): nothing is
    measured and nothing failed.  The refusal is for a missing GPU only: the tests above run
    the same lane's phases with ``--device cpu``."""
    env = {k: v for k, v in os.environ.items() if k != lane.ALLOW_ENV}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path), TMPDIR=str(tmp_path),
               ERLAY_LANE_SITE=str(tmp_path / "site"))
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "run.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {"gpu": False}, lines[-3:]
    assert "lane: no GPU present" in done.stdout
    assert not (tmp_path / "gpu_lane.json").exists()
