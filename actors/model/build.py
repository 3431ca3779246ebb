"""One factory for the policy and its tokenizer, whichever kind the job names.

A ``model_config`` dict (built by the job from its ``model`` section and passed to every
learner rank and engine) describes either

- an HF causal LM: ``{"hf": DIR, "init", "dtype", "trust_remote_code", "lora", "mtp_heads",
  "max_seq_len"}`` -> :class:`~erlay.actors.model.hf.HFPolicy`; or
- the built-in character model: :class:`~erlay.actors.model.policy.PolicyConfig`'s fields ->
  :class:`~erlay.actors.model.policy.PolicyModel`, kept as a documented option because it is
  several times cheaper per step on a CPU (tests, chaos soaks and benchmarks of the
  supervision machinery use it); both run through the same engine and learner code.

Both kinds expose the same interface (``hidden``, ``forward``, ``head``, ``embed``, ``mtp``,
``draft_step`` and ``cfg`` with ``vocab_size``, ``max_seq_len``, ``mtp_heads``).
:func:`publish_state` is what the learner sends to engines: the HF model's own parameter names
for an HF policy (LoRA merged in), so vLLM's ``load_weights`` takes them as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from erlay.actors.model.policy import PolicyConfig, PolicyModel, state_to_numpy

Policy = Any   # PolicyModel | HFPolicy: the interface in the module docstring


def is_hf(spec: dict[str, Any]) -> bool:
    return bool(spec.get("hf"))


def build_policy(spec: dict[str, Any], *, seed: int = 0, for_engine: bool = False) -> Policy:
    """The policy ``spec`` describes, initialised from ``seed`` (or its pretrained weights).

    ``for_engine`` builds what an engine serves: an HF model without LoRA adapters (the
    engine receives merged weights)."""
    if is_hf(spec):
        from erlay.actors.model.hf import build_hf_policy
        return build_hf_policy(spec, seed=seed, with_lora=not for_engine)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return PolicyModel(PolicyConfig(**{k: v for k, v in spec.items() if v is not None}))


def publish_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The weights engines load, as numpy arrays (what travels through the object store)."""
    if hasattr(model, "engine_state"):
        return model.engine_state()
    return state_to_numpy(model)


def load_engine_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load :func:`publish_state`'s output into an engine's model (same names, any dtype)."""
    own = model.state_dict()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)).to(own[k].dtype)
                           for k, v in state.items() if k in own}, strict=True)


def shape_of(model: nn.Module) -> dict[str, Any]:
    """The model's shape as a plain dict (checkpoints compare it on restore)."""
    return model.cfg.to_dict()
