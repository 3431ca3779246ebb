"""GRPO's arithmetic as pure torch functions: group advantages, the clipped off-policy
surrogate, and the staleness rule.  No Ray, no model, no state.

Three policies meet in one update, and their names are used consistently:

- **behaviour** (``behaviour_logp``): the policy version the engine sampled with.  In
  asynchronous RL it may be older than the learner's weights, and a rollout may even span
  versions when a weight update lands mid-generation.
- **proximal** (``prox_logp``): the learner's weights at the start of the train step.  The
  PPO trust region is drawn around it, not around the behaviour policy, so the clip range
  means the same thing however stale the data is (decoupled PPO).
- **current** (``logp``): the weights being optimised; equal to proximal on the first
  minibatch of a step and drifting from it on later ones.

The gap between behaviour and proximal is corrected by a truncated importance weight, so a
stale token cannot blow up the gradient.

Tensors are ``[B, L]`` over completion tokens (``B`` completions, ``L`` the longest one) with
a boolean ``mask`` marking the tokens that are trained on; values under a False mask may be
anything (padding, garbage) and never reach the loss or its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages ``[N]`` for rewards ``[N]`` laid out group by group.

    ``A = (r - mean_group) / (std_group + eps)`` or, without ``normalize_std``,
    ``A = r - mean_group``.  ``std_group`` is the *population* standard deviation (divide by
    ``group_size``, not ``group_size - 1``): it is defined for a group of one, and it makes
    the normalised advantages of every group have unit mean square.  A group whose rewards
    are all equal carries no learning signal and gets exactly zero advantages; this is
    enforced explicitly, because the floating-point mean of equal values can differ from
    them in the last bit.

    ``valid`` (bool ``[N]``): only valid samples enter their group's mean and std, and
    invalid ones get advantage 0, so a sample that could not be judged is not a reward of 0.
    Each group's statistics are then those of its valid members, exactly as if the invalid
    ones were absent.

    Raises ValueError unless ``rewards`` is 1-D with a length divisible by ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if valid is not None and not bool(valid.all()):
        return _valid_group_advantages(rewards, group_size, valid, normalize_std, eps)
    groups = rewards.detach().to(torch.float32).view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    flat = groups.max(dim=1, keepdim=True).values == groups.min(dim=1, keepdim=True).values
    return torch.where(flat, torch.zeros_like(centred), centred).reshape(-1)


def _valid_group_advantages(rewards: torch.Tensor, group_size: int, valid: torch.Tensor,
                            normalize_std: bool, eps: float) -> torch.Tensor:
    """:func:`group_advantages` of each group's valid members; 0 for the others."""
    out = torch.zeros(rewards.numel(), dtype=torch.float32)
    flat_rewards = rewards.detach().to(torch.float32)
    for g in range(rewards.numel() // group_size):
        members = [i for i in range(g * group_size, (g + 1) * group_size) if bool(valid[i])]
        if members:
            out[members] = group_advantages(flat_rewards[members], len(members),
                                            normalize_std=normalize_std, eps=eps)
    return out


def truncated_is_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Per-token importance weights ``min(exp(prox - behaviour), cap)``, detached.

    They reweight tokens sampled by the (possibly older) behaviour policy towards the
    proximal policy.  Truncation bounds the variance a very unlikely-under-behaviour token
    can add; the bias it costs is small when staleness is bounded.
    """
    if cap <= 0:
        raise ValueError(f"the IS cap must be > 0, got {cap}")
    return torch.exp(prox_logp.detach() - behaviour_logp.detach()).clamp(max=cap)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(current || reference): ``exp(d) - d - 1``, ``d = ref - logp``.

    Non-negative, unbiased for tokens sampled from the current policy, and low-variance
    (Schulman's "Approximating KL divergence").
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float = 0.2,
              is_cap: float = 2.0, kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None,
              clip_high: float | None = None, per_completion: int = 0
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss (a scalar to minimise) and its statistics.

    Per valid token: ``ratio = exp(logp - prox_logp)``, ``w = min(exp(prox - behaviour),
    is_cap)`` and ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_high) * A) * w``
    (``clip_high`` None: ``clip_eps``), plus ``kl_coef * k3(logp, ref_logp)`` when
    ``ref_logp`` is given and ``kl_coef > 0``.  The loss is the token mean over the whole
    batch: the sum over masked-in tokens divided by their number, so long completions weigh
    more than short ones (no per-sequence averaging); or with ``per_completion = C > 0``
    each completion's token sum over ``C``, averaged over the completions with a masked-in
    token (Dr. GRPO's length-unbiased form).  An empty mask gives a zero loss that still
    backpropagates (to zero gradients).

    Shapes: ``logp``, ``prox_logp``, ``behaviour_logp``, ``ref_logp`` and ``mask`` are
    ``[B, L]``; ``advantages`` is ``[B]`` (per completion) or ``[B, L]`` (per token).  Only
    ``logp`` carries gradient.

    Statistics, all over valid tokens: ``loss``; ``clip_fraction`` (the clipped branch is
    the smaller one, so the token gives no gradient); ``is_weight_mean``;
    ``is_weight_max_hit_fraction`` (the raw weight reached the cap); ``kl`` (mean k3 against
    the reference, 0 without one); ``ratio_mean``; ``approx_kl`` (mean k3 of current against
    proximal: how far this step has moved); ``tokens``.
    """
    check_shapes(logp, prox_logp, behaviour_logp, advantages, mask)
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype)
    # Padding may hold anything; zero the log-ratios there so no inf/NaN enters exp() and
    # then the gradient (0 * inf is NaN even under a mask).
    log_ratio = torch.where(mask, logp - prox_logp.detach(), zero)
    ratio = torch.exp(log_ratio)
    raw_w = torch.exp(torch.where(mask, prox_logp.detach() - behaviour_logp.detach(), zero))
    w = raw_w.clamp(max=is_cap)
    adv = advantages.detach().to(logp.dtype)
    adv = adv if adv.dim() == 2 else adv[:, None]
    high = clip_eps if clip_high is None else clip_high
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped) * w
    kl_tok = None
    if ref_logp is not None:
        if ref_logp.shape != mask.shape:
            raise ValueError("ref_logp must have logp's [B, L] shape")
        kl_tok = k3_kl(logp, torch.where(mask, ref_logp.detach(), logp.detach()))
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_tok
    n = int(mask.sum())
    summed = torch.where(mask, per_token, zero).sum()
    if per_completion:
        loss = summed / (per_completion * max(int(mask.any(dim=1).sum()), 1))
    else:
        loss = summed / max(n, 1)
    return loss, loss_stats(loss, mask, clipped < unclipped, w, raw_w >= is_cap, kl_tok,
                            ratio, log_ratio)


def check_shapes(logp: torch.Tensor, prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                 advantages: torch.Tensor, mask: torch.Tensor) -> None:
    """ValueError unless the token tensors share one ``[B, L]`` shape and ``advantages`` is
    ``[B]`` or ``[B, L]``."""
    if logp.shape != mask.shape or prox_logp.shape != mask.shape \
            or behaviour_logp.shape != mask.shape:
        raise ValueError("logp, prox_logp, behaviour_logp and mask must share one [B, L] shape")
    if advantages.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"advantages must be [B] = [{mask.shape[0]}] or [B, L], "
                         f"got {tuple(advantages.shape)}")


def loss_stats(loss: torch.Tensor, mask: torch.Tensor, was_clipped: torch.Tensor,
               w: torch.Tensor, capped: torch.Tensor, kl_tok: torch.Tensor | None,
               ratio: torch.Tensor, log_ratio: torch.Tensor) -> dict[str, float]:
    """:func:`grpo_loss`'s statistics, as token means over ``mask`` (``[B, L]`` tensors)."""
    n = int(mask.sum())
    denom = max(n, 1)

    def mean(x: torch.Tensor) -> float:
        return float(torch.where(mask, x.detach().to(torch.float32), 0.0).sum()) / denom

    zero = torch.zeros((), dtype=log_ratio.dtype)
    return {"loss": float(loss.detach()), "clip_fraction": mean(was_clipped.float()),
            "is_weight_mean": mean(w), "is_weight_max_hit_fraction": mean(capped.float()),
            "kl": mean(kl_tok) if kl_tok is not None else 0.0, "ratio_mean": mean(ratio),
            "approx_kl": mean(k3_kl(log_ratio.detach(), zero)), "tokens": float(n)}


def staleness_ok(trajectory_versions: Sequence[int], learner_version: int,
                 max_staleness: int) -> bool:
    """Whether a trajectory may still be trained on by a learner at ``learner_version``.

    The oldest policy version among its tokens must be ``>= learner_version -
    max_staleness``; ``max_staleness=0`` is synchronous RL (only the current version).
    Versions below 0 mark tokens no policy produced (tool output) and are ignored; a
    trajectory with no policy tokens has nothing stale in it and is accepted.  Versions
    newer than the learner's are accepted too: they occur after the learner restarts from a
    checkpoint older than the weights the engines still serve.  A negative
    ``max_staleness`` raises ValueError.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    made = [v for v in trajectory_versions if v >= 0]
    return not made or min(made) >= learner_version - max_staleness
