"""Micro-batches: a minibatch split into passes of at most ``micro_batch_tokens`` takes the
gradient one pass over it takes, for every objective, on the built-in model and an HF model
with LoRA adapters (fsdp2's split is in test_fsdp.py); every pass respects the budget; and a
planted mis-scaling of the per-micro-batch losses is caught."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from erlay.actors.learner import passes
from erlay.actors.learner.batch import TrainBatch, pack_micro_batches
from erlay.actors.learner.core import LearnerCore
from erlay.actors.learner.objectives import Objective
from erlay.actors.model.tiny import write_tiny_model

BUILTIN = {"vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64,
           "max_seq_len": 64}
OBJECTIVES = {
    "grpo": (Objective("grpo"), 0.0),
    "dr_grpo": (Objective("dr_grpo", max_tokens=16), 0.0),
    "dapo": (Objective("dapo", clip_low=0.2, clip_high=0.28, overlong_max=12,
                       overlong_buffer=4), 0.0),
    "gspo": (Objective("gspo", clip_low=3e-4, clip_high=4e-4), 0.05),
    "rloo": (Objective("rloo"), 0.0),
    "reinforce_pp": (Objective("reinforce_pp"), 0.05),
}
# Large enough that every row of mixed_batch gets its own micro-batch or shares with one.
SMALL_BUDGET = 40
TOLERANCE = 1e-5


def mixed_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """Three groups of four of varied lengths: tool-output tokens masked out, one row with
    nothing trained (a filtered one, as dapo's dynamic sampling leaves), one invalid sample,
    rewards that differ within each group, behaviour logprobs off-policy."""
    rng = random.Random(seed)
    n = 12
    prompts = [[rng.randrange(3, vocab) for _ in range(3 + i % 5)] for i in range(n)]
    completions = [[rng.randrange(3, vocab) for _ in range(2 + (7 * i) % 11)] for i in range(n)]
    masks = [[not (i % 3 == 1 and 1 <= t <= 2) for t in range(len(c))]
             for i, c in enumerate(completions)]
    masks[5] = [False] * len(completions[5])
    return TrainBatch(prompt_ids=prompts, completion_ids=completions,
                      behaviour_logprobs=[[-2.0 - 0.1 * (t % 4) for t in range(len(c))]
                                          for c in completions],
                      versions=[[0] * len(c) for c in completions],
                      rewards=[float((i * 5) % 4) / 3 for i in range(n)], group_size=4,
                      rollout_ids=[f"r{i}" for i in range(n)], loss_mask=masks,
                      valid=[i != 7 for i in range(n)])


def gradients(spec: dict[str, Any], budget: int, objective: Objective, kl_coef: float,
              **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The trainable parameters' gradients after one step on :func:`mixed_batch` (two
    minibatches: the second scored against fixed proximal logprobs), unclipped, and the
    step's metrics."""
    core = LearnerCore(spec, objective=objective, kl_coef=kl_coef, minibatches=2,
                       micro_batch_tokens=budget, max_grad_norm=1e9, seed=3, **options)
    vocab = core.config.vocab_size
    metrics = core.train_step(mixed_batch(vocab))
    grads = {n: p.grad.detach().clone() for n, p in core.model.named_parameters()
             if p.requires_grad and p.grad is not None}
    return grads, metrics


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max |a - b| / max |b|`` over all parameters (inf if the names differ)."""
    if a.keys() != b.keys() or not a:
        return float("inf")
    scale = max(float(g.abs().max()) for g in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / max(scale, 1e-30)


@pytest.fixture(scope="module")
def lora_spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", hidden=32, layers=2,
                            heads=4, ffn=64, max_positions=64)
    return {"hf": str(path), "dtype": "float32", "lora": {"r": 4}}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_micro_batches_take_the_one_pass_gradient_for_every_objective(name: str) -> None:
    objective, kl = OBJECTIVES[name]
    one, m_one = gradients(BUILTIN, 10**6, objective, kl)
    split, m_split = gradients(BUILTIN, SMALL_BUDGET, objective, kl)
    assert max_rel_diff(split, one) <= TOLERANCE
    assert m_split["tokens"] == m_one["tokens"]
    assert m_split["loss"] == pytest.approx(m_one["loss"], rel=1e-4, abs=1e-6) \
        or objective.per_sequence   # per-sequence stats are token means of micro-batches
    assert m_split["entropy"] == pytest.approx(m_one["entropy"], rel=1e-5)


def test_lora_adapters_take_the_one_pass_gradient_in_micro_batches(
        lora_spec: dict[str, Any]) -> None:
    objective, _ = OBJECTIVES["grpo"]
    one, _ = gradients(lora_spec, 10**6, objective, 0.05)
    split, _ = gradients(lora_spec, SMALL_BUDGET, objective, 0.05)
    assert all("lora" in n for n in one), sorted(one)[:3]
    assert max_rel_diff(split, one) <= TOLERANCE


def test_every_pass_holds_at_most_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = passes.score_completions

    def spy(model: Any, prompts: list[list[int]], completions: list[list[int]],
            *args: Any, **kwargs: Any) -> Any:
        width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
        seen.append(len(prompts) * width)
        return real(model, prompts, completions, *args, **kwargs)

    monkeypatch.setattr(passes, "score_completions", spy)
    gradients(BUILTIN, SMALL_BUDGET, *OBJECTIVES["grpo"])
    batch = mixed_batch(BUILTIN["vocab_size"])
    longest = max(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids,
                                                  strict=True))
    assert len(seen) > 4 and max(seen) <= max(SMALL_BUDGET, longest)


def test_a_planted_mis_scaling_of_micro_batch_losses_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the scaling prevents: each micro-batch's mean weighted alike, not by its
    units.  The same comparison that passes above must flag it."""
    objective, kl = OBJECTIVES["grpo"]
    one, _ = gradients(BUILTIN, 10**6, objective, kl)
    real = passes.LearnerPasses._micro_loss

    def equal_weights(self: Any, *args: Any) -> Any:
        loss, stats, _units, tokens = real(self, *args)
        return loss, stats, 1, tokens

    monkeypatch.setattr(passes.LearnerPasses, "_micro_loss", equal_weights)
    planted, _ = gradients(BUILTIN, SMALL_BUDGET, objective, kl)
    assert max_rel_diff(planted, one) > 1e-2


def test_packing_bounds_each_micro_batch_and_keeps_every_row_once() -> None:
    lengths = [random.Random(1).randrange(1, 50) for _ in range(200)]
    packs = pack_micro_batches(lengths, 128)
    assert sorted(i for p in packs for i in p) == list(range(200))
    assert all(len(p) * max(lengths[i] for i in p) <= 128 for p in packs)
    assert pack_micro_batches([300, 5], 128) == [[0], [1]]   # too long: alone
    with pytest.raises(ValueError, match="budget"):
        pack_micro_batches([3], 0)


def test_bf16_mixed_keeps_fp32_master_weights_and_state_and_follows_fp32() -> None:
    objective, _ = OBJECTIVES["grpo"]
    fp32, _ = gradients(BUILTIN, SMALL_BUDGET, objective, 0.0, precision="fp32")
    core = LearnerCore(BUILTIN, precision="bf16-mixed", micro_batch_tokens=SMALL_BUDGET,
                       minibatches=2, max_grad_norm=1e9, seed=3)
    core.train_step(mixed_batch(BUILTIN["vocab_size"]))
    mixed = {n: p.grad for n, p in core.model.named_parameters()}
    assert {p.dtype for p in core.model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in core.optimizer.state.values()} == {torch.float32}
    assert max_rel_diff(mixed, fp32) < 0.1     # bf16 rounding, not a different gradient
    assert max_rel_diff(mixed, fp32) > 0.0     # and the compute did run in bf16


def test_bf16_precision_holds_bf16_weights() -> None:
    core = LearnerCore(BUILTIN, precision="bf16", micro_batch_tokens=SMALL_BUDGET)
    core.train_step(mixed_batch(BUILTIN["vocab_size"]))
    assert {p.dtype for p in core.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="precision"):
        LearnerCore(BUILTIN, precision="fp16")
