"""Activation checkpointing per decoder layer: the same outputs and gradients as the plain
model, the layers really recompute in backward (and only while autograd records), and the
frozen copy of a checkpointed policy runs its own layers, not the original's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from erlay.actors.model.build import build_policy
from erlay.actors.model.layers import checkpoint_layers, decoder_layers, is_checkpointed
from erlay.actors.model.policy import sequence_logprobs
from erlay.actors.model.tiny import write_tiny_model

BUILTIN = {"vocab_size": 30, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64,
           "max_seq_len": 32}
PROMPTS = [[1, 5, 7, 9], [2, 4]]
COMPLETIONS = [[3, 8, 11], [6, 12, 13, 14, 5]]


@pytest.fixture(scope="module", params=["builtin", "hf"])
def spec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    if request.param == "builtin":
        return BUILTIN
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", hidden=32, layers=2,
                            heads=4, ffn=64, max_positions=32)
    return {"hf": str(path), "dtype": "float32"}


def loss_and_grads(model: Any) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logp, mask = sequence_logprobs(model, PROMPTS, COMPLETIONS)
    loss = -(logp * mask).sum()
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def count_forwards(model: Any) -> list[int]:
    """A counter of the first layer's forward runs (the class forward, so the recompute
    inside the checkpoint counts too)."""
    layer = decoder_layers(model)[0]
    calls = [0]
    cls = type(layer)
    real = cls.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is layer:
            calls[0] += 1
        return real(self, *args, **kwargs)

    layer.__class__ = type(cls.__name__, (cls,), {"forward": counted})
    return calls


def test_checkpointed_layers_give_the_same_loss_and_gradients(spec: dict[str, Any]) -> None:
    plain = build_policy(spec, seed=1)
    wrapped = build_policy(spec, seed=1)
    assert checkpoint_layers(wrapped) == 2
    assert all(is_checkpointed(layer) for layer in decoder_layers(wrapped))
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    loss_a, grads_a = loss_and_grads(plain)
    loss_b, grads_b = loss_and_grads(wrapped)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7)


def test_a_checkpointed_layer_runs_again_in_backward_only_with_grad(
        spec: dict[str, Any]) -> None:
    model = build_policy(spec, seed=1)
    checkpoint_layers(model)
    calls = count_forwards(model)
    loss_and_grads(model)
    assert calls[0] == 2           # the forward, and its recompute in backward
    calls[0] = 0
    with torch.no_grad():
        sequence_logprobs(model, PROMPTS, COMPLETIONS)
    assert calls[0] == 1


def test_a_deep_copy_runs_its_own_layers() -> None:
    """The frozen reference is a deep copy: its checkpointed layers must read its weights."""
    model = build_policy(BUILTIN, seed=1)
    checkpoint_layers(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
        before = sequence_logprobs(twin, PROMPTS, COMPLETIONS)[0]
    fresh = build_policy(BUILTIN, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(before, sequence_logprobs(fresh, PROMPTS, COMPLETIONS)[0])
    assert all(is_checkpointed(layer) for layer in decoder_layers(twin))
