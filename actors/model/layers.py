"""A policy's decoder layers, and recomputing them in backward (activation checkpointing).

Both kinds of policy (:mod:`erlay.actors.model.build`) keep their transformer blocks in one
``nn.ModuleList``: an HF model's decoder stack (``model.layers``, ``transformer.h``, ...,
reached through :attr:`~erlay.actors.model.hf.HFPolicy.backbone`, which looks through a LoRA
wrapper), the built-in model's ``blocks``.  FSDP shards them one unit each, and
:func:`checkpoint_layers` makes each one keep only its input between the forward and the
backward pass.

Contract: :func:`checkpoint_layers` changes no parameter, name or result: a checkpointed
layer's outputs and gradients equal the plain layer's (the recompute runs the same ops on the
same inputs; ``tests/actors/model/test_layers.py``).  It acts only while autograd records
(a no-grad pass, an engine's decode, runs the layer as it is), in train and eval mode alike,
and a deep copy of the model (the frozen reference policy) stays checkpointed on its own
layers.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` (module docstring).  Raises ValueError for a
    model with none."""
    stack = getattr(model, "backbone", None) if hasattr(model, "lm") else model
    for name in ("layers", "h", "blocks", "block"):
        found = getattr(stack, name, None)
        if isinstance(found, nn.ModuleList) and len(found):
            return list(found)
    raise ValueError(f"no transformer blocks found in {type(model).__name__} (looked for "
                     f"layers, h, blocks on its decoder stack)")


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward, looked up at call time: FSDP's subclass keeps it, and a deep copy
    # of the layer rebinds this method to the copy (copy.deepcopy rebinds bound methods).
    forward = type(self).forward
    if torch.is_grad_enabled():
        # Non-reentrant: keyword arguments pass through, and parameters need no
        # requires_grad input to be differentiated (LoRA's frozen base, a first layer).
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return forward(self, *args, **kwargs)


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute each decoder layer of ``model`` in backward instead of keeping its
    activations (module docstring); returns how many layers.  Idempotent."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)  # type: ignore[method-assign]
    return len(layers)


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` wrapped ``layer``."""
    bound = layer.__dict__.get("forward")
    return isinstance(bound, types.MethodType) and bound.__func__ is _checkpointed_forward
