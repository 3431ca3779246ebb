"""GRPO arithmetic checked against hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from erlay.actors.learner.grpo import (
    group_advantages,
    grpo_loss,
    staleness_ok,
    truncated_is_weights,
)


def one_token(logp: float, prox: float, behaviour: float, adv: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of one completion with one token: (logp, prox, behaviour, advantages, mask)."""
    return (torch.tensor([[logp]], requires_grad=True), torch.tensor([[prox]]),
            torch.tensor([[behaviour]]), torch.tensor([adv]), torch.tensor([[True]]))


# ------------------------------------------------------------------------------ advantages
def test_group_advantages_use_population_std_per_group() -> None:
    # group 1: [1, 1, 0, 0]: mean 0.5, deviations ±0.5, population std 0.5 -> [1, 1, -1, -1]
    # group 2: [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
    #   population variance (0.5625 + 3 * 0.0625) / 4 = 0.1875, std = sqrt(3) / 4
    #   -> [0.75 / (sqrt(3)/4), -0.25 / (sqrt(3)/4), ...] = [sqrt(3), -1/sqrt(3) x 3]
    #   (a sample std, sqrt(0.25) = 0.5, would give [1.5, -0.5, -0.5, -0.5])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    s3 = math.sqrt(3)
    expected = torch.tensor([1.0, 1.0, -1.0, -1.0, s3, -1 / s3, -1 / s3, -1 / s3])
    assert torch.allclose(group_advantages(rewards, 4), expected, atol=1e-5)


def test_group_advantages_without_std_are_centred_rewards() -> None:
    # [2, 0] -> mean 1 -> [1, -1];  [5, 3] -> mean 4 -> [1, -1]
    got = group_advantages(torch.tensor([2.0, 0.0, 5.0, 3.0]), 2, normalize_std=False)
    assert torch.equal(got, torch.tensor([1.0, -1.0, 1.0, -1.0]))


def test_group_with_equal_rewards_gets_exact_zero_advantages() -> None:
    # mean(0.1, 0.1, 0.1) is 0.1 only up to rounding; the group must still give exact zeros,
    # with and without std normalisation, and no NaN from 0 / (0 + eps).
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5])
    for normalize in (True, False):
        got = group_advantages(rewards, 3, normalize_std=normalize)
        assert torch.equal(got[:3], torch.zeros(3))
        assert torch.isfinite(got).all() and got[3] > 0 > got[4]


def test_group_advantages_reject_a_ragged_layout() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


# ---------------------------------------------------------------------------- clipped loss
def test_positive_advantage_above_the_clip_takes_the_clipped_branch() -> None:
    # ratio = exp(log 1.5 - 0) = 1.5, A = +1, eps 0.2:
    #   unclipped 1.5 * 1 = 1.5, clipped 1.2 * 1 = 1.2, min = 1.2 -> loss = -1.2
    # The clipped branch is constant in logp: zero gradient.
    logp, prox, beh, adv, mask = one_token(math.log(1.5), 0.0, 0.0, 1.0)
    loss, stats = grpo_loss(logp, prox, beh, adv, mask, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert logp.grad is not None and logp.grad.item() == 0.0
    assert stats["clip_fraction"] == 1.0 and stats["ratio_mean"] == pytest.approx(1.5)


def test_negative_advantage_below_the_clip_takes_the_clipped_branch() -> None:
    # ratio = 0.5, A = -1: unclipped -0.5, clipped 0.8 * -1 = -0.8, min = -0.8 -> loss 0.8,
    # zero gradient
    logp, prox, beh, adv, mask = one_token(math.log(0.5), 0.0, 0.0, -1.0)
    loss, stats = grpo_loss(logp, prox, beh, adv, mask, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.8)
    assert logp.grad is not None and logp.grad.item() == 0.0
    assert stats["clip_fraction"] == 1.0


def test_negative_advantage_above_the_clip_keeps_the_unclipped_branch() -> None:
    # ratio = 1.5, A = -1: unclipped -1.5, clipped 1.2 * -1 = -1.2, min = -1.5 -> loss 1.5;
    # d(-ratio * A)/dlogp = -A * ratio = 1.5: the pessimistic bound keeps pushing back
    logp, prox, beh, adv, mask = one_token(math.log(1.5), 0.0, 0.0, -1.0)
    loss, stats = grpo_loss(logp, prox, beh, adv, mask, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(1.5)
    assert logp.grad is not None and logp.grad.item() == pytest.approx(1.5)
    assert stats["clip_fraction"] == 0.0


# -------------------------------------------------------------------------------- IS weights
def test_is_weights_are_truncated_at_the_cap() -> None:
    # exp(0 - log 0.25) = 4 -> capped at 2;  exp(0 - log 2) = 0.5 -> kept
    prox = torch.zeros(2)
    behaviour = torch.tensor([math.log(0.25), math.log(2.0)])
    w = truncated_is_weights(prox, behaviour, cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5]))
    assert not w.requires_grad


def test_is_weights_scale_the_surrogate_and_report_cap_hits() -> None:
    # Two tokens, ratio 1 (logp = prox = 0), A = +1, weights [2 (capped from 4), 0.5]:
    #   per-token -1 * w = [-2, -0.5]; token mean = -2.5 / 2 = -1.25
    #   is_weight_mean = 1.25, one of two tokens hit the cap -> 0.5
    logp = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), math.log(2.0)]])
    loss, stats = grpo_loss(logp, torch.zeros(1, 2), behaviour, torch.tensor([1.0]),
                            torch.ones(1, 2, dtype=torch.bool), is_cap=2.0)
    assert loss.item() == pytest.approx(-1.25)
    assert stats["is_weight_mean"] == pytest.approx(1.25)
    assert stats["is_weight_max_hit_fraction"] == 0.5


# ---------------------------------------------------------------------------------- KL term
def test_kl_term_is_k3_against_the_reference() -> None:
    # A = 0 removes the surrogate.  logp = 0, ref = log 2: d = ref - logp = log 2,
    #   k3 = e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853; kl_coef 0.1 -> loss 0.0306853
    #   dk3/dlogp = -e^d + 1 = -1 -> gradient 0.1 * -1 = -0.1
    logp, prox, beh, adv, mask = one_token(0.0, 0.0, 0.0, 0.0)
    ref = torch.tensor([[math.log(2.0)]])
    loss, stats = grpo_loss(logp, prox, beh, adv, mask, kl_coef=0.1, ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2.0)))
    assert stats["kl"] == pytest.approx(1 - math.log(2.0))
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-0.1)


def test_kl_is_reported_but_not_added_when_its_coefficient_is_zero() -> None:
    logp, prox, beh, adv, mask = one_token(0.0, 0.0, 0.0, 0.0)
    loss, stats = grpo_loss(logp, prox, beh, adv, mask, kl_coef=0.0,
                            ref_logp=torch.tensor([[math.log(2.0)]]))
    assert loss.item() == 0.0 and stats["kl"] == pytest.approx(1 - math.log(2.0))


# ------------------------------------------------------------------------ masking and means
def test_loss_is_a_token_mean_and_padding_never_reaches_it() -> None:
    # Row 0: three valid tokens, A = 1; row 1: one valid token, A = 2; ratio 1, w 1.
    #   per-token -A: [-1, -1, -1] and [-2]; token mean = -5 / 4 = -1.25
    #   (a mean of per-sequence means would be (-1 + -2) / 2 = -1.5)
    # Row 1's padding holds garbage (logp 100, behaviour NaN, ref -inf); it must not leak
    # into the loss, the statistics or the gradient.
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 100.0, 100.0]], requires_grad=True)
    prox = torch.zeros(2, 3)
    behaviour = torch.tensor([[0.0, 0.0, 0.0], [0.0, nan, nan]])
    ref = torch.tensor([[0.0, 0.0, 0.0], [0.0, -inf, -inf]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    loss, stats = grpo_loss(logp, prox, behaviour, torch.tensor([1.0, 2.0]), mask,
                            kl_coef=0.5, ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    assert stats["tokens"] == 4 and stats["kl"] == 0.0 and stats["is_weight_mean"] == 1.0
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[1, 1:], torch.zeros(2))
    # d/dlogp of -ratio * A / 4 at ratio 1 is -A / 4
    assert torch.allclose(logp.grad[0], torch.full((3,), -0.25))
    assert logp.grad[1, 0].item() == pytest.approx(-0.5)


def test_an_empty_mask_gives_a_zero_loss_that_backpropagates() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
                            torch.zeros(1, 2, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and stats["tokens"] == 0
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros(1, 2))


# ------------------------------------------------------------------------------- staleness
def test_staleness_boundary_is_inclusive() -> None:
    # learner at 5, max_staleness 1: the oldest token may be version 4, not 3
    assert staleness_ok([4, 5], learner_version=5, max_staleness=1)
    assert not staleness_ok([3, 5], learner_version=5, max_staleness=1)
    # the oldest segment decides, whatever the newer ones are
    assert not staleness_ok([5, 3, 5], learner_version=5, max_staleness=1)


def test_zero_staleness_is_synchronous() -> None:
    assert staleness_ok([5, 5], learner_version=5, max_staleness=0)
    assert not staleness_ok([4, 5], learner_version=5, max_staleness=0)


def test_staleness_edge_cases() -> None:
    assert staleness_ok([], learner_version=5, max_staleness=0)  # nothing to be stale
    # -1 marks tokens no policy made (tool output): ignored, only the 4 counts
    assert staleness_ok([-1, 4, -1], learner_version=5, max_staleness=1)
    assert not staleness_ok([-1, 4], learner_version=5, max_staleness=0)
    assert staleness_ok([-1, -1], learner_version=5, max_staleness=0)
    # newer than the learner: the learner reloaded an older checkpoint; still trainable
    assert staleness_ok([6], learner_version=5, max_staleness=0)
    with pytest.raises(ValueError):
        staleness_ok([5], learner_version=5, max_staleness=-1)
