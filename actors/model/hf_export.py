"""erlay's policy as a Hugging Face GPT-2 model directory, so vLLM can serve it.

:class:`~erlay.actors.model.policy.PolicyModel` is GPT-2's architecture: pre-LayerNorm blocks,
learned positions, a fused QKV projection and an exact-GELU MLP.  Only the parameter names differ,
and HF's GPT-2 stores its 2-D projection weights transposed (``Conv1D``).  The head is
untied (``tie_word_embeddings: false``), which vLLM's GPT-2 supports.

- :func:`hf_state` maps a policy state dict (numpy arrays by erlay name) to HF names and
  layout; it is what a weight update sends to a vLLM engine.
- :func:`write_model_dir` writes ``config.json`` and ``model.safetensors``: a model directory
  vLLM loads with ``skip_tokenizer_init=True`` (erlay tokenizes; prompts are token ids).
- :func:`policy_state` is the inverse, to start the learner from such a directory.

Pure functions over numpy arrays; no torch, no vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from erlay.supervisor.errors import ErlayError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# erlay name pattern -> (HF name template, transposed in HF's Conv1D layout)
_BLOCK_MAP: dict[str, tuple[str, bool]] = {
    "norm1.weight": ("ln_1.weight", False), "norm1.bias": ("ln_1.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True), "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True), "proj.bias": ("attn.c_proj.bias", False),
    "norm2.weight": ("ln_2.weight", False), "norm2.bias": ("ln_2.bias", False),
    "mlp.0.weight": ("mlp.c_fc.weight", True), "mlp.0.bias": ("mlp.c_fc.bias", False),
    "mlp.2.weight": ("mlp.c_proj.weight", True), "mlp.2.bias": ("mlp.c_proj.bias", False),
}
_TOP_MAP: dict[str, str] = {
    "embed.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


class ModelDirError(ErlayError, ValueError):
    """A model directory or state dict cannot be mapped between erlay and HF GPT-2."""


def hf_name(name: str) -> tuple[str, bool]:
    """The HF GPT-2 name of erlay parameter ``name`` and whether HF stores it transposed."""
    if name in _TOP_MAP:
        return _TOP_MAP[name], False
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _BLOCK_MAP:
        target, transposed = _BLOCK_MAP[match.group(2)]
        return f"transformer.h.{match.group(1)}.{target}", transposed
    raise ModelDirError(f"parameter {name!r} has no GPT-2 counterpart; the vllm backend "
                        "serves erlay's policy layout only (see actors/hf_export.py)")


def hf_state(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``state`` (erlay names) in HF GPT-2 names and layout, as contiguous float arrays."""
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name.startswith("mtp."):
            continue   # GPT-2 has no MTP heads; the torch engine's drafts are not served
        target, transposed = hf_name(name)
        array = np.asarray(value)
        out[target] = np.ascontiguousarray(array.T if transposed else array)
    return out


def policy_state(hf: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of :func:`hf_state`.  A tied HF checkpoint (no ``lm_head.weight``) gets the
    head copied from the embeddings.  Buffers HF stores (``attn.bias``) are ignored."""
    inverse = {}
    for name in _TOP_MAP:
        inverse[_TOP_MAP[name]] = (name, False)
    layers = {int(m.group(1)) for k in hf if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    for i in layers:
        for ours, (theirs, transposed) in _BLOCK_MAP.items():
            inverse[f"transformer.h.{i}.{theirs}"] = (f"blocks.{i}.{ours}", transposed)
    out: dict[str, np.ndarray] = {}
    for name, value in hf.items():
        key = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
        if key.endswith((".attn.bias", ".attn.masked_bias")) and key not in inverse:
            continue
        if key not in inverse:
            raise ModelDirError(f"HF tensor {name!r} has no counterpart in erlay's policy")
        ours, transposed = inverse[key]
        array = np.asarray(value)
        out[ours] = np.ascontiguousarray(array.T if transposed else array)
    if "head.weight" not in out and "embed.weight" in out:
        out["head.weight"] = out["embed.weight"].copy()
    return out


def hf_config(model_config: Mapping[str, Any], *, eos_id: int = 2, bos_id: int = 1) -> dict:
    """The ``config.json`` of a GPT-2 with erlay's policy shape (see PolicyConfig)."""
    d_model = int(model_config.get("d_model", 128))
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": int(model_config["vocab_size"]),
        "n_positions": int(model_config.get("max_seq_len", 96)),
        "n_embd": d_model, "n_layer": int(model_config.get("n_layers", 2)),
        "n_head": int(model_config.get("n_heads", 4)),
        "n_inner": int(model_config.get("d_ff", 512)),
        "activation_function": "gelu",   # exact GELU, as nn.GELU()
        "layer_norm_epsilon": 1e-5,      # nn.LayerNorm's default
        "tie_word_embeddings": False,    # erlay's head is its own matrix
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def write_model_dir(path: str | Path, model_config: Mapping[str, Any],
                    state: Mapping[str, Any]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``state`` under ``path``.

    Written to temporary names and renamed, so a reader (an engine restarting meanwhile)
    never sees half a model.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.float32) for k, v in hf_state(state).items()}
    tmp_weights = path / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_weights.replace(path / WEIGHTS_FILE)
    tmp_config = path / f".{CONFIG_FILE}.tmp"
    tmp_config.write_text(json.dumps(hf_config(model_config), indent=2) + "\n")
    tmp_config.replace(path / CONFIG_FILE)
    return path


def read_model_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(erlay model config, erlay state) of a GPT-2 directory; a clear error otherwise."""
    from safetensors.numpy import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ModelDirError(f"model directory {path} has no {f.name}")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{config_file}: not JSON ({exc})") from None
    if cfg.get("model_type") != "gpt2":
        raise ModelDirError(f"{config_file}: model_type {cfg.get('model_type')!r}; erlay's "
                            "learner trains the GPT-2 layout only")
    model_config = {"vocab_size": cfg["vocab_size"], "d_model": cfg["n_embd"],
                    "n_layers": cfg["n_layer"], "n_heads": cfg["n_head"],
                    "d_ff": cfg.get("n_inner") or 4 * cfg["n_embd"],
                    "max_seq_len": cfg["n_positions"], "mtp_heads": 0}
    return model_config, policy_state(load_file(str(weights_file)))
