"""Pipeline parallelism (``learner.megatron.pipeline_parallel > 1``) of the megatron learner
(:mod:`erlay.actors.learner.megatron_backend`): every pass over a chunk of rows runs through
megatron-core's non-interleaved 1F1B schedule (``get_forward_backward_func()``), one row per
microbatch, each row right-padded to the chunk's longest sequence (the schedule sends one
fixed ``[S, 1, hidden]`` shape between stages; with a causal mask and RoPE positions from 0
the padding changes no real token).

Only the last stage has logits, so it alone scores completions and computes the losses; the
statistics it reports are shared with the other stages (:meth:`Pipeline.share`).  The loss
each microbatch hands the schedule is its rows' token sum divided by ``n_global / dp`` and
multiplied by the microbatch count (the schedule divides by it), so the backward passes
together take the gradient of the same objective as the unpipelined path: each data-parallel
rank's token mean rescaled so that the data-parallel average is the global token mean.

Not done: a tied output layer (``tie_word_embeddings``) with more than one stage (its
gradient would have to be summed over megatron's embedding group; refused in preflight and
by the learner), interleaved (virtual) stages, more than one row per microbatch.

May import: erlay.actors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import distributed as dist

from erlay.actors.learner.batch import TOKEN_WEIGHTED, TrainBatch, pad_rows
from erlay.actors.learner.grpo import grpo_loss
from erlay.actors.learner.megatron_model import causal_mask, completion_logprobs, right_pad
from erlay.actors.model.megatron_convert import MegatronShape

# (logprobs [1, L], completion mask [1, L], row index in the chunk) -> (token-sum loss, stats)
RowLoss = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, dict[str, float]]]


class Pipeline:
    """One rank's view of the pipeline: its stage, its pipeline group, the schedule."""

    def __init__(self, shape: MegatronShape, device: torch.device, temperature: float) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func
        self.shape, self.device, self.temperature = shape, device, temperature
        self.size = parallel_state.get_pipeline_model_parallel_world_size()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.is_last = self.stage == self.size - 1
        self._schedule = get_forward_backward_func()

    def _run(self, model: Any, prompts: list[list[int]], completions: list[list[int]],
             row_loss: RowLoss | None, forward_only: bool, temperature: float) -> list[Any]:
        """One schedule pass over the rows; the last stage's per-row outputs, in order."""
        rows = len(prompts)
        tokens = right_pad([p + c for p, c in zip(prompts, completions, strict=True)],
                           device=self.device)
        width = tokens.shape[1]
        mask = causal_mask(width, self.device)
        positions = torch.arange(width, device=self.device)[None]
        feed: Iterator[int] = iter(range(rows))

        def loss_func(row: int, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
            logp, cmask = completion_logprobs(logits, [prompts[row]], [completions[row]],
                                              self.shape.vocab_size, temperature)
            if row_loss is None:   # forward only: keep the logprobs, a dummy loss
                return logits.sum() * 0.0, logp.detach()
            loss, stats = row_loss(logp, cmask, row)
            return loss * rows, stats   # the schedule divides by the microbatch count

        def step(data: Iterator[int], stage_model: Any) -> tuple[torch.Tensor, Any]:
            row = next(data)
            out = stage_model(tokens[row:row + 1], positions, mask)
            return out, lambda output: loss_func(row, output)

        return self._schedule(forward_step_func=step, data_iterator=feed, model=[model],
                              num_microbatches=rows, seq_length=width, micro_batch_size=1,
                              forward_only=forward_only)

    def logprobs(self, model: Any, prompts: list[list[int]], completions: list[list[int]]
                 ) -> torch.Tensor | None:
        """No-grad ``[B, L]`` completion logprobs (zero past each completion) on the last
        stage, ``None`` on the others; every stage must call it together."""
        with torch.no_grad():
            rows = self._run(model, prompts, completions, None, True, self.temperature)
        if not self.is_last:
            return None
        width = max((len(c) for c in completions), default=0)
        out = torch.zeros((len(completions), width), device=self.device)
        for b, logp in enumerate(rows):
            out[b, :logp.shape[1]] = logp[0]
        return out

    def train(self, model: Any, prompts: list[list[int]], completions: list[list[int]],
              row_loss: RowLoss, temperature: float | None = None) -> list[dict[str, float]]:
        """Forward and backward of every row (gradients accumulate in ``model``), logprobs
        at ``temperature`` (default: the engines'); the last stage returns each row's
        statistics from ``row_loss``, the others ``[]``."""
        rows = self._run(model, prompts, completions, row_loss, False,
                         self.temperature if temperature is None else temperature)
        return list(rows) if self.is_last else []

    def grpo(self, model: Any, tb: TrainBatch, chunk: list[int], prox: torch.Tensor | None,
             ref: torch.Tensor | None, advantages: torch.Tensor, scale: float,
             **hyper: Any) -> dict[str, float]:
        """Forward and backward of ``tb``'s rows ``chunk`` (gradients accumulate in
        ``model``), each row's GRPO loss scaled by ``scale`` (``dp / n_global``) against
        ``prox`` (and ``ref``), ``[B, W]`` on the last stage; the chunk's token-mean
        statistics (:data:`~erlay.actors.learner.batch.TOKEN_WEIGHTED`), on every stage."""
        comps = [tb.completion_ids[i] for i in chunk]
        row_loss = sft_row_loss(0.0)   # never called on stages before the last
        if self.is_last:
            width = max(len(c) for c in comps)
            row_loss = grpo_row_loss(
                prox, pad_rows([tb.behaviour_logprobs[i] for i in chunk], width,
                               torch.float32).to(self.device),
                advantages[chunk].to(self.device),
                pad_rows([tb.token_mask(i) for i in chunk], width, torch.bool).to(self.device),
                ref, scale, **hyper)
        rows = self.train(model, [tb.prompt_ids[i] for i in chunk], comps, row_loss)
        means = weighted_means(rows, TOKEN_WEIGHTED) if rows else [0.0] * len(TOKEN_WEIGHTED)
        return dict(zip(TOKEN_WEIGHTED, self.share(means), strict=True))

    def share(self, values: list[float]) -> list[float]:
        """The last stage's ``values`` on every stage (a broadcast over the pipeline group;
        the other stages pass a list of the same length)."""
        buf = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(buf, src=self.last_rank, group=self.group)
        return [float(x) for x in buf]

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the pipeline group, in place."""
        dist.all_reduce(value, group=self.group)
        return value


def grpo_row_loss(prox: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                  trained: torch.Tensor, ref: torch.Tensor | None, scale: float,
                  **hyper: Any) -> RowLoss:
    """The per-row GRPO loss of a chunk: ``prox``, ``behaviour``, ``trained`` (and ``ref``)
    ``[B, W]``, ``advantages`` ``[B]``; a row's loss is :func:`grpo_loss`'s token mean over
    it (``hyper``: its keywords) times its token count times ``scale`` (``dp / n_global``);
    its statistics are grpo_loss's plus ``tokens``."""

    def row_loss(logp: torch.Tensor, cmask: torch.Tensor, b: int
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        n = logp.shape[1]
        mask = cmask & trained[b:b + 1, :n]
        loss, stats = grpo_loss(logp, prox[b:b + 1, :n], behaviour[b:b + 1, :n],
                              advantages[b:b + 1], mask,
                              ref_logp=None if ref is None else ref[b:b + 1, :n], **hyper)
        tokens = int(mask.sum())
        return loss * (tokens * scale), {**stats, "tokens": float(tokens)}

    return row_loss


def sft_row_loss(scale: float) -> RowLoss:
    """The per-row SFT loss: minus the row's target logprob sum times ``scale``
    (``dp / n_global``); statistics: the unscaled sum (``loss_sum``)."""

    def row_loss(logp: torch.Tensor, cmask: torch.Tensor, b: int
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        total = -(logp * cmask).sum()
        return total * scale, {"loss_sum": float(total.detach())}

    return row_loss


def weighted_means(rows: list[dict[str, float]], keys: tuple[str, ...]) -> list[float]:
    """Token-weighted means of ``keys`` over row statistics (0 without tokens)."""
    tokens = sum(r["tokens"] for r in rows)
    return [sum(r.get(k, 0.0) * r["tokens"] for r in rows) / tokens if tokens else 0.0
            for k in keys]
