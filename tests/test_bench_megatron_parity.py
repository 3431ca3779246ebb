"""bench/gpu/megatron_parity.py on the CPU: with no GPU it says so and prints exactly
``{"gpu": false}`` as its last line, exit 0; ``--cpu-check`` runs the same code at toy size
with megatron's CUDA calls patched (a wiring check of a script only a GPU runs for real) and
passes its own verdict, which fails on a planted bad figure.  No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.conftest import require_megatron
from tests.paths import REPO

SCRIPT = REPO / "bench" / "gpu" / "megatron_parity.py"
sys.path.insert(0, str(SCRIPT.parent))
import megatron_parity  # noqa: E402  (bench/gpu is not a package)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)


def test_megatron_parity_without_a_gpu_prints_gpu_false_last_and_exits_0() -> None:
    proc = run()
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == json.dumps({"gpu": False}) == '{"gpu": false}'
    assert "no GPU present" in lines[0]


def test_megatron_parity_cpu_check_runs_the_gpu_code_and_passes_its_verdict() -> None:
    require_megatron()
    proc = run("--cpu-check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["gpu"] is False and last["passed"] is True and "error" not in last
    assert set(last["models"]) == set(megatron_parity.MODELS)
    for row in last["models"].values():
        assert row["logits_fp32_max_abs"] < 1e-4
        assert row["grad_norm_hf"] > 0
    assert "logits_fp32_max_abs" in proc.stdout   # the table came first


def test_megatron_parity_verdict_fails_on_a_planted_bad_figure() -> None:
    good = {"logits_fp32_max_abs": 1e-6, "logits_bf16_max_abs": 0.004,
            "hf_bf16_max_abs": 0.004, "loss_hf": -0.01, "loss_megatron": -0.01,
            "grad_norm_hf": 0.9, "grad_norm_megatron": 0.9}
    assert megatron_parity.verdict({"m": good})
    assert not megatron_parity.verdict({})
    for key, bad in (("logits_fp32_max_abs", 0.1), ("logits_bf16_max_abs", 0.05),
                     ("loss_megatron", -0.02), ("grad_norm_megatron", 0.95)):
        assert not megatron_parity.verdict({"m": {**good, key: bad}}), key
