"""One train step's advantages, from its :class:`TrainBatch`, for whichever objective the
job trains (:mod:`erlay.actors.learner.objectives`), split the way the step's minibatches
are.

Contract: advantages are fixed once per step, before any weight moves, from the whole
batch: a group's baseline sees every valid member however the rows are split over ranks and
minibatches, and reinforce_pp's whitening uses the statistics of every rank's tokens
(``all_sum`` sums over ranks; the identity on one).  Pure apart from that collective.

May import: erlay.actors.learner.batch, erlay.actors.learner.objectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from erlay.actors.learner.batch import TrainBatch, pad_rows
from erlay.actors.learner.objectives import (
    Objective,
    moments,
    sequence_advantages,
    token_returns,
    whiten,
)

AllSum = Callable[[list[float]], list[float]]


def policy_lengths(tb: TrainBatch) -> torch.Tensor:
    """Each completion's policy tokens (tool output, version -1, is not the policy's)."""
    return torch.tensor([sum(v >= 0 for v in row) for row in tb.versions], dtype=torch.float32)


def step_advantages(obj: Objective, tb: TrainBatch, chunks: Sequence[Sequence[int]],
                    refs: Sequence[torch.Tensor | None], *, kl_coef: float = 0.0,
                    all_sum: AllSum = lambda v: v) -> list[torch.Tensor]:
    """The advantages of each of this rank's ``chunks`` (rows of ``tb``): ``[len(chunk)]``
    per completion, or for reinforce_pp ``[len(chunk), L]`` per token, ``L`` the chunk's
    longest completion.  ``refs[j]``: chunk ``j``'s reference logprobs (reinforce_pp with a
    KL penalty needs them; None otherwise).  Every rank must call it (reinforce_pp's
    whitening is a collective)."""
    rewards = torch.tensor(tb.rewards, dtype=torch.float32)
    valid = None if tb.valid is None else torch.tensor(tb.valid, dtype=torch.bool)
    if not obj.token_advantages:
        adv = sequence_advantages(obj, rewards, tb.group_size, valid, policy_lengths(tb))
        return [adv[list(chunk)] for chunk in chunks]
    returns, masks = [], []
    totals = torch.zeros(3, dtype=torch.float64)
    for chunk, ref in zip(chunks, refs, strict=True):
        width = max((len(tb.completion_ids[i]) for i in chunk), default=0)
        mask = pad_rows([tb.token_mask(i) for i in chunk], width, torch.bool)
        behaviour = pad_rows([tb.behaviour_logprobs[i] for i in chunk], width, torch.float32)
        use_kl = kl_coef > 0 and ref is not None
        r = token_returns(rewards[list(chunk)], mask, kl_coef=kl_coef if use_kl else 0.0,
                          behaviour_logp=behaviour if use_kl else None,
                          ref_logp=ref if use_kl else None)
        returns.append(r)
        masks.append(mask)
        totals += moments(r, mask)
    totals = torch.tensor(all_sum(totals.tolist()), dtype=torch.float64)
    return [whiten(r, m, totals) for r, m in zip(returns, masks, strict=True)]
