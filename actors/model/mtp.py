"""Multi-token prediction: the heads' training loss and speculative verification.

The policy's MTP modules (:class:`erlay.actors.model.policy.MTPModule`) draft the tokens after the
next one; the built-in engine verifies the drafts with one forward pass of the base model
(:meth:`erlay.actors.engine.core.DecodeBatch.step`).  Two verification rules, both exact:

- ``coupled`` (the default): a draft at completion position ``p`` is drawn with the same
  uniform ``u(seed, p)`` that plain decoding uses there, and accepted iff it equals the base
  model's own sample at ``p`` (see :mod:`erlay.actors.model.sampling`).  The output is token for
  token what plain decoding produces, so the distribution is the base policy's, and a rollout
  resumed from any prefix continues identically (the replay invariant holds).
- ``rejection``: speculative sampling as in Leviathan et al. / Chen et al.: accept a draft
  ``d ~ q`` with probability ``min(1, p(d) / q(d))``, else sample from the residual
  ``max(0, p - q)``.  The output distribution is the base policy's, but the tokens depend on
  which positions were drafted, so a resumed rollout is not token-identical.

Greedy decoding (temperature 0) accepts a draft iff it is the base model's argmax under both
rules, so greedy output is identical to plain decoding.  Every logprob returned is the base
model's (under the tempered distribution, or at temperature 1 for greedy), never a draft's.

Two draft rules, for either verification (neither changes what is emitted, only how often a
draft is accepted):

- ``argmax`` (the default): the head's most likely token, as vLLM's MTP and EAGLE proposers
  draft.  Under coupled verification a draft ``d`` is accepted with probability ``p(d)``,
  the base model's own probability of it, so a head that ranks the base's likely token first
  is enough; under the rejection rule the proposal is the point mass on ``d`` (accept with
  probability ``p(d)``, else draw from ``p`` without ``d``).
- ``sample``: the head's own draw at the position's uniform (coupled) or an independent draw
  from it (rejection).  Coupled, it is accepted iff the head's and the base's inverse-CDF
  draws at the same ``u`` agree: better than ``argmax`` only when the head's distribution
  matches the base's closely, worse when the head is less sure than the base (the measured
  acceptance of both is in docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from torch.nn import functional as F

from erlay.actors.model.policy import left_pad
from erlay.actors.model.sampling import sample_token_f64, uniform

Verify = Literal["coupled", "rejection"]
Draft = Literal["argmax", "sample"]
# Seed salts of the rejection rule's extra draws (draft, accept test, residual), so they are
# independent of the plain draw u(seed, p).
_SALT_DRAFT, _SALT_ACCEPT, _SALT_RESIDUAL = 0x5EED_D1, 0x5EED_A2, 0x5EED_E3


def mtp_loss(model: Any, prompts: list[list[int]], completions: list[list[int]], *,
             detach_trunk: bool = True) -> tuple[torch.Tensor, int, list[float]]:
    """The MTP heads' summed cross-entropy on the completion tokens, teacher-forced.

    Module ``k`` (1-based) at position ``t`` reads the depth ``k - 1`` representation
    (depth 0: the trunk's final hidden state) and the embedding of token ``t + k``, and
    predicts token ``t + k + 1``; only targets inside a completion count.  With
    ``detach_trunk`` the loss trains the MTP modules only (not the trunk, nor the shared
    embedding and output head), so the policy's RL objective is exactly what it was without
    heads.  Returns (loss sum, targets counted, per-head accuracy).
    """
    n_heads = len(model.mtp)
    if n_heads == 0:
        raise ValueError("the policy has no MTP heads (model.mtp_heads = 0)")
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    tokens, positions, mask = left_pad(seqs)
    hidden, _ = model.hidden(tokens, positions, mask)
    h = hidden.detach() if detach_trunk else hidden
    # The embedding and output head are shared with the policy: detached too, so the loss
    # cannot move the policy's own logits.
    shared_embed = model.embed.weight.detach() if detach_trunk else model.embed.weight
    shared_head = model.head.weight.detach() if detach_trunk else model.head.weight
    width = tokens.shape[1]
    # A target slot counts if it holds a completion token: the last len(c) slots of its row.
    first_completion = torch.tensor([width - len(c) for c in completions])
    total = hidden.new_zeros(())
    count = 0
    accuracy: list[float] = []
    for k in range(1, n_heads + 1):
        length = width - k - 1
        if length <= 0:
            accuracy.append(float("nan"))
            continue
        emb = F.embedding(tokens[:, k:k + length], shared_embed)
        h = model.mtp[k - 1](h[:, :length], emb)
        logits = F.linear(h, shared_head)
        targets = tokens[:, k + 1:k + 1 + length]
        slots = torch.arange(k + 1, k + 1 + length)
        valid = (slots[None, :] >= first_completion[:, None]) & mask[:, :length] \
            & mask[:, k + 1:k + 1 + length]
        if not bool(valid.any()):
            accuracy.append(float("nan"))
            continue
        ce = F.cross_entropy(logits[valid].float(), targets[valid], reduction="sum")
        total = total + ce
        count += int(valid.sum())
        accuracy.append(float((logits[valid].argmax(-1) == targets[valid]).float().mean()))
    return total, count, accuracy


def _probs(row: np.ndarray, temperature: float) -> np.ndarray:
    z = row if temperature in (0, 1) else row / temperature
    w = np.exp(z - z.max())
    return w / w.sum()


def draft_token(q_row: np.ndarray, temperature: float, seed: int, position: int,
                verify: Verify) -> int:
    """The draft at completion position ``position`` from head logits ``q_row``."""
    salt = _SALT_DRAFT if verify == "rejection" else 0
    return sample_token_f64(q_row, temperature, seed ^ salt, position)[0]


def point_mass_logits(drafts: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[B, V]`` logits of the point mass on each row's draft (``-inf`` elsewhere): the
    proposal distribution ``q`` of an ``argmax`` draft, for the rejection rule."""
    q = np.full((len(drafts), vocab_size), -np.inf)
    q[np.arange(len(drafts)), drafts] = 0.0
    return q


def verify_draft(p_row: np.ndarray, q_row: np.ndarray, draft: int, temperature: float,
                 seed: int, position: int, verify: Verify) -> tuple[int, float, bool]:
    """Verify ``draft`` against the base logits ``p_row`` at ``position``: (the token to
    emit, its base logprob, whether the draft was accepted).  A rejected draft's token is
    the base model's replacement, after which the step's remaining drafts are discarded."""
    if verify == "coupled" or temperature == 0:
        token, logprob = sample_token_f64(p_row, temperature, seed, position)
        return token, logprob, token == draft
    p, q = _probs(p_row, temperature), _probs(q_row, temperature)
    if uniform(seed ^ _SALT_ACCEPT, position) * q[draft] < p[draft]:
        return draft, math.log(p[draft]), True
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if not total > 0:   # q == p up to rounding: any rejection is a rounding artefact
        residual, total = p, 1.0
    cdf = np.cumsum(residual)
    token = int(np.searchsorted(cdf, total * uniform(seed ^ _SALT_RESIDUAL, position),
                                side="right"))
    token = min(token, int(np.searchsorted(cdf, total, side="left")))
    return token, math.log(p[token]), False
