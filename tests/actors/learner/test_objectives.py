"""The policy objectives against values worked out by hand on small tensors.

Each hand-worked check is a function of the implementation it checks, so the same check is
run on the real code (it must pass) and on a planted error: a flipped sign, a wrong
normalisation, a swapped clip side, written the way a real bug would be.  A check that
passes its planted error is a check that asserts nothing, and fails here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from erlay.actors.learner import objectives as obj_mod
from erlay.actors.learner.advantages import step_advantages
from erlay.actors.learner.batch import TrainBatch
from erlay.actors.learner.grpo import group_advantages
from erlay.actors.learner.objectives import (
    Objective,
    moments,
    overlong_shaping,
    policy_loss,
    rloo_advantages,
    sequence_advantages,
    token_returns,
    whiten,
)
from tests.actors.learner.test_core import arithmetic_batch, learner


def planted_error_is_caught(check: Callable[..., None], *args: Any) -> bool:
    """Whether ``check`` rejects ``args`` (a planted error): True when it raises."""
    try:
        check(*args)
    except AssertionError:
        return True
    return False


def on_policy(logp: list[list[float]], mask: list[list[bool]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, prox, behaviour, mask)`` with every ratio and IS weight 1; logp trainable."""
    lp = torch.tensor(logp, requires_grad=True)
    return lp, lp.detach().clone(), lp.detach().clone(), torch.tensor(mask)


# ------------------------------------------------------------------------------ dr_grpo
def check_dr_grpo_advantages(advantages: Callable[..., torch.Tensor]) -> None:
    # Rewards 1, 0, 0, 1: the group mean is 0.5, so A = r - 0.5; no std normalisation
    # (GRPO would divide by std 0.5 and give +-1).
    got = advantages(Objective("dr_grpo", max_tokens=4), torch.tensor([1.0, 0, 0, 1]), 4)
    assert torch.allclose(got, torch.tensor([0.5, -0.5, -0.5, 0.5])), got


def test_dr_grpo_centres_without_std() -> None:
    check_dr_grpo_advantages(sequence_advantages)

    def divides_by_std(o: Objective, r: torch.Tensor, g: int, *a: Any) -> torch.Tensor:
        return group_advantages(r, g)   # the planted error: GRPO's normalisation kept
    assert planted_error_is_caught(check_dr_grpo_advantages, divides_by_std)


def check_dr_grpo_loss(loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]) -> None:
    # Ratio 1 everywhere, so each token's loss is -A.  Row 0 (A = +1) has one token, row 1
    # (A = -1) three: token sums -1 and +3, over C = 4 tokens each, averaged over the two
    # rows: (-1/4 + 3/4) / 2 = 0.25.  (The token mean would be 2/4 = 0.5.)
    lp, prox, beh, mask = on_policy([[-1.0, 0, 0], [-1.0, -2, -3]],
                                    [[True, False, False], [True, True, True]])
    loss, _ = loss_fn(Objective("dr_grpo", max_tokens=4), lp, prox, beh,
                      torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(0.25), loss
    loss.backward()
    # Each token's gradient is -A / (C * rows): -1/8 on row 0's, +1/8 on row 1's.
    want = torch.tensor([[-0.125, 0, 0], [0.125, 0.125, 0.125]])
    assert lp.grad is not None and torch.allclose(lp.grad, want), lp.grad


def test_dr_grpo_divides_each_token_sum_by_the_budget() -> None:
    check_dr_grpo_loss(policy_loss)

    def token_mean(o: Objective, *args: Any, **kw: Any) -> Any:
        return policy_loss(Objective("rloo"), *args, **kw)   # the planted error
    assert planted_error_is_caught(check_dr_grpo_loss, token_mean)


# --------------------------------------------------------------------------------- dapo
def check_dapo_clip(loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]) -> None:
    dapo = Objective("dapo", clip_low=0.2, clip_high=0.28)
    # A = +1, ratio 1.5: clipped above at 1 + 0.28, so the loss is -1.28.
    up, _ = loss_fn(dapo, torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1),
                    torch.zeros(1, 1), torch.tensor([1.0]), torch.tensor([[True]]))
    assert up.item() == pytest.approx(-1.28), up
    # A = -1, ratio 0.5: min(-0.5, -0.8) = -0.8 (clipped below at 1 - 0.2), loss 0.8.
    down, _ = loss_fn(dapo, torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1),
                      torch.zeros(1, 1), torch.tensor([-1.0]), torch.tensor([[True]]))
    assert down.item() == pytest.approx(0.8), down


def test_dapo_clips_each_side_at_its_own_range() -> None:
    check_dapo_clip(policy_loss)

    def swapped(o: Objective, *args: Any, **kw: Any) -> Any:
        bad = Objective("dapo", clip_low=o.clip_high, clip_high=o.clip_low)   # planted
        return policy_loss(bad, *args, **kw)

    def symmetric(o: Objective, *args: Any, **kw: Any) -> Any:
        return policy_loss(Objective("grpo"), *args, **kw)   # planted: clip_eps both sides
    assert planted_error_is_caught(check_dapo_clip, swapped)
    assert planted_error_is_caught(check_dapo_clip, symmetric)


def check_overlong(shaping: Callable[..., torch.Tensor]) -> None:
    # Budget 10, buffer 4: no penalty up to 6 tokens, then linear to -1 at 10, -1 beyond.
    got = shaping(torch.tensor([5, 6, 8, 10, 12]), 10, 4, 1.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0])), got


def test_dapo_overlong_shaping_ramps_to_the_penalty() -> None:
    check_overlong(overlong_shaping)
    assert planted_error_is_caught(
        check_overlong, lambda *a: -overlong_shaping(*a))   # planted: the sign
    assert planted_error_is_caught(
        check_overlong, lambda n, m, b, p: overlong_shaping(n, m, m, p))  # whole budget


def test_dapo_shapes_rewards_before_the_group_baseline() -> None:
    dapo = Objective("dapo", overlong_max=10, overlong_buffer=4)
    # Two equally correct answers, one running into the buffer: it must rank below.
    got = sequence_advantages(dapo, torch.tensor([1.0, 1.0]), 2,
                              lengths=torch.tensor([3.0, 8.0]))
    assert got[0] > 0 > got[1]
    with pytest.raises(ValueError, match="lengths"):
        sequence_advantages(dapo, torch.tensor([1.0, 1.0]), 2)


# --------------------------------------------------------------------------------- gspo
def check_gspo(loss_fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]) -> None:
    wide = Objective("gspo", clip_low=0.5, clip_high=5.0)
    # Token ratios 2 and 1: the sequence ratio is their geometric mean, sqrt(2) (the
    # arithmetic mean would be 1.5); A = 1, so the loss is -sqrt(2) ...
    lp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    loss, _ = loss_fn(wide, lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
                      torch.ones(1, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-math.sqrt(2)), loss
    loss.backward()
    # ... and d/dlogp_t = -s / n = -sqrt(2)/2 on each token.
    assert lp.grad is not None and torch.allclose(lp.grad, torch.full((1, 2), -math.sqrt(2) / 2))
    # With GSPO's own range the sequence ratio is clipped at 1 + 4e-4.
    tight = Objective("gspo", clip_low=3e-4, clip_high=4e-4)
    clipped, stats = loss_fn(tight, lp.detach(), torch.zeros(1, 2), torch.zeros(1, 2),
                             torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert clipped.item() == pytest.approx(-1.0004) and stats["clip_fraction"] == 1.0


def test_gspo_ratio_is_the_sequence_geometric_mean() -> None:
    check_gspo(policy_loss)

    def token_level(o: Objective, *args: Any, **kw: Any) -> Any:
        bad = Objective("dapo", clip_low=o.clip_low, clip_high=o.clip_high)  # planted
        return policy_loss(bad, *args, **kw)
    assert planted_error_is_caught(check_gspo, token_level)


def test_gspo_weighs_every_completion_once_whatever_its_length() -> None:
    lp, prox, beh, mask = on_policy([[-1.0, 0, 0, 0], [-1.0, -1, -1, -1]],
                                    [[True, False, False, False], [True] * 4])
    loss, _ = policy_loss(Objective("gspo"), lp, prox, beh, torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)   # (-1 + 1) / 2 completions


# --------------------------------------------------------------------------------- rloo
def check_rloo(advantages: Callable[..., torch.Tensor]) -> None:
    # Rewards 1, 0, 0, 0: the first sample's baseline is the mean of the other three (0),
    # the others' is (1 + 0 + 0) / 3.
    got = advantages(torch.tensor([1.0, 0, 0, 0]), 4, None)
    assert torch.allclose(got, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])), got
    # The last sample unjudged: it gets 0 and is no one's baseline.
    got = advantages(torch.tensor([1.0, 0, 0, 5]), 4, torch.tensor([True, True, True, False]))
    assert torch.allclose(got, torch.tensor([1.0, -0.5, -0.5, 0.0])), got


def test_rloo_baseline_leaves_the_sample_out() -> None:
    check_rloo(rloo_advantages)

    def with_self(r: torch.Tensor, g: int, v: torch.Tensor | None) -> torch.Tensor:
        return group_advantages(r, g, normalize_std=False, valid=v)   # planted
    assert planted_error_is_caught(check_rloo, with_self)


def test_rloo_of_a_lone_valid_sample_is_zero() -> None:
    got = rloo_advantages(torch.tensor([1.0, 0]), 2, torch.tensor([True, False]))
    assert got.tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------- reinforce_pp
def check_returns(returns: Callable[..., torch.Tensor]) -> None:
    # Rewards 1 and 0; per-token KL (behaviour - reference) 0.5, 0.5 and 0, 1; kl_coef
    # 0.1.  A token's return is the reward less 0.1 x the KL from it to the end.
    mask = torch.ones(2, 2, dtype=torch.bool)
    got = returns(torch.tensor([1.0, 0.0]), mask, kl_coef=0.1,
                  behaviour_logp=torch.tensor([[0.5, 0.5], [0.0, 1.0]]),
                  ref_logp=torch.zeros(2, 2))
    assert torch.allclose(got, torch.tensor([[0.9, 0.95], [-0.1, -0.1]])), got


def test_reinforce_pp_folds_the_kl_to_go_into_the_reward() -> None:
    check_returns(token_returns)

    def kl_added(r: torch.Tensor, m: torch.Tensor, **kw: Any) -> torch.Tensor:
        return token_returns(r, m, **{**kw, "kl_coef": -kw["kl_coef"]})   # planted: sign
    assert planted_error_is_caught(check_returns, kl_added)


def check_whitening(step: Callable[..., list[torch.Tensor]]) -> None:
    # Rewards 1, 1, 0 with 1, 2 and 1 tokens: the batch's token returns are 1, 1, 1, 0,
    # mean 0.75, population std sqrt(3)/4, so A = +1/sqrt(3) and -sqrt(3).
    tb = TrainBatch(prompt_ids=[[1]] * 3, completion_ids=[[5], [5, 6], [7]],
                    behaviour_logprobs=[[-1.0], [-1.0, -1.0], [-1.0]],
                    versions=[[0], [0, 0], [0]], rewards=[1.0, 1.0, 0.0], group_size=1,
                    rollout_ids=["a", "b", "c"])
    parts = step(Objective("reinforce_pp"), tb, [[0, 1], [2]], [None, None])
    s3 = math.sqrt(3)
    assert torch.allclose(parts[0], torch.tensor([[1 / s3, 0.0], [1 / s3, 1 / s3]]),
                          atol=1e-4), parts
    assert torch.allclose(parts[1], torch.tensor([[-s3]]), atol=1e-4), parts


def test_reinforce_pp_whitens_over_the_whole_batch() -> None:
    check_whitening(step_advantages)

    def per_chunk(o: Objective, tb: TrainBatch, chunks: Any, refs: Any) -> Any:
        # The planted error: each minibatch whitened on its own statistics.
        return [step_advantages(o, tb, [c], [r])[0] for c, r in zip(chunks, refs, strict=True)]
    assert planted_error_is_caught(check_whitening, per_chunk)


def test_whitening_of_a_flat_batch_is_zero() -> None:
    x, m = torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool)
    assert whiten(x, m, moments(x, m)).abs().sum().item() == 0.0


def test_reinforce_pp_takes_no_kl_loss_term() -> None:
    # The KL is in the returns: a loss term too would count it twice.
    lp, prox, beh, mask = on_policy([[-1.0, -2.0]], [[True, True]])
    ref = torch.full((1, 2), -3.0)
    adv = torch.tensor([[0.5, -0.5]])
    with_kl, stats = policy_loss(Objective("reinforce_pp"), lp, prox, beh, adv, mask,
                                 kl_coef=0.5, ref_logp=ref)
    without, _ = policy_loss(Objective("reinforce_pp"), lp, prox, beh, adv, mask)
    assert with_kl.item() == pytest.approx(without.item()) and stats["kl"] > 0


# ------------------------------------------------------------------------- every one
def test_grpo_is_today_s_loss() -> None:
    lp, prox, beh, mask = on_policy([[-1.0, -2.0], [-0.5, 0.0]], [[True, True], [True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_loss(Objective(), lp, prox, beh, adv, mask)
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3)


def test_an_unknown_objective_or_a_bad_knob_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown algorithm"):
        Objective("ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        Objective("dr_grpo")
    with pytest.raises(ValueError, match="clip_low"):
        Objective("dapo", clip_low=1.5)


@pytest.mark.parametrize("name", obj_mod.ALGORITHMS)
def test_every_objective_masks_what_it_must_not_train(name: str) -> None:
    """Garbage (NaN, inf) under a False mask reaches neither the loss nor the gradient."""
    o = Objective(name, max_tokens=3) if name == "dr_grpo" else Objective(name)
    lp = torch.tensor([[-1.0, float("nan")], [-0.5, -0.7]], requires_grad=True)
    prox = torch.tensor([[-1.2, float("inf")], [-0.4, -0.9]])
    beh = torch.tensor([[-1.1, float("-inf")], [-0.6, -0.8]])
    mask = torch.tensor([[True, False], [True, True]])
    adv = torch.tensor([[0.3, 0.0], [-0.2, 0.4]]) if o.token_advantages \
        else torch.tensor([0.7, -0.7])
    loss, stats = policy_loss(o, lp, prox, beh, adv, mask)
    loss.backward()
    assert math.isfinite(loss.item()) and lp.grad is not None
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1].item() == 0.0
    assert stats["tokens"] == 3.0


@pytest.mark.parametrize("name", obj_mod.ALGORITHMS)
def test_a_learner_step_with_every_objective_moves_the_weights(name: str) -> None:
    o = Objective(name, max_tokens=3) if name == "dr_grpo" else Objective(name)
    core = learner(objective=o)
    before = core.weights()
    metrics = core.train_step(arithmetic_batch(core))
    assert math.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    after = core.weights()
    assert any((before[k] != after[k]).any() for k in before)


def test_rows_with_nothing_to_train_change_nothing() -> None:
    """A group with every token masked (stale, failed, or dropped by dynamic sampling) is
    skipped: the step equals the step on the batch without it."""
    a, b = learner(), learner()
    full = arithmetic_batch(a)
    masks = [[True] * len(c) for c in full.completion_ids]
    masks[0] = [False] * len(masks[0])
    masks[1] = [False] * len(masks[1])
    masked = TrainBatch(**{**full.to_dict(), "loss_mask": masks})
    keep = list(range(2, len(full)))
    pick = full.to_dict()
    smaller = TrainBatch(**{k: ([pick[k][i] for i in keep] if isinstance(pick[k], list)
                                else pick[k]) for k in pick})
    a.train_step(masked)
    b.train_step(smaller)
    wa, wb = a.weights(), b.weights()
    assert all(torch.allclose(torch.from_numpy(wa[k]), torch.from_numpy(wb[k]), atol=1e-6)
               for k in wa)
