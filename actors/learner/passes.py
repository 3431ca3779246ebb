"""The forward and backward passes of a learner step, in micro-batches, at the learner's
precision: what :class:`~erlay.actors.learner.core.LearnerCore` runs for each minibatch.

Memory.  A minibatch's rows are packed into micro-batches of at most ``micro_batch_tokens``
(rows times their padded length: :func:`~erlay.actors.learner.batch.pack_micro_batches`);
each micro-batch runs its own forward and backward pass and the gradients accumulate to the
minibatch's one optimiser step, so activation memory is bounded by the budget, not by the
minibatch.  Token logprobs come from the hidden states in chunks of ``logits_chunk_mb`` MiB
(:func:`~erlay.actors.model.policy.score_completions`): no ``[tokens, vocabulary]`` tensor
exists whole, in the training pass or the no-grad proximal and reference passes.

Equality.  Micro-batch ``m``'s loss is its own mean over its units (tokens, or completions
for a per-sequence objective) times ``units_m * world_size / units_global``: summed over the
micro-batches this is exactly the mean over the whole minibatch's units that one pass would
take, for every objective, so the accumulated gradient equals the un-split one up to float
summation order (``tests/actors/learner/test_micro_batches.py``).  Advantages (whitened or
not) are fixed per step before any pass (:mod:`~erlay.actors.learner.advantages`), and rows
with no trained token never reach a pass.

fsdp2.  Every forward and backward is a collective there, so every rank runs as many passes
per minibatch as the rank with the most micro-batches (one all-reduce per step agrees on the
counts); a rank out of rows runs an idle pass on one row with a zero loss.

Precision (``learner.precision``): ``fp32``; ``bf16-mixed``, fp32 master weights and
optimiser state with bf16 autocast compute (the GPU default, ``auto`` on cuda); ``bf16``,
bf16 weights and state.  The head's logits are made in the compute dtype and reduced in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from erlay.actors.learner.batch import TOKEN_WEIGHTED, TrainBatch, pack_micro_batches, pad_rows
from erlay.actors.learner.objectives import Objective, policy_loss
from erlay.actors.model.build import Policy
from erlay.actors.model.mtp import mtp_loss
from erlay.actors.model.policy import CompletionScores, score_completions

Precision = Literal["fp32", "bf16-mixed", "bf16"]
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")

# A micro-batch: positions into its minibatch's rows; None is an idle pass (fsdp2).
MicroBatch = list[int] | None


def resolve_precision(precision: str, device: str) -> Precision:
    """``auto`` is bf16-mixed on a GPU and fp32 on the CPU (where bf16 matmuls are no faster
    on most hosts); the others are themselves.

    >>> resolve_precision("auto", "cuda:0"), resolve_precision("auto", "cpu")
    ('bf16-mixed', 'fp32')
    """
    if precision not in PRECISIONS:
        raise ValueError(f"learner.precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if precision == "auto":
        return "bf16-mixed" if device.startswith("cuda") else "fp32"
    return precision  # type: ignore[return-value]


def master_dtype(precision: Precision) -> torch.dtype:
    """The dtype of the learner's weights, gradients and optimiser state."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The matmuls' dtype, None when it is the weights' own."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


class LearnerPasses:
    """The micro-batched passes of :class:`~erlay.actors.learner.core.LearnerCore` (module
    docstring); the core owns the state named here and the collectives."""

    model: Policy
    reference: Policy | None
    objective: Objective
    temperature: float
    clip_eps: float
    is_cap: float
    kl_coef: float
    mtp_loss_weight: float
    world_size: int
    micro_batch_tokens: int
    logits_chunk_bytes: int
    precision: Precision
    device: str
    _fsdp: Any
    _all_sum: Callable[[list[float]], list[float]]
    _all_max: Callable[[list[float]], list[float]]

    # ------------------------------------------------------------------ packing
    def _micro_batches(self, tb: TrainBatch, chunks: list[list[int]]) -> list[list[MicroBatch]]:
        """Each minibatch's micro-batches (positions into its chunk); fsdp2 pads every
        rank's lists to the longest with idle passes (one collective for the step)."""
        packs: list[list[MicroBatch]] = [
            list(pack_micro_batches([len(tb.prompt_ids[i]) + len(tb.completion_ids[i])
                                     for i in chunk], self.micro_batch_tokens))
            for chunk in chunks]
        if self._fsdp is not None and self.world_size > 1:
            most = self._all_max([float(len(p)) for p in packs])
            for p, n in zip(packs, most, strict=True):
                p.extend([None] * (int(n) - len(p)))
        return packs

    def _compute(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to bf16 under bf16-mixed precision; nothing otherwise."""
        if self.precision != "bf16-mixed":
            return contextlib.nullcontext()
        return torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16)

    def _scores(self, model: Policy, prompts: list[list[int]], completions: list[list[int]],
                *, entropy: bool = False, temperature: float | None = None
                ) -> CompletionScores:
        """Completion logprobs under ``temperature`` (default: the engines')."""
        with self._compute():
            return score_completions(model, prompts, completions,
                                     self.temperature if temperature is None else temperature,
                                     chunk_bytes=self.logits_chunk_bytes,
                                     compute_dtype=compute_dtype(self.precision),
                                     entropy=entropy)

    @staticmethod
    def _rows(tb: TrainBatch, chunk: list[int], micro: MicroBatch
              ) -> tuple[list[list[int]], list[list[int]]]:
        """A micro-batch's prompts and completions (an idle pass: the batch's first row)."""
        rows = [chunk[k] for k in micro] if micro else [chunk[0] if chunk else 0]
        return [tb.prompt_ids[i] for i in rows], [tb.completion_ids[i] for i in rows]

    # ------------------------------------------------------------------ no-grad passes
    def _fixed_logprobs(self, tb: TrainBatch, chunk: list[int], micro: list[MicroBatch], *,
                        with_prox: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Proximal (if ``with_prox``) and, with a KL term, reference logprobs ``[len(chunk),
        L]`` of one minibatch, with no gradient, a micro-batch at a time.  Nothing for a
        minibatch with no trained tokens (fsdp2 still runs its passes: collectives)."""
        trained = any(any(tb.token_mask(i)) for i in chunk)
        if not trained and self._fsdp is None:
            return None, None
        width = max((len(tb.completion_ids[i]) for i in chunk), default=0)
        out: dict[str, torch.Tensor] = {}
        models = ([("prox", self.model)] if with_prox else []) + \
            ([("ref", self.reference)] if self.reference is not None else [])
        with torch.no_grad():
            for name, model in models:
                full = out[name] = torch.zeros((len(chunk), width), dtype=torch.float32)
                for m in micro:
                    logp = self._scores(model, *self._rows(tb, chunk, m)).logprobs
                    if m:
                        full[m, :logp.shape[1]] = logp.to(full.device)
        if not trained:
            return None, None
        return out.get("prox"), out.get("ref")

    # ------------------------------------------------------------------ training passes
    def _accumulate(self, tb: TrainBatch, chunk: list[int], micro: list[MicroBatch],
                    advantages: torch.Tensor, prox: torch.Tensor | None,
                    ref: torch.Tensor | None, units_global: float
                    ) -> dict[str, float]:
        """Forward and backward of every micro-batch of one minibatch, gradients summed into
        the parameters (module docstring); the minibatch's token-weighted statistics."""
        sums: dict[str, float] = {}
        n_local = 0
        for m in micro:
            if not m:
                self._idle_pass(*self._rows(tb, chunk, m))
                continue
            loss, stats, units, tokens = self._micro_loss(tb, chunk, m, advantages, prox, ref)
            (loss * (units * self.world_size / units_global)).backward()
            for key, value in stats.items():
                if key in TOKEN_WEIGHTED or key == "entropy" or key.startswith("mtp_"):
                    sums[key] = sums.get(key, 0.0) + value * tokens
            n_local += tokens
        return {k: v / max(n_local, 1) for k, v in sums.items()}

    def _micro_loss(self, tb: TrainBatch, chunk: list[int], micro: list[int],
                    advantages: torch.Tensor, prox: torch.Tensor | None,
                    ref: torch.Tensor | None
                    ) -> tuple[torch.Tensor, dict[str, float], int, int]:
        """One micro-batch's objective loss (a mean over its own units), its statistics,
        its units and its trained tokens.  ``prox=None``: the weights are still the proximal
        ones (the first minibatch), so this pass's own logprobs, detached, are they."""
        prompts, completions = self._rows(tb, chunk, micro)
        scores = self._scores(self.model, prompts, completions, entropy=True)
        logp = scores.logprobs
        width = logp.shape[1]
        rows = [chunk[k] for k in micro]
        own_prox = logp.detach() if prox is None else prox[micro, :width].to(logp.device)
        behaviour = pad_rows([tb.behaviour_logprobs[i] for i in rows], width, torch.float32)
        mask = scores.mask & pad_rows([tb.token_mask(i) for i in rows], width, torch.bool)
        adv = advantages[micro] if advantages.dim() == 1 else advantages[micro, :width]
        loss, stats = policy_loss(self.objective, logp, own_prox, behaviour, adv, mask,
                                  clip_eps=self.clip_eps, is_cap=self.is_cap,
                                  kl_coef=self.kl_coef,
                                  ref_logp=None if ref is None else ref[micro, :width])
        tokens = int(mask.sum())
        if scores.entropy is not None:
            stats["entropy"] = float(scores.entropy[mask].sum()) / max(tokens, 1)
        if self.mtp_loss_weight:
            extra, mtp_stats = self._mtp_term(prompts, completions)
            loss = loss + extra
            stats = {**stats, **mtp_stats}
        units = int(mask.any(dim=1).sum()) if self.objective.per_sequence else tokens
        return loss, stats, units, tokens

    def _idle_pass(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """fsdp2, a rank with nothing to train on: the forward and backward passes its peers
        run (they are collectives), with a zero loss, so its gradient adds nothing."""
        loss = self._scores(self.model, prompts, completions).logprobs.sum() * 0.0
        if self.mtp_loss_weight:
            extra, _ = self._mtp_term(prompts, completions)
            loss = loss + extra * 0.0
        loss.backward()

    def _mtp_term(self, prompts: list[list[int]], completions: list[list[int]]
                  ) -> tuple[torch.Tensor, dict[str, float]]:
        """``mtp_loss_weight`` times the heads' mean cross-entropy (it trains the heads only:
        see :func:`erlay.actors.model.mtp.mtp_loss`), and its statistics."""
        with self._compute():
            total, count, accuracy = mtp_loss(self.model, prompts, completions)
        mean = total / max(count, 1)
        stats = {"mtp_loss": float(mean.detach())}
        stats.update({f"mtp_acc{k + 1}": a for k, a in enumerate(accuracy) if a == a})
        return self.mtp_loss_weight * mean, stats

    # ------------------------------------------------------------------ supervised passes
    def _sft_passes(self, prompts: list[list[int]], targets: list[list[int]],
                    idle_row: tuple[list[int], list[int]]
                    ) -> Iterator[tuple[torch.Tensor, float]]:
        """The supervised loss of each micro-batch of ``prompts``/``targets`` (the target
        tokens' negative log-likelihood, summed, plus the MTP heads' term) and the value of
        its likelihood part; fsdp2 pads the count to the ranks' longest with idle passes on
        ``idle_row`` (yielding nothing)."""
        micro: list[MicroBatch] = list(pack_micro_batches(
            [len(p) + len(t) for p, t in zip(prompts, targets, strict=True)],
            self.micro_batch_tokens))
        if self._fsdp is not None and self.world_size > 1:
            (most,) = self._all_max([float(len(micro))])
            micro.extend([None] * (int(most) - len(micro)))
        for m in micro:
            if not m:
                self._idle_pass([idle_row[0]], [idle_row[1]])
                continue
            ps, ts = [prompts[k] for k in m], [targets[k] for k in m]
            # Supervised targets are scored untempered: the temperature is the engines'.
            scores = self._scores(self.model, ps, ts, temperature=1.0)
            nll = -(scores.logprobs * scores.mask).sum()
            loss = nll
            if self.mtp_loss_weight:   # per target token, like the policy's term
                extra, _ = self._mtp_term(ps, ts)
                loss = loss + extra * int(scores.mask.sum())
            yield loss, float(nll.detach())
