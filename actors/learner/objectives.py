"""The policy objectives erlay trains with, as pure torch functions: which advantage each
sample (or token) gets, and the loss over a minibatch.  ``algorithm.name`` picks one.

========== ================================================ ===============================
name       advantage                                        loss and aggregation
========== ================================================ ===============================
grpo       group-normalised: ``(r - mean_g) / std_g``       PPO clip, token mean over the
                                                            batch (:func:`grpo_loss`)
dr_grpo    group-centred: ``r - mean_g`` (no std)           PPO clip; each completion's token
                                                            *sum* over a constant
                                                            (``max_tokens``), mean over
                                                            completions (length-unbiased)
dapo       group-normalised, after overlong shaping        decoupled clip ``[1 - clip_low,
           of the reward                                    1 + clip_high]``, token mean;
                                                            all-equal groups are dropped by
                                                            the coordinator and refilled
gspo       group-normalised                                 sequence-level ratio (geometric
                                                            mean of the token ratios) and
                                                            clip, mean over completions
rloo       leave-one-out: ``r - mean of the others``        PPO clip, token mean
reinforce_pp per token: ``r - kl_coef * (KL to go)``,       PPO clip, token mean; no KL loss
           whitened over the whole batch's tokens           term (it is in the reward)
========== ================================================ ===============================

References: GRPO, Shao et al. 2024 (DeepSeekMath, eq. 3); Dr. GRPO, Liu et al. 2025
("Understanding R1-Zero-Like Training", eq. 2-3); DAPO, Yu et al. 2025 (eq. 8 for the clip
and the dynamic-sampling constraint, eq. 13 for overlong shaping); GSPO, Zheng et al. 2025
(eq. 5-7); RLOO, Ahmadian et al. 2024 (eq. 4, from Kool et al. 2019); REINFORCE++, Hu 2025
(sec. 3: token-level KL penalty in the reward, global advantage normalisation).

Every objective keeps erlay's off-policy rules: the trust region is drawn around the proximal
policy and the behaviour/proximal gap is corrected by a truncated importance weight (per
token; per sequence for gspo), and a token under a False mask (stale, failed, tool output)
reaches neither the loss nor the statistics.  Tensors as in :mod:`~.grpo`: ``[B, L]`` over
completion tokens with a boolean mask.

May import: erlay.actors.learner.grpo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from erlay.actors.learner.grpo import (
    check_shapes,
    group_advantages,
    grpo_loss,
    k3_kl,
    loss_stats,
)

Name = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"]
ALGORITHMS: tuple[Name, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp")


@dataclass(frozen=True)
class Objective:
    """One objective and its own knobs, resolved from the config (``algorithm``).

    ``clip_low``/``clip_high``: the ratio clip range ``[1 - clip_low, 1 + clip_high]``
    (None: the learner's symmetric ``clip_eps``).  ``max_tokens``: dr_grpo's constant
    divisor of a completion's token sum (the generation budget).  ``overlong_max``,
    ``overlong_buffer``, ``overlong_penalty``: dapo's soft overlong punishment (0 buffer:
    off).  Raises ValueError for an unknown name or a knob out of range.
    """

    name: Name = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    max_tokens: int = 0
    overlong_max: int = 0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.name!r}; expected one of "
                             f"{', '.join(ALGORITHMS)}")
        for knob in ("clip_low", "clip_high"):
            value = getattr(self, knob)
            if value is not None and not 0 < value < 1 + (knob == "clip_high") * 9:
                raise ValueError(f"{knob} must be in (0, 1) (clip_high up to 10), got {value}")
        if self.name == "dr_grpo" and self.max_tokens < 1:
            raise ValueError("dr_grpo needs max_tokens >= 1 (the generation budget)")
        if self.overlong_buffer and not 0 < self.overlong_buffer <= self.overlong_max:
            raise ValueError(f"overlong_buffer {self.overlong_buffer} must be in "
                             f"(0, overlong_max = {self.overlong_max}]")

    @property
    def per_sequence(self) -> bool:
        """Whether the loss is a mean over completions (dr_grpo, gspo) rather than over
        tokens: the unit a rank's share of a minibatch is counted in."""
        return self.name in ("dr_grpo", "gspo")

    @property
    def token_advantages(self) -> bool:
        """Whether advantages are per token (``[B, L]``) rather than per completion."""
        return self.name == "reinforce_pp"

    def clip_range(self, clip_eps: float) -> tuple[float, float]:
        """``(low, high)`` offsets from 1 of the ratio clip, ``clip_eps`` filling a gap."""
        return (clip_eps if self.clip_low is None else self.clip_low,
                clip_eps if self.clip_high is None else self.clip_high)


def overlong_shaping(lengths: torch.Tensor, max_len: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to each completion's reward.

    0 for a length ``<= max_len - buffer``; ``penalty * ((max_len - buffer) - length) /
    buffer`` inside the buffer (linear from 0 to ``-penalty``); ``-penalty`` beyond
    ``max_len``.  ``buffer = 0`` shapes nothing.
    """
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    inside = penalty * (start - lengths) / buffer
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, inside,
                                   torch.full_like(lengths, -penalty)))


def rloo_advantages(rewards: torch.Tensor, group_size: int,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """Leave-one-out advantages ``[N]``: ``r_i - mean_{j != i} r_j`` over the valid members
    of ``i``'s group (Ahmadian et al. 2024, eq. 4).  A sample alone among its group's valid
    members, and every invalid one, gets 0: there is no baseline to compare it with, and an
    unjudged sample must not be scored.  Raises as :func:`group_advantages`.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{tuple(rewards.shape)} rewards do not split into groups of "
                         f"{group_size}")
    r = rewards.detach().to(torch.float32).view(-1, group_size)
    ok = (torch.ones_like(r, dtype=torch.bool) if valid is None
          else valid.bool().view(-1, group_size))
    r = torch.where(ok, r, torch.zeros_like(r))
    count = ok.sum(dim=1, keepdim=True).to(torch.float32)
    others = (r.sum(dim=1, keepdim=True) - r) / (count - 1).clamp(min=1)
    out = torch.where(ok & (count > 1), r - others, torch.zeros_like(r))
    return out.reshape(-1)


def token_returns(rewards: torch.Tensor, mask: torch.Tensor, *, kl_coef: float = 0.0,
                  behaviour_logp: torch.Tensor | None = None,
                  ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++'s per-token return ``[B, L]`` (undiscounted): the completion's reward,
    earned at its end, minus ``kl_coef`` times the KL still to come, ``sum_{t' >= t}
    (behaviour_logp - ref_logp)`` over the masked-in tokens (the k1 estimate, Hu 2025 eq.
    1-2).  0 under a False mask.  Without a reference (or ``kl_coef = 0``) every token's
    return is the reward.
    """
    mask = mask.bool()
    base = rewards.detach().to(torch.float32)[:, None].expand(mask.shape)
    if kl_coef > 0:
        if behaviour_logp is None or ref_logp is None:
            raise ValueError("a KL penalty in the reward needs behaviour and reference "
                             "logprobs")
        kl = torch.where(mask, behaviour_logp.detach() - ref_logp.detach(), 0.0)
        to_go = torch.flip(torch.cumsum(torch.flip(kl, [1]), 1), [1])
        base = base - kl_coef * to_go
    return torch.where(mask, base, 0.0)


def moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares, count]`` of the masked-in ``values`` (float64): summable
    over minibatches and ranks before :func:`whiten`."""
    m = mask.bool()
    v = torch.where(m, values.detach().to(torch.float64), 0.0)
    return torch.stack([v.sum(), (v * v).sum(), m.sum().to(torch.float64)])


def whiten(values: torch.Tensor, mask: torch.Tensor, totals: torch.Tensor,
           eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with the batch's mean and population std from ``totals``
    (:func:`moments` summed over the whole batch); 0 under a False mask.  A batch whose
    values are all equal has no signal: every advantage is 0."""
    s, ss, n = (float(x) for x in totals)
    if n <= 0:
        return torch.zeros_like(values, dtype=torch.float32)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    std = var ** 0.5
    if std <= 1e-12 * max(1.0, abs(mean)):
        return torch.zeros_like(values, dtype=torch.float32)
    out = (values.to(torch.float32) - mean) / (std + eps)
    return torch.where(mask.bool(), out, 0.0)


def sequence_advantages(obj: Objective, rewards: torch.Tensor, group_size: int,
                        valid: torch.Tensor | None = None,
                        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-completion advantages ``[N]`` for every objective but reinforce_pp (whose
    advantages are per token: :func:`token_returns`, then :func:`whiten`).

    ``lengths`` (policy tokens per completion) feed dapo's overlong shaping; they are
    required when it is on.
    """
    match obj.name:
        case "grpo" | "gspo":
            return group_advantages(rewards, group_size, valid=valid)
        case "dr_grpo":
            return group_advantages(rewards, group_size, normalize_std=False, valid=valid)
        case "dapo":
            shaped = rewards.detach().to(torch.float32)
            if obj.overlong_buffer:
                if lengths is None:
                    raise ValueError("dapo's overlong shaping needs the completions' lengths")
                shaped = shaped + overlong_shaping(lengths, obj.overlong_max,
                                                   obj.overlong_buffer, obj.overlong_penalty)
            return group_advantages(shaped, group_size, valid=valid)
        case "rloo":
            return rloo_advantages(rewards, group_size, valid)
        case "reinforce_pp":
            raise ValueError("reinforce_pp's advantages are per token: use token_returns "
                             "and whiten")


def policy_loss(obj: Objective, logp: torch.Tensor, prox_logp: torch.Tensor,
                behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, clip_eps: float = 0.2, is_cap: float = 2.0, kl_coef: float = 0.0,
                ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``obj``'s loss (a scalar to minimise) over one minibatch, and its statistics (those
    of :func:`grpo_loss`).  ``advantages`` is ``[B]``, or ``[B, L]`` for reinforce_pp.

    The loss is a mean over this minibatch's *units*: tokens, or for
    :attr:`Objective.per_sequence` objectives the completions with a token in the mask.
    Only ``logp`` carries gradient.  Every objective but gspo is :func:`grpo_loss` with its
    own clip range and aggregation.
    """
    low, high = obj.clip_range(clip_eps)
    match obj.name:
        case "gspo":
            return _sequence_loss(logp, prox_logp, behaviour_logp, advantages, mask,
                                  low=low, high=high, is_cap=is_cap, kl_coef=kl_coef,
                                  ref_logp=ref_logp)
        case _:
            # Token-level: grpo's surrogate with the objective's clip range and aggregation;
            # reinforce_pp's KL is already in its returns, so it takes no loss term too.
            return grpo_loss(logp, prox_logp, behaviour_logp, advantages, mask,
                             clip_eps=low, clip_high=high, is_cap=is_cap,
                             kl_coef=0.0 if obj.name == "reinforce_pp" else kl_coef,
                             ref_logp=ref_logp, per_completion=obj.max_tokens
                             if obj.name == "dr_grpo" else 0)


def _sequence_loss(logp: torch.Tensor, prox: torch.Tensor, behaviour: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, *, low: float, high: float,
                   is_cap: float, kl_coef: float, ref_logp: torch.Tensor | None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: per completion ``s = exp(mean_t (logp - prox))`` (the geometric mean of its
    token ratios), ``w = min(exp(mean_t (prox - behaviour)), is_cap)`` and ``-min(s * A,
    clip(s, 1 - low, 1 + high) * A) * w``, plus ``kl_coef`` times its mean token k3 against
    the reference; averaged over the completions with a masked-in token."""
    check_shapes(logp, prox, behaviour, advantages, mask)
    if advantages.dim() != 1:
        raise ValueError("gspo's advantages are per completion ([B])")
    mask = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype)
    counts = mask.sum(dim=1)
    has = counts > 0
    denom = counts.clamp(min=1).to(logp.dtype)
    log_ratio = torch.where(mask, logp - prox.detach(), zero)
    seq_ratio = torch.exp(log_ratio.sum(dim=1) / denom)
    raw_w = torch.exp(torch.where(mask, prox.detach() - behaviour.detach(), zero).sum(dim=1)
                      / denom)
    w = raw_w.clamp(max=is_cap)
    adv = advantages.detach().to(logp.dtype)
    unclipped = seq_ratio * adv
    clipped = seq_ratio.clamp(1.0 - low, 1.0 + high) * adv
    per_seq = -torch.minimum(unclipped, clipped) * w
    kl_tok = None
    if ref_logp is not None:
        kl_tok = k3_kl(logp, torch.where(mask, ref_logp.detach(), logp.detach()))
        if kl_coef > 0:
            per_seq = per_seq + kl_coef * torch.where(mask, kl_tok, zero).sum(dim=1) / denom
    rows = int(has.sum())
    loss = torch.where(has, per_seq, zero).sum() / max(rows, 1)
    # Statistics stay token means (a completion's value on each of its tokens), so they
    # average over minibatches like every other objective's.
    def spread(x: torch.Tensor) -> torch.Tensor:
        return x[:, None].expand(mask.shape)
    return loss, loss_stats(loss, mask, spread(clipped < unclipped), spread(w),
                            spread(raw_w >= is_cap), kl_tok, spread(seq_ratio), log_ratio)
