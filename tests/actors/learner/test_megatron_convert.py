"""The megatron backend's weight conversion on the CPU: a megatron-core ``GPTModel`` built with
``use_cpu_initialization`` takes the converted HF weights with ``strict=True``; HF ->
Megatron -> HF is bit-identical (and so are the tensor- and pipeline-parallel split and
merge); the converted model's logits equal the HF model's; each check fails on a planted
violation.

megatron-core 0.16's forward pass calls CUDA (module docstring of
:mod:`erlay.actors.learner.megatron_backend`); the logits tests run it on the CPU with those
two calls patched *in the test only* (``torch.cuda.current_device`` -> ``"cpu"``, the CUDA RNG
tracker's ``fork`` -> a no-op; dropout is 0), to check the conversion's semantics: the fused
QKV layout, the gate/up order and RoPE.  The learner itself is GPU-only.  Tensor
parallelism over two real ranks (sharded logits, the gathered merge) is checked in
test_megatron_learner.py.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from erlay.actors.model import megatron_convert as mc
from erlay.actors.model.tiny import tiny_config, write_tiny_model
from tests.conftest import require_megatron

require_megatron()

SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_positions=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A one-process gloo group and megatron's parallel_state at TP = PP = 1, torn down
    after the module (a group this fixture made) so no other test inherits it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    # Earlier tests in the session may have left a one-process group (a one-rank
    # checkpointer's): megatron's groups are made inside it, and it is left as it was.
    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    assert dist.get_world_size() == 1, "a multi-rank process group exists in the test process"
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


@pytest.fixture
def cpu_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let megatron's forward run on the CPU (module docstring): test-only patches."""
    import megatron.core.tensor_parallel as tensor_parallel

    class NoFork:
        def fork(self, *args: Any, **kwargs: Any) -> Any:
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: NoFork())


def hf_model(tmp_path: Path, arch: str, *, tied: bool = False) -> Any:
    from transformers import AutoModelForCausalLM
    if not tied:
        return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / arch, arch,
                                                                     **SHAPE))
    config = tiny_config(arch, vocab_size=101, **SHAPE)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def hf_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def swap_q_and_k(state: dict[str, torch.Tensor], shape: mc.MegatronShape) -> None:
    """Planted: in layer 0's fused QKV, group 0's first query head and its key head swap."""
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    w = state[name].clone()
    dh, r = shape.head_dim, shape.group
    q0, k0 = w[:dh].clone(), w[r * dh:(r + 1) * dh].clone()
    w[:dh], w[r * dh:(r + 1) * dh] = k0, q0
    state[name] = w


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_megatron_round_trip_hf_megatron_hf_is_bit_identical(tmp_path: Path, arch: str,
                                                             tied: bool) -> None:
    model = hf_model(tmp_path, arch, tied=tied)
    shape = mc.megatron_shape(model.config)
    assert shape.tied is tied and shape.qkv_bias is (arch == "qwen2")
    hf = hf_state(model)
    mg = mc.hf_to_megatron(hf, shape)
    assert_identical(mc.megatron_to_hf(mg, shape), hf)
    # Planted: a swapped q/k block in the fused weight comes back as a different HF state.
    swap_q_and_k(mg, shape)
    back = mc.megatron_to_hf(mg, shape)
    with pytest.raises(AssertionError):
        assert_identical(back, hf)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_megatron_tp2_split_and_merge_round_trip_is_bit_identical(tmp_path: Path,
                                                                  arch: str) -> None:
    model = hf_model(tmp_path, arch)
    shape = mc.megatron_shape(model.config)
    hf = hf_state(model)
    full = mc.hf_to_megatron(hf, shape, tp=2)
    assert full["embedding.word_embeddings.weight"].shape[0] % 2 == 0
    shards = mc.split_tp(full, shape, 2)
    # Each rank holds half of every split tensor: gate and up halves, whole query groups.
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    half = shape.ffn // 2
    assert torch.equal(shards[1][fc1], torch.cat([gate[half:], up[half:]]))
    assert_identical(mc.merge_tp(shards, shape), full)
    assert_identical(mc.megatron_to_hf(mc.merge_tp(shards, shape), shape), hf)
    # Planted: a replicated norm that drifted on one rank is refused, not averaged away.
    norm = "decoder.layers.1.input_layernorm.weight"
    shards[1][norm] = shards[1][norm] + 1e-3
    with pytest.raises(ValueError, match="replicated over tensor-parallel ranks"):
        mc.merge_tp(shards, shape)


def test_megatron_a_naive_fc1_split_is_caught_by_the_merge_round_trip(tmp_path: Path) -> None:
    model = hf_model(tmp_path, "llama")
    shape = mc.megatron_shape(model.config)
    full = mc.hf_to_megatron(hf_state(model), shape, tp=2)
    shards = mc.split_tp(full, shape, 2)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    # Planted: rank r holds rows chunk r of [gate; up] (gate halves only on rank 0).
    for r, part in enumerate(full[fc1].chunk(2)):
        shards[r][fc1] = part
    assert not torch.equal(mc.merge_tp(shards, shape)[fc1], full[fc1])


@pytest.mark.parametrize("tied", [False, True])
def test_megatron_pp2_split_and_merge_round_trip_is_bit_identical(tmp_path: Path,
                                                                  tied: bool) -> None:
    model = hf_model(tmp_path, "qwen2", tied=tied)
    shape = mc.megatron_shape(model.config)
    full = mc.hf_to_megatron(hf_state(model), shape)
    stages = mc.split_pp(full, shape, 2)
    assert "embedding.word_embeddings.weight" in stages[0]
    assert "decoder.final_layernorm.weight" in stages[1]
    assert "decoder.layers.0.input_layernorm.weight" in stages[1]   # layer 1, renumbered
    assert_identical(mc.merge_pp(stages, shape), full)
    if tied:   # planted: the last stage's tied copy drifted
        stages[1]["output_layer.weight"] = stages[1]["output_layer.weight"] + 1
        with pytest.raises(ValueError, match="tied output layer"):
            mc.merge_pp(stages, shape)


def test_megatron_conversion_refuses_unplaced_or_missing_tensors(tmp_path: Path) -> None:
    model = hf_model(tmp_path, "llama")
    shape = mc.megatron_shape(model.config)
    hf = hf_state(model)
    with pytest.raises(ValueError, match=r"does not place: model\.layers\.0\.self_attn\.q_norm"):
        mc.hf_to_megatron({**hf, "model.layers.0.self_attn.q_norm.weight": torch.ones(4)},
                          shape)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        mc.hf_to_megatron(hf, shape)


# -- the real model, built on the CPU -----------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_megatron_model_on_cpu_loads_the_converted_weights_strictly_and_matches_hf_logits(
        tmp_path: Path, megatron_world: None, cpu_forward: None, arch: str,
        tied: bool) -> None:
    from erlay.actors.learner.megatron_model import (
        build_gpt_model,
        load_megatron_state,
        megatron_logits,
        right_pad,
    )
    model = hf_model(tmp_path, arch, tied=tied)
    shape = mc.megatron_shape(model.config)
    mg = build_gpt_model(shape, cpu_init=True)
    converted = mc.hf_to_megatron(hf_state(model), shape)
    load_megatron_state(mg, converted)
    # What megatron holds converts back bit-identically.
    own = {k: v for k, v in mg.state_dict().items() if isinstance(v, torch.Tensor)}
    assert_identical(mc.megatron_to_hf(own, shape), hf_state(model))
    torch.manual_seed(1)
    tokens = right_pad([torch.randint(4, shape.vocab_size, (n,)).tolist() for n in (12, 7)])
    with torch.no_grad():
        ours = megatron_logits(mg, tokens)[..., :shape.vocab_size]
        theirs = model(tokens).logits
    # Right padding: rows are compared on their real tokens (row 1 has 7).
    assert (ours[0] - theirs[0]).abs().max() < 1e-4
    assert (ours[1, :7] - theirs[1, :7]).abs().max() < 1e-4
    # Planted: a q/k swap in the fused layout still loads (same shapes) but moves the logits.
    swap_q_and_k(converted, shape)
    load_megatron_state(mg, converted)
    with torch.no_grad():
        moved = megatron_logits(mg, tokens)[..., :shape.vocab_size]
    assert (moved[0] - theirs[0]).abs().max() > 1e-3


def test_megatron_strict_load_refuses_a_missing_or_misshapen_tensor(
        tmp_path: Path, megatron_world: None) -> None:
    from erlay.actors.learner.megatron_model import build_gpt_model, load_megatron_state
    model = hf_model(tmp_path, "qwen2")
    shape = mc.megatron_shape(model.config)
    mg = build_gpt_model(shape, cpu_init=True)
    converted = mc.hf_to_megatron(hf_state(model), shape)
    missing = {k: v for k, v in converted.items() if "linear_qkv.bias" not in k}
    with pytest.raises(RuntimeError, match="Missing key"):
        load_megatron_state(mg, missing)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_megatron_state(mg, {**converted, name: converted[name][: shape.ffn]})


def test_megatron_completion_logprobs_match_the_learners_scoring(tmp_path: Path) -> None:
    """The megatron learner's right-padded scoring equals the replicated learner's
    left-padded :func:`sequence_logprobs` on the same HF model (temperature 0.7)."""
    from erlay.actors.learner.megatron_model import completion_logprobs, right_pad
    from erlay.actors.model.build import build_policy
    from erlay.actors.model.policy import sequence_logprobs
    path = write_tiny_model(tmp_path / "m", "qwen2", **SHAPE)
    policy = build_policy({"hf": str(path)})
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]
    with torch.no_grad():
        want, want_mask = sequence_logprobs(policy, prompts, completions, 0.7)
        tokens = right_pad([p + c for p, c in zip(prompts, completions, strict=True)])
        padded = torch.nn.functional.pad(policy.lm(tokens).logits, (0, 3))  # a padded vocab
        got, mask = completion_logprobs(padded, prompts, completions, policy.cfg.vocab_size,
                                        0.7)
    assert torch.equal(mask, want_mask)
    assert (got - want).abs().max() < 1e-5
    # Planted: scoring without dropping the padded vocabulary is not the same distribution.
    wrong, _ = completion_logprobs(padded, prompts, completions, policy.cfg.vocab_size + 3, 0.7)
    assert (wrong - want).abs().max() > 1e-3
