"""The vllm backend's limits on an HF model, checked by the model plan before anything starts:
vLLM's CPU attention refuses heads below 32 only ~30 s into a start, and
``engine.vllm.model_dir`` (the built-in model's GPT-2 directory) has no meaning beside
``model.hf``."""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.modelplan import plan_model
from erlay.actors.model.tiny import write_tiny_model
from tests.paths import REPO

CPU = REPO / "configs" / "cpu.yaml"


def plan(model: Path, *overrides: str) -> dict:
    return plan_model(load_config(CPU, [f"model.hf={model}", *overrides])).spec


def test_vllm_refuses_an_hf_model_with_heads_below_32_in_one_line(tmp_path: Path) -> None:
    small = write_tiny_model(tmp_path / "small", "llama", weights=False, hidden=64, heads=4)
    fits = write_tiny_model(tmp_path / "fits", "qwen2", weights=False, hidden=64, heads=2)
    with pytest.raises(ConfigError, match=r"head size of at least 32.*has 16$"):
        plan(small, "engine.backend=vllm")
    assert plan(small)["hf"] == str(small.resolve())   # the torch engine serves any head
    assert plan(fits, "engine.backend=vllm")["hf"] == str(fits.resolve())
    # The CPU default's shipped model (head_dim 24 in its config) is a torch-engine model.
    with pytest.raises(ConfigError, match=r"has 24$"):
        plan_model(load_config(CPU, ["engine.backend=vllm"]))


def test_vllm_model_dir_beside_an_hf_model_is_refused(tmp_path: Path) -> None:
    fits = write_tiny_model(tmp_path / "fits", "llama", weights=False, hidden=64, heads=2)
    with pytest.raises(ConfigError, match=r"^engine.vllm.model_dir: .*drop model_dir$"):
        plan(fits, "engine.backend=vllm", f"engine.vllm.model_dir={tmp_path}")
