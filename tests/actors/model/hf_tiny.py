"""Tiny Hugging Face model directories shared by the HF tests (built locally, never
downloaded): one per architecture, written once per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from erlay.actors.model.tiny import ARCHITECTURES, write_tiny_model

# Small enough that every architecture's tests stay well under a second each on one core.
SHAPE: dict[str, Any] = {"hidden": 32, "layers": 2, "heads": 2, "ffn": 64, "max_positions": 64}


def tiny_dirs(factory: pytest.TempPathFactory, *, seed: int = 0,
              **shape: Any) -> dict[str, Path]:
    """One saved model directory (weights, tokenizer, generation config) per architecture."""
    root = factory.mktemp("tiny-hf")
    return {arch: write_tiny_model(root / arch, arch, seed=seed, **{**SHAPE, **shape})
            for arch in ARCHITECTURES}


def spec(path: Path, **kw: Any) -> dict[str, Any]:
    """A ``model_config`` dict for an HF directory, as the job's model plan builds it."""
    return {"hf": str(path), "init": "pretrained", "dtype": "float32",
            "trust_remote_code": False, "lora": None, "mtp_heads": 0, "max_seq_len": None,
            **kw}
