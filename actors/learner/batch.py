"""One learner step's input and the pure arithmetic around it: :class:`TrainBatch` (completed,
judged rollouts as GRPO groups, validated on construction), the RL learning-rate schedule,
staleness statistics, and how a batch splits over ranks and minibatches.

Contract: pure functions and a frozen dataclass; no torch state, no I/O.

May import: (nothing of erlay).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class TrainBatch:
    """Completed, judged rollouts for one learner step, as GRPO groups.

    Row ``i`` is one completion of ``prompt_ids[i]``; rows come group by group, ``group_size``
    completions of the same prompt in a row.  Per completion token: the behaviour logprob the
    engine sampled it with, the policy version that produced it (segments of one completion
    may differ when a weight update landed mid-rollout; -1 for tokens no policy produced,
    such as tool output), and whether it is trained on
    (``loss_mask``; tool output injected into a multi-turn completion is not).  ``valid``
    marks the samples that count in their group's advantage statistics: one whose judge or
    user code failed is consumed with weight 0 and must not lower its siblings' baseline as
    a reward of 0 would (None: all count).  Validated on construction; a bad batch raises
    ValueError naming the row.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    versions: list[list[int]]
    rewards: list[float]
    group_size: int
    rollout_ids: list[str]
    loss_mask: list[list[bool]] | None = None
    valid: list[bool] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        columns: dict[str, Sequence[Any]] = {
            "prompt_ids": self.prompt_ids, "behaviour_logprobs": self.behaviour_logprobs,
            "versions": self.versions, "rewards": self.rewards, "rollout_ids": self.rollout_ids}
        if self.loss_mask is not None:
            columns["loss_mask"] = self.loss_mask
        if self.valid is not None:
            columns["valid"] = self.valid
        for name, column in columns.items():
            if len(column) != n:
                raise ValueError(f"{name} has {len(column)} rows, completion_ids has {n}")
        if n == 0:
            raise ValueError("a train batch needs at least one completion")
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"{n} completions do not split into groups of {self.group_size}")
        if len(set(self.rollout_ids)) != n:
            # One rollout fed twice in a step would be trained twice; no caller means it.
            twice = sorted(r for r, k in Counter(self.rollout_ids).items() if k > 1)
            raise ValueError(f"rollout ids repeat in one batch: {', '.join(twice[:5])}"
                             + (f" ({len(twice)} in all)" if len(twice) > 5 else ""))
        for i in range(n):
            self._check_row(i)

    def _check_row(self, i: int) -> None:
        width = len(self.completion_ids[i])
        if not self.prompt_ids[i]:
            raise ValueError(f"row {i}: the prompt is empty")
        per_token: list[tuple[str, Sequence[Any]]] = [
            ("behaviour_logprobs", self.behaviour_logprobs[i]), ("versions", self.versions[i])]
        if self.loss_mask is not None:
            per_token.append(("loss_mask", self.loss_mask[i]))
        for name, row in per_token:
            if len(row) != width:
                raise ValueError(f"row {i}: {name} has {len(row)} entries for "
                                 f"{width} completion tokens")
        # Untrained tokens (tool output) may carry no real behaviour logprob; trained ones must.
        if any(t and math.isnan(lp) for t, lp in zip(self.token_mask(i),
                                                     self.behaviour_logprobs[i], strict=True)):
            raise ValueError(f"row {i} ({self.rollout_ids[i]}): a trained token has a NaN "
                             f"behaviour logprob")
        if not math.isfinite(self.rewards[i]):
            raise ValueError(f"row {i} ({self.rollout_ids[i]}): reward {self.rewards[i]} "
                             f"is not finite")

    def __len__(self) -> int:
        return len(self.completion_ids)

    def token_mask(self, i: int) -> list[bool]:
        """Which tokens of completion ``i`` are trained on."""
        if self.loss_mask is None:
            return [True] * len(self.completion_ids[i])
        return list(self.loss_mask[i])

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (copies): cheap for Ray to serialise, readable in a
        journal.  Copied row by row; ``dataclasses.asdict`` is ~10x slower on these lists."""
        rows = {name: [list(row) for row in getattr(self, name)] for name in
                ("prompt_ids", "completion_ids", "behaviour_logprobs", "versions")}
        return {**rows, "rewards": list(self.rewards), "group_size": self.group_size,
                "rollout_ids": list(self.rollout_ids),
                "loss_mask": None if self.loss_mask is None else
                [list(row) for row in self.loss_mask],
                "valid": None if self.valid is None else list(self.valid)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainBatch:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown train batch fields: {sorted(unknown)}")
        return cls(**data)


def rl_learning_rate(base: float, step: int, decay_steps: int, min_ratio: float) -> float:
    """Cosine decay from ``base`` to ``base * min_ratio`` over ``decay_steps`` RL steps, then
    flat; ``decay_steps = 0`` keeps ``base``.  Pure, so a resumed learner recomputes it."""
    if decay_steps <= 0:
        return base
    progress = min(step, decay_steps) / decay_steps
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def staleness_stats(versions: list[list[int]], learner_version: int) -> dict[str, float]:
    """How many versions behind the learner each trajectory's oldest token is.

    Versions below 0 (tokens no policy produced) are ignored, and trajectories with no
    policy tokens are left out.  Negative staleness is possible (and harmless) right after
    the learner reloads a checkpoint older than the engines' weights.
    """
    made = [[x for x in v if x >= 0] for v in versions]
    lags = [learner_version - min(v) for v in made if v]
    if not lags:
        return {"staleness_mean": 0.0, "staleness_max": 0.0, "staleness_min": 0.0}
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
            "staleness_min": float(min(lags))}


def shard(indices: list[int], parts: int, index: int) -> list[int]:
    """Contiguous part ``index`` of ``parts`` near-equal parts of ``indices`` (may be empty)."""
    base, extra = divmod(len(indices), parts)
    start = index * base + min(index, extra)
    return indices[start:start + base + (1 if index < extra else 0)]


def rank_minibatches(rows: int, minibatches: int, world_size: int, rank: int
                     ) -> list[list[int]]:
    """The rows ``rank`` trains in each of ``minibatches`` optimiser steps.

    Minibatch ``j`` is the whole batch's contiguous slice ``j``, split over the ranks; so the
    ranks together train exactly the rows one learner would in its step ``j``, and N ranks
    take the same steps as one learner at every ``minibatches``.  (Splitting the batch over
    ranks first and each rank's part into minibatches would pair different rows in each
    step.)  Some lists may be empty; every rank still takes every step.
    """
    everything = list(range(rows))
    return [shard(shard(everything, minibatches, j), world_size, rank)
            for j in range(minibatches)]


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions into ``lengths`` (each row's padded length: prompt plus completion) grouped
    into micro-batches whose rows times their longest row fit ``budget`` tokens.

    Rows go longest first, so each micro-batch pads to a length close to its rows' own; the
    order of positions within one is the order they are taken in.  A row longer than the
    budget alone gets a micro-batch of its own (a sequence is never split: such a pass holds
    more than the budget, so set it at least ``model.max_seq_len``).  Pure and
    deterministic: every pass of a step (the proximal, reference and training passes) packs
    the same rows the same way.

    >>> pack_micro_batches([10, 30, 20, 5], 40)
    [[1], [2, 0], [3]]
    >>> pack_micro_batches([10, 30, 20, 5], 1000)
    [[1, 2, 0, 3]]
    >>> pack_micro_batches([], 8)
    []
    """
    if budget < 1:
        raise ValueError(f"micro-batch budget must be >= 1 token, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    for i in order:
        # Longest first: the pack's padded length is its first row's.
        if packs and (len(packs[-1]) + 1) * lengths[packs[-1][0]] <= budget:
            packs[-1].append(i)
        else:
            packs.append([i])
    return packs


# Loss statistics averaged over minibatches, weighted by their token counts.
TOKEN_WEIGHTED = ("loss", "clip_fraction", "is_weight_mean", "is_weight_max_hit_fraction",
                  "kl", "ratio_mean", "approx_kl")


def step_metrics(tb: TrainBatch, *, step: int, version: int, start_version: int, lr: float,
                 sums: dict[str, float], local_tokens: int, global_tokens: int,
                 grad_norms: list[float], started: float) -> dict[str, Any]:
    """The metrics of one RL step, the same for every backend: loss statistics as token
    means of this rank's ``sums`` (statistic x tokens, per minibatch), the mean pre-clip
    gradient norm over minibatches, the batch's reward statistics and the fraction of groups
    whose rewards are all equal (no advantage), and staleness against ``start_version``."""
    rewards = torch.tensor(tb.rewards, dtype=torch.float32)
    groups = rewards.view(-1, tb.group_size)
    flat = (groups.max(dim=1).values == groups.min(dim=1).values).float()
    return {
        "step": step, "version": version, "lr": lr,
        **{k: v / max(local_tokens, 1) for k, v in sums.items()},
        "grad_norm": sum(grad_norms) / len(grad_norms), "tokens": global_tokens,
        "completions": len(tb), "groups": len(tb) // tb.group_size,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "zero_advantage_group_fraction": float(flat.mean()),
        **staleness_stats(tb.versions, start_version),
        "time_s": time.perf_counter() - started,
    }


def pad_rows(rows: list[list[Any]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Right-pad ragged rows with zeros (False) to ``[len(rows), width]``."""
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out
