"""Preflight of the new learner backends: a megatron config the model or this machine cannot
run, or fsdp2/megatron on the built-in model, is refused in one line before anything starts
(``erlay run`` exits 2 with no run directory), and a valid one passes the same checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.modelplan import plan_model
from erlay.actors.job.preflight import check_backend
from erlay.actors.job.preflight_learner import backend_problem
from erlay.actors.model.hf import load_hf_config
from erlay.actors.model.tiny import write_tiny_model
from tests.paths import REPO

CPU = REPO / "configs" / "cpu.yaml"   # tiny Qwen2: 4 heads, 4 key-value heads, 2 layers


def megatron(tp: int = 1, pp: int = 1, dp: int = 1, extra: tuple[str, ...] = ()
             ) -> list[str]:
    return ["learner.backend=megatron", "learner.device=cuda", "learner.num_gpus=1",
            f"learner.num_ranks={tp * pp * dp}", f"learner.megatron.tensor_parallel={tp}",
            f"learner.megatron.pipeline_parallel={pp}", f"learner.megatron.data_parallel={dp}",
            *extra]


def problem(overrides: list[str], *, cuda: bool = True, installed: bool = True,
            attached: bool = False) -> str | None:
    cfg = load_config(CPU, overrides)
    plan = plan_model(cfg)
    hf = load_hf_config(Path(plan.spec["hf"])) if plan.is_hf else None
    return backend_problem(cfg, hf, cuda_available=cuda, megatron_installed=installed,
                           attached=attached)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": write_tiny_model(root / "gpt2", "gpt2", weights=False),
            "gqa": write_tiny_model(root / "gqa", "llama", weights=False, hidden=64, heads=4,
                                    kv_heads=2, ffn=128),
            "scaled": _scaled_rope(write_tiny_model(root / "scaled", "llama", weights=False)),
            "tied": _tied(write_tiny_model(root / "tied", "llama", weights=False))}


def _tied(path: Path) -> Path:
    import json
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


def _scaled_rope(path: Path) -> Path:
    import json
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_megatron_preflight_passes_a_valid_config_on_a_machine_with_cuda(
        models: dict[str, Path]) -> None:
    assert problem(megatron(tp=4)) is None
    assert problem(megatron(tp=2, dp=2, extra=(f"model.hf={models['gqa']}",))) is None
    assert problem(megatron(pp=2)) is None   # untied (tiny-qwen2): pipeline parallel runs
    assert problem(megatron(tp=2, pp=2, dp=2, extra=(f"model.hf={models['gqa']}",))) is None
    assert problem(["learner.backend=fsdp2", "learner.num_ranks=2"]) is None
    assert problem([]) is None


@pytest.mark.parametrize("case,overrides,message", [
    ("tp_heads", megatron(tp=3), "tensor_parallel 3 must divide the attention heads (4)"),
    ("tp_kv_heads", megatron(tp=4, extra=("model.hf=<gqa>",)),
     "must divide the attention heads (4) and the key-value heads (2)"),
    ("pp_layers", megatron(pp=4), "pipeline_parallel 4 must divide the layer count (2)"),
    ("pp_tied", megatron(pp=2, extra=("model.hf=<tied>",)),
     "pipeline_parallel > 1 with tied input and output embeddings"),
    ("gpt2", megatron(extra=("model.hf=<gpt2>",)),
     "converts Llama- and Qwen2-style models (llama, qwen2); this model is 'gpt2'"),
    ("rope_scaling", megatron(extra=("model.hf=<scaled>",)), "rope scaling 'linear'"),
    ("lora", megatron(extra=("model.lora={r: 4}",)), "it takes no model.lora"),
    ("builtin_megatron", megatron(extra=("model.hf=null", "model.init=pretrained")),
     "learner.backend megatron shards a Hugging Face model"),
    ("builtin_fsdp2", ["learner.backend=fsdp2", "model.hf=null", "model.init=pretrained"],
     "learner.backend fsdp2 shards a Hugging Face model"),
])
def test_megatron_preflight_refuses_in_one_line(models: dict[str, Path], case: str,
                                                overrides: list[str], message: str) -> None:
    for name, path in models.items():
        overrides = [o.replace(f"<{name}>", str(path)) for o in overrides]
    found = problem(overrides)
    assert found is not None and message in found and "\n" not in found, found


def test_megatron_preflight_needs_cuda_or_an_attached_cluster_and_the_extra() -> None:
    assert "torch sees no CUDA device" in (problem(megatron(), cuda=False) or "")
    assert problem(megatron(), cuda=False, attached=True) is None   # GPU nodes elsewhere
    assert "pip install 'erlay[megatron]'" in (problem(megatron(), installed=False) or "")


def test_megatron_preflight_is_wired_into_preflight_on_this_cpu_machine() -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        cfg = load_config(CPU, megatron())
        check_backend(cfg, plan_model(cfg))


def erlay_run(tmp_path: Path, *overrides: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "erlay.supervisor.cli", "run", str(CPU), *overrides,
         f"run.storage={tmp_path}", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120)


def test_megatron_erlay_run_with_tp_not_dividing_the_heads_exits_2_with_one_line(
        tmp_path: Path) -> None:
    result = erlay_run(tmp_path, *megatron(tp=3))
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "tensor_parallel 3 must divide the attention heads (4)" in result.stderr
    assert list(tmp_path.iterdir()) == [], "no run directory before the checks pass"
