"""LoRA adapters on an HF policy, through ``peft``.

- :func:`wrap_lora` puts adapters on the model (``model.lora: {r, alpha, dropout,
  target_modules}``); only the adapters train, the base weights are frozen.
- :func:`merged_state` gives the HF-named state dict with each adapter merged into its base
  weight (``W + scale * B @ A``), without touching the model: what an engine serving the
  plain model loads on every weight update.
- :func:`adapter_state` gives the adapter tensors alone, under peft's saved names, for
  ``erlay export --adapter``.

Contract: pure functions of the model; no I/O.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from erlay.actors.model.errors import ModelLoadError

DEFAULT_TARGETS = "all-linear"


def lora_config(spec: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` for a ``model.lora`` mapping."""
    from peft import LoraConfig
    targets = spec.get("target_modules") or DEFAULT_TARGETS
    return LoraConfig(r=int(spec.get("r", 8)), lora_alpha=int(spec.get("alpha", 16)),
                      lora_dropout=float(spec.get("dropout", 0.0)), target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def wrap_lora(lm: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """``lm`` with LoRA adapters (a ``peft.PeftModel``); the base weights stop training."""
    from peft import get_peft_model
    try:
        return get_peft_model(lm, lora_config(spec))
    except ValueError as exc:   # e.g. target modules not found in the model
        raise ModelLoadError(f"model.lora: {str(exc).splitlines()[0]}") from None


def _base_name(name: str) -> str:
    """peft's parameter name back to the HF model's: drop the wrapper prefixes and the
    ``base_layer`` level that a LoRA layer inserts."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named weights with every active adapter merged in (the model is not modified)."""
    from peft.tuners.lora import LoraLayer
    deltas: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    key = _base_name(f"{name}.weight")
                    delta = module.get_delta_weight(adapter)
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    out: dict[str, torch.Tensor] = {}
    for name, value in peft_model.state_dict().items():
        if "lora_" in name:
            continue
        key = _base_name(name)
        out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return out


def adapter_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, named as ``peft`` saves them (``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().cpu().contiguous() for k, v in
            get_peft_model_state_dict(peft_model).items()}
