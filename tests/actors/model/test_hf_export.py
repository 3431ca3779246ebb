"""erlay's policy as a Hugging Face GPT-2 directory: names, layout and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from erlay.actors.model.hf_export import (
    ModelDirError,
    hf_config,
    hf_name,
    hf_state,
    policy_state,
    read_model_dir,
    write_model_dir,
)
from erlay.actors.model.policy import PolicyConfig, PolicyModel, state_to_numpy

CONFIG = PolicyConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=1, d_ff=64, max_seq_len=16)


def state() -> dict[str, np.ndarray]:
    torch.manual_seed(3)
    return state_to_numpy(PolicyModel(CONFIG))


def test_every_policy_tensor_has_a_gpt2_name_and_projections_are_transposed() -> None:
    s = state()
    hf = hf_state(s)
    assert len(hf) == len(s)
    assert hf_name("blocks.1.qkv.weight") == ("transformer.h.1.attn.c_attn.weight", True)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)   # Conv1D: [in, out]
    assert np.array_equal(hf["transformer.h.0.mlp.c_fc.weight"], s["blocks.0.mlp.0.weight"].T)
    assert np.array_equal(hf["lm_head.weight"], s["head.weight"])


def test_round_trip_through_a_model_directory(tmp_path: Path) -> None:
    s = state()
    write_model_dir(tmp_path, CONFIG.to_dict(), s)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["activation_function"] == "gelu"
    shape, back = read_model_dir(tmp_path)
    assert shape == CONFIG.to_dict()
    assert set(back) == set(s)
    for name in s:
        assert np.array_equal(back[name], s[name]), name


def test_tied_checkpoint_gets_its_head_from_the_embeddings() -> None:
    hf = {k: v for k, v in hf_state(state()).items() if k != "lm_head.weight"}
    hf["transformer.h.0.attn.bias"] = np.ones((1, 1, 16, 16))   # a buffer HF stores
    back = policy_state(hf)
    assert np.array_equal(back["head.weight"], back["embed.weight"])


def test_unmappable_names_and_bad_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="no GPT-2 counterpart"):
        hf_name("mtp.0.proj.weight")
    with pytest.raises(ModelDirError, match=r"no config\.json"):
        read_model_dir(tmp_path)
    write_model_dir(tmp_path, CONFIG.to_dict(), state())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config(CONFIG.to_dict()),
                                                       "model_type": "llama"}))
    with pytest.raises(ModelDirError, match="GPT-2 layout only"):
        read_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="not JSON"):
        read_model_dir(tmp_path)
