"""The memory model (erlay.actors.job.memory_model) and `erlay run --dry-run`: exact parameter
counts from the shipped shapes, the bench's measured figure reproduced, a per-role estimate
for every shipped GPU config, and a planted placement that cannot fit refused in one line
(exit 2) with nothing started."""

from __future__ import annotations

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.memory_model import (
    BYTES_PER_PARAM,
    ModelShape,
    activation_bytes,
    model_shape,
    plan,
)
from erlay.supervisor.cli import main
from tests.paths import REPO

CONFIGS = REPO / "configs"
GPU_CONFIGS = ["qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-0.5b-gsm8k-split.yaml",
               "qwen2.5-1.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k.yaml"]


@pytest.mark.parametrize(("name", "params"), [("qwen2.5-0.5b-gsm8k.yaml", 494_032_768),
                                              ("qwen2.5-1.5b-gsm8k.yaml", 1_543_714_304),
                                              ("qwen2.5-7b-gsm8k.yaml", 7_615_616_512)])
def test_parameter_counts_are_exact_from_the_shipped_shapes(name: str, params: int) -> None:
    assert model_shape(load_config(CONFIGS / name)).params == params


def test_bytes_per_parameter_follow_the_precision() -> None:
    assert {k: v.total for k, v in BYTES_PER_PARAM.items()} == \
        {"fp32": 16, "bf16-mixed": 18, "bf16": 8}


def test_activations_reproduce_the_benchs_full_depth_measurement() -> None:
    """bench/learner_memory.py: Qwen2-0.5B, fp32, micro_batch_tokens 2048, 24 layers:
    6,137,884,672 bytes above the resident state (docs/scaling.md)."""
    shape = ModelShape(params=494_032_768, hidden=896, layers=24, kv_heads=2, head_dim=64,
                       largest_unit_params=0)
    predicted = activation_bytes(shape, 2048, "fp32", False, 256)
    assert abs(predicted - 6_137_884_672) / 6_137_884_672 < 0.01
    assert activation_bytes(shape, 2048, "fp32", True, 256) < predicted / 4


def test_colocated_roles_add_up_on_their_one_gpu() -> None:
    p = plan(load_config(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml"))
    assert p.colocated and p.per_gpu == sum(r.bytes for r in p.roles)
    assert p.gpu_bytes is not None and p.per_gpu <= p.gpu_bytes


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_dry_run_prints_every_role_and_starts_nothing(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    import ray
    assert main(["run", "--dry-run", str(CONFIGS / name)]) == 0
    out = capsys.readouterr().out
    assert "learner rank" in out and "engine" in out and "busiest GPU" in out, out
    assert not ray.is_initialized()


def test_a_placement_that_cannot_fit_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--dry-run", str(CONFIGS / "qwen2.5-7b-gsm8k.yaml"),
                 "placement.gpu_memory_gib=24"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "placement.gpu_memory_gib 24" in err, err
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        plan(load_config(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml",
                         ["engine.vllm.engine_args.gpu_memory_utilization=0.9"]))
