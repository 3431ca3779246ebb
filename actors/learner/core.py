"""The learner's state and update rules, without Ray: what
:class:`erlay.actors.learner.rank.Learner` runs inside its actor, and what the unit tests drive
directly.

Contracts:

- **Versions.** The policy version starts at 0 and grows by one after every ``train_step``
  and after every ``sft`` call (one call, however many steps it takes).  Weights carry the
  version they were published with, and trajectories carry per-token versions, so staleness
  is always ``learner_version - oldest token version``.
- **Determinism.** Same seed, same calls, same thread count: bit-identical weights.  The
  model is initialised from ``seed`` and minibatches are contiguous slices (no shuffling), so
  the only RNG state is torch's and Python's, both of which travel in :meth:`state`.
- **Checkpoints.** ``load_state(state())`` restores the learner exactly: every later call
  gives the same result as it would have on the learner that produced the state.
- **Data parallelism.** With ``world_size > 1`` every rank receives the *same* batch and
  trains on its contiguous shard of the completions; gradients are summed over ranks with
  gloo and each rank's loss is scaled so the result is the token mean over the whole batch.
  The ranks therefore take the same step a single learner would on the whole batch (up to
  float summation order).  The process group forms lazily, at the first collective, because
  the supervisor starts children one at a time and a rank that blocked in its constructor
  waiting for its peers would never let the next one start.
- **fsdp2** (``backend="fsdp2"``): the same batch split and loss scaling, but the model is
  sharded over the ranks, lazily like the group, and FSDP reduces the gradients; rank 0
  serves the weights alone.  :mod:`erlay.actors.learner.fsdp` states what changes.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import distributed as dist

from erlay.actors.learner.advantages import step_advantages
from erlay.actors.learner.batch import (
    TOKEN_WEIGHTED,
    TrainBatch,
    pack_micro_batches,
    pad_rows,
    rank_minibatches,
    rl_learning_rate,
    shard,
    staleness_stats,
    step_metrics,
)
from erlay.actors.learner.fsdp import (
    FQN_LAYOUT,
    Fsdp2Plan,
    build_device,
    clip_global,
    optimizer_by_index,
    optimizer_by_name,
    trainable_names,
)
from erlay.actors.learner.options import LOOPBACK, LearnerOptions, resolve
from erlay.actors.learner.passes import (
    LearnerPasses,
    MicroBatch,
    master_dtype,
    resolve_precision,
)
from erlay.actors.model.build import Policy, build_policy, is_hf, publish_state, shape_of
from erlay.actors.model.layers import checkpoint_layers
from erlay.supervisor.progress import Progress

log = logging.getLogger("erlay.learner")

__all__ = ["LearnerCore", "TrainBatch", "pad_rows", "rank_minibatches", "rl_learning_rate",
           "shard", "staleness_stats"]

STATE_FORMAT = 1


class LearnerCore(LearnerPasses):
    """One learner rank: the policy, its optimiser, versions, and the GRPO and SFT updates.

    ``model_config`` describes the policy (:mod:`erlay.actors.model.build`: an HF causal LM or
    the built-in model).  Only trainable parameters are optimised (with LoRA, the adapters and
    any MTP heads).  The optimiser
    is AdamW (with ``weight_decay=0`` it is exactly Adam).  A frozen reference policy exists only
    when ``kl_coef > 0``; it is the policy RL starts from: the initial weights, replaced by
    the result of each :meth:`sft` warm start.  ``minibatches`` optimiser steps are taken per
    train step, each on a contiguous slice of the batch, all against the same proximal
    logprobs.  Public methods hold one lock, so concurrent callers see whole steps.
    """

    def __init__(self, model_config: dict[str, Any], options: LearnerOptions | None = None,
                 **overrides: Any) -> None:
        """A learner of ``model_config`` with ``options`` (their defaults when None), any
        keyword in ``overrides`` replacing the option of its name."""
        o = self.options = resolve(options, overrides)
        if o.backend not in ("replicated", "fsdp2"):
            raise ValueError(f"LearnerCore runs backend replicated or fsdp2, not {o.backend!r}")
        if not 0 <= o.rank < o.world_size:
            raise ValueError(f"rank {o.rank} is outside world_size {o.world_size}")
        if o.minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {o.minibatches}")
        if o.micro_batch_tokens < 1 or o.logits_chunk_mb < 1:
            raise ValueError(f"micro_batch_tokens and logits_chunk_mb must be >= 1, got "
                             f"{o.micro_batch_tokens} and {o.logits_chunk_mb}")
        self.precision = resolve_precision(o.precision, o.device)
        torch.set_num_threads(o.torch_threads)
        torch.manual_seed(o.seed)
        random.seed(o.seed)
        if o.device != "cpu":
            # The rank's process is its own: every tensor it makes (batches, losses, the
            # model, but an fsdp2 model's shards only) goes to the device; checkpoints and
            # published weights are copied to the host where they are written or sent.
            torch.set_default_device(o.device)
        # fsdp2 builds the whole policy on the host: only shards reach the device (fsdp.py).
        # The learner's weights are in its master dtype whatever dtype the engines serve
        # (model.dtype): fp32, or bf16 for precision bf16 (passes.py).
        master = master_dtype(self.precision)
        spec = {**model_config, "dtype": str(master).removeprefix("torch.")} \
            if is_hf(model_config) else model_config
        with torch.device(build_device(o.backend, o.device)):
            self.model = build_policy(spec, seed=o.seed).to(master)
        if o.activation_checkpointing:
            checkpoint_layers(self.model)
        self.micro_batch_tokens = o.micro_batch_tokens
        self.logits_chunk_bytes = o.logits_chunk_mb * 2**20
        self.config = self.model.cfg
        self.device = o.device
        self._hyper: dict[str, Any] = {"lr": o.lr, "betas": tuple(o.betas),
                                       "weight_decay": o.weight_decay}
        # fsdp2: the model is sharded, and the optimizer remade over the shards, lazily at
        # the first collective call (erlay.actors.learner.fsdp); until then it is whole.
        self._fsdp = Fsdp2Plan(rank=o.rank, cpu_offload=o.fsdp_cpu_offload,
                               reshard_after_forward=o.fsdp_reshard_after_forward) \
            if o.backend == "fsdp2" else None
        self.optimizer = torch.optim.AdamW(self._trainable(), **self._hyper)
        self.reference = self._frozen_copy() if o.kl_coef > 0 else None
        self.max_grad_norm, self.clip_eps, self.is_cap = o.max_grad_norm, o.clip_eps, o.is_cap
        self.kl_coef, self.seed, self.minibatches = o.kl_coef, o.seed, o.minibatches
        self.objective = o.objective
        # The engines' sampling temperature: RL logprobs are scored under the same tempered
        # distribution as the behaviour logprobs, or the importance weights would be wrong.
        self.temperature = o.temperature
        # MTP boosting: the heads train on every batch beside the policy (erlay.actors.model.mtp).
        self.mtp_loss_weight = o.mtp_loss_weight if self.config.mtp_heads else 0.0
        self.lr_decay_steps, self.lr_min_ratio = o.lr_decay_steps, o.lr_min_ratio
        self.rank, self.world_size = o.rank, o.world_size
        self.master_addr, self.master_port = o.master_addr, o.master_port
        self.dist_timeout_s = o.dist_timeout_s
        self.progress = Progress()
        self._step = 0
        self._version = 0
        self._warm_started = False   # a warm start (sft) finished: a resume must not redo it
        self._lock = threading.Lock()
        self._group_ready = False
        log.info("learner rank %d/%d: %d parameters, seed %d", o.rank, o.world_size,
                 self.model.num_parameters(), o.seed)

    # ------------------------------------------------------------------ reading the policy
    def version(self) -> int:
        """The policy version of the current weights."""
        return self._version

    def status(self) -> dict[str, Any]:
        """``{step, version, warm_started}``: where this learner's timeline is."""
        with self._lock:
            return {"step": self._step, "version": self._version,
                    "warm_started": self._warm_started}

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights as numpy arrays, as engines load them."""
        return self.versioned_weights()[1]

    def versioned_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """The current version and its weights, read together (no step runs in between)."""
        with self._lock:
            return self._version, publish_state(self._serving_model())

    def evaluate_logprobs(self, prompts: list[list[int]],
                          completions: list[list[int]]) -> list[list[float]]:
        """Per-token logprobs of each completion under the current weights, at temperature
        1, a micro-batch at a time."""
        if not completions:
            return []
        model = self._serving_model()
        out: list[list[float]] = [[] for _ in completions]
        with self._lock, torch.no_grad(), torch.device(next(model.parameters()).device):
            for micro in pack_micro_batches([len(p) + len(c) for p, c in
                                             zip(prompts, completions, strict=True)],
                                            self.micro_batch_tokens):
                logp = self._scores(model, [prompts[k] for k in micro],
                                    [completions[k] for k in micro], temperature=1.0).logprobs
                for row, k in enumerate(micro):
                    out[k] = logp[row, :len(completions[k])].tolist()
        return out

    # ------------------------------------------------------------------------- updates
    def train_step(self, batch: dict[str, Any] | TrainBatch,
                   expected_step: int | None = None) -> dict[str, float]:
        """One policy update on ``batch`` (a :class:`TrainBatch` or its ``to_dict()``) with
        ``options.objective`` (GRPO by default).

        Advantages come from the whole batch (:mod:`~erlay.actors.learner.advantages`).
        Proximal (and reference) logprobs for every minibatch are computed first, with no
        gradient, before any weight moves; then one optimiser step per minibatch, its
        gradient accumulated over micro-batches of at most ``micro_batch_tokens``
        (:mod:`~erlay.actors.learner.passes`: the same gradient as one pass).  Rows with
        no token in the loss are left out of every forward pass.  The first minibatch runs
        on the proximal weights themselves, so its own forward pass yields its proximal
        logprobs (detached) and the separate no-grad pass is skipped for it: one forward
        fewer per step, same values.
        Progress: phase ``train_step``, a tick after the proximal pass and after each
        minibatch.  Returns metrics; loss statistics are this rank's, token-weighted over
        minibatches, while ``grad_norm`` (mean over minibatches, after the all-reduce) and
        ``tokens`` are global.  Staleness is measured against the version the step started
        from.
        """
        if expected_step is not None and expected_step != self._step:
            # This learner was restored from a checkpoint behind the caller's timeline (a
            # restart of the learner domain): train nothing, say where it is, and let the
            # caller feed the steps since that checkpoint again, in order.
            return {"stale_step": True, "learner_step": self._step, "version": self._version}
        tb = batch if isinstance(batch, TrainBatch) else TrainBatch.from_dict(batch)
        with self._lock, self.progress.working("train_step", work=f"step {self._step + 1}"):
            self._ready()
            started, start_version = time.perf_counter(), self._version
            lr = rl_learning_rate(self._hyper["lr"], self._step, self.lr_decay_steps,
                                  self.lr_min_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # Rows with no token in the loss (stale, failed, filtered by dynamic sampling)
            # add nothing to a loss or its statistics: no forward pass is spent on them.
            chunks = [[i for i in c if any(tb.token_mask(i))]
                      for c in rank_minibatches(len(tb), self.minibatches, self.world_size,
                                                self.rank)]
            micro = self._micro_batches(tb, chunks)
            fixed = [self._fixed_logprobs(tb, c, m, with_prox=j > 0)
                     for j, (c, m) in enumerate(zip(chunks, micro, strict=True))]
            advantages = step_advantages(self.objective, tb, chunks, [r for _, r in fixed],
                                         kl_coef=self.kl_coef, all_sum=self._all_sum)
            self.progress.tick()
            sums = dict.fromkeys(TOKEN_WEIGHTED, 0.0)
            local_tokens = global_tokens = 0
            grad_norms = []
            for chunk, m, adv, (prox, ref) in zip(chunks, micro, advantages, fixed,
                                                  strict=True):
                n_local, n_global, stats, norm = self._minibatch(tb, chunk, m, adv, prox, ref)
                for key in stats:
                    # The heads' loss and accuracy and the policy's entropy are reported
                    # beside the loss statistics, token-weighted the same way.
                    if key in TOKEN_WEIGHTED or key == "entropy" or key.startswith("mtp_"):
                        sums[key] = sums.get(key, 0.0) + stats[key] * n_local
                local_tokens += n_local
                global_tokens += n_global
                grad_norms.append(norm)
                self.progress.tick()
            self._step += 1
            self._version += 1
            self._updated()
            metrics = step_metrics(tb, step=self._step, version=self._version,
                                   start_version=start_version, lr=lr, sums=sums,
                                   local_tokens=local_tokens, global_tokens=global_tokens,
                                   grad_norms=grad_norms, started=started)
        log.debug("train step %d: %s", self._step, metrics)
        return metrics

    def sft(self, prompts: list[list[int]], targets: list[list[int]], steps: int,
            batch_size: int, lr: float | None = None) -> dict[str, Any]:
        """Supervised warm start: cross-entropy on the target tokens only, ``steps`` optimiser
        steps over batches that cycle through the data in order, at ``lr`` (default: the RL
        learning rate; the RL rate is restored afterwards).

        Bumps the version once and, when a reference policy exists, makes the result the new
        reference.  It shares the RL optimiser, so Adam's moments carry over into RL.
        Progress: phase ``sft``, a tick per step.  Returns the loss curve summary: first,
        last and minimum batch loss and up to 11 evenly spaced points of the curve.
        """
        if len(prompts) != len(targets) or not prompts:
            raise ValueError(f"sft needs as many prompts as targets, at least one; got "
                             f"{len(prompts)} and {len(targets)}")
        if steps < 1 or batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
        losses: list[float] = []
        tokens = 0
        rl_lr = self._hyper["lr"]
        with self._lock, self.progress.working("sft", work=f"{steps} steps"):
            self._ready()
            for group in self.optimizer.param_groups:
                group["lr"] = rl_lr if lr is None else lr
            for s in range(steps):
                batch = [(s * batch_size + j) % len(prompts) for j in range(batch_size)]
                mine = shard(batch, self.world_size, self.rank)
                self.optimizer.zero_grad()
                n_local = sum(len(targets[i]) for i in mine)
                (n_global,) = self._all_sum([float(n_local)])
                loss_sum = 0.0
                # Each micro-batch's token sum over the global count: together the token mean
                # one pass over every rank's rows would take (passes.py).
                for loss, nll in self._sft_passes([prompts[i] for i in mine],
                                                  [targets[i] for i in mine],
                                                  (prompts[batch[0]], targets[batch[0]])):
                    (loss * (self.world_size / max(n_global, 1.0))).backward()
                    loss_sum += nll
                (total,) = self._all_sum([loss_sum])
                self._apply_gradients(int(n_global))
                losses.append(total / max(n_global, 1.0))
                tokens += int(n_global)
                self.progress.tick()
            self._version += 1
            self._warm_started = True
            if self._fsdp is not None and self.reference is not None:
                self._fsdp.copy_shards(self.model, self.reference)
            elif self.reference is not None:
                self.reference = self._frozen_copy()
            self._updated()
        for group in self.optimizer.param_groups:
            group["lr"] = rl_lr
        points = sorted({round(k * (steps - 1) / 10) for k in range(11)})
        summary = {"steps": steps, "version": self._version, "tokens": tokens,
                   "loss_first": losses[0], "loss_last": losses[-1], "loss_min": min(losses),
                   "curve": [(p, losses[p]) for p in points]}
        log.info("sft: %d steps, loss %.4f -> %.4f", steps, losses[0], losses[-1])
        return summary

    # ---------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """Everything needed to resume exactly, as picklable CPU objects (copies, not views
        of the live state).  fsdp2: a collective that every rank calls; rank 0 gets the whole
        model and optimizer state (name-keyed), other ranks an empty ``model``."""
        with self._lock:
            return self._state_locked(copied=True)

    def _state_locked(self, copied: bool) -> dict[str, Any]:
        """:meth:`state`, under the lock.  ``copied=False`` returns views of the live tensors:
        only for a caller that copies them before releasing the lock (the checkpointer
        stages them into its own buffer), so the host copy is made once, not twice."""
        def tensors(sd: dict[str, Any]) -> dict[str, Any]:
            return {k: v.detach().clone() if copied else v.detach() for k, v in sd.items()}
        if self._fsdp is not None:   # gathered to rank 0's host: already copies
            self._ready()
            model, reference, optimizer = self._fsdp.full_state(self.model, self.reference,
                                                                self.optimizer)
            layout = {"optimizer_layout": FQN_LAYOUT}
        else:
            optimizer = self.optimizer.state_dict()
            optimizer = copy.deepcopy(optimizer) if copied else optimizer
            model = tensors(self.model.state_dict())
            reference = None if self.reference is None else tensors(self.reference.state_dict())
            layout = {}
        return {
            "format": STATE_FORMAT,
            "model_config": shape_of(self.model),
            "model": model,
            "reference": reference,
            "optimizer": optimizer,
            **layout,
            "step": self._step,
            "version": self._version,
            "warm_started": self._warm_started,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state(self, state: dict[str, Any]) -> int:
        """Restore a :meth:`state`; returns the restored version.

        The model config must match; hyperparameters (lr, clipping) stay this learner's own,
        so a resumed job may change them.  A saved reference policy is restored only when
        this learner uses one (``kl_coef > 0``).  The optimizer state may be keyed by index or
        by parameter name (an fsdp2 checkpoint), whichever backend loads it.  fsdp2: before
        the model is sharded every rank loads alone (the optimizer state waits for the
        sharded optimizer); after, it is a collective that every rank calls.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"learner state format {state.get('format')!r}, "
                             f"expected {STATE_FORMAT}")
        # Fields a checkpoint predates (mtp_heads) compare with this learner's defaults.
        mine = shape_of(self.model)
        if {**mine, **state["model_config"]} != mine:
            raise ValueError(f"checkpoint model config {state['model_config']} does not match "
                             f"this learner's {mine}")
        names = trainable_names(self.model)
        by_name = state.get("optimizer_layout") == FQN_LAYOUT
        with self._lock:
            if self._fsdp is not None:
                self._fsdp.load(self.model, self.reference, self.optimizer, state["model"],
                                state["reference"] or state["model"], state["optimizer"]
                                if by_name else optimizer_by_name(state["optimizer"], names))
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(copy.deepcopy(
                    optimizer_by_index(state["optimizer"], names) if by_name
                    else state["optimizer"]))
                if self.reference is not None:
                    self.reference.load_state_dict(state["reference"] or state["model"])
            for group in self.optimizer.param_groups:  # loading restored the saved ones
                group.update(self._hyper)
            self._step, self._version = int(state["step"]), int(state["version"])
            self._warm_started = bool(state.get("warm_started", True))
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
        log.info("learner rank %d restored step %d, version %d", self.rank, self._step,
                 self._version)
        return self._version

    def close(self) -> None:
        """Leave the process group, if one was formed."""
        if self._group_ready and dist.is_initialized():
            dist.destroy_process_group()
        self._group_ready = False

    # ------------------------------------------------------------------------ internals
    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _ready(self) -> None:
        """fsdp2: shard the model at the first call every rank makes together (collective;
        erlay.actors.learner.fsdp).  Nothing for a replicated learner."""
        if self._fsdp is None or self._fsdp.sharded:
            return
        self._ensure_group()
        # The constructor's optimizer holds the whole parameters: let them go, so each block's
        # whole weights are freed as soon as that block is sharded.
        self.optimizer = None   # type: ignore[assignment]
        self.optimizer = self._fsdp.shard(
            self.model, self.reference, self.device,
            lambda params: torch.optim.AdamW(params, **self._hyper))
        for group in self.optimizer.param_groups:  # a loaded state brought its own
            group.update(self._hyper)

    def _updated(self) -> None:
        """After an update: fsdp2 gathers the new weights for rank 0 to serve (collective)."""
        if self._fsdp is not None:
            self._fsdp.refresh_host(self.model)

    def _serving_model(self) -> Policy:
        """The model this rank reads alone to publish or score (fsdp2: rank 0's host copy)."""
        return self.model if self._fsdp is None else self._fsdp.serving_model(self.model)

    def _frozen_copy(self) -> Policy:
        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        return ref

    def _minibatch(self, tb: TrainBatch, chunk: list[int], micro: list[MicroBatch],
                   advantages: torch.Tensor, prox: torch.Tensor | None,
                   ref: torch.Tensor | None) -> tuple[int, int, dict[str, float], float]:
        """One optimiser step on this rank's ``chunk``, its gradient accumulated over the
        micro-batches ``micro``: (local tokens, global tokens, loss statistics, gradient
        norm).  Every rank calls it the same number of times, even with an empty chunk,
        because it holds the collectives.  ``prox=None`` means the weights are still the
        proximal ones (the first minibatch)."""
        self.optimizer.zero_grad()
        n_local = sum(sum(tb.token_mask(i)) for i in chunk)
        # The unit the objective's loss is a mean over: tokens, or completions.
        units = sum(any(tb.token_mask(i)) for i in chunk) if self.objective.per_sequence \
            else n_local
        n_global, units_global = self._all_sum([float(n_local), float(units)])
        stats: dict[str, float] = {}
        if n_local or (self._fsdp is not None and n_global):
            stats = self._accumulate(tb, chunk, micro, advantages, prox, ref, units_global)
        return n_local, int(n_global), stats, self._apply_gradients(int(n_global))

    def _apply_gradients(self, tokens: int) -> float:
        """Average gradients over ranks, clip, step; returns the pre-clip global norm.

        No step is taken when no rank had a token to train on (Adam's momentum alone
        would still move the weights), nor when the norm is not finite: a NaN step would
        poison every engine the weights go to.  Both conditions are global, so the ranks
        agree on skipping.
        """
        params = self._trainable()
        if tokens == 0:
            return 0.0
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.world_size > 1 and self._fsdp is None:   # fsdp2 reduced them in backward
            self._ensure_group()
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        limit = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        # The MTP heads are clipped on their own: one global norm would let their gradients
        # scale the policy's step, and the heads must not change what RL trains.
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        heads = [p for n, p in named if n.startswith("mtp.")]
        norm = clip_global([p for n, p in named if not n.startswith("mtp.")], limit)
        if heads:
            clip_global(heads, limit)
        if not math.isfinite(norm):
            log.warning("learner rank %d: gradient norm %s, optimiser step skipped", self.rank,
                        norm)
            return norm
        self.optimizer.step()
        return norm

    def _all_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over ranks (float64, so token counts stay exact)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def _all_max(self, values: list[float]) -> list[float]:
        """The largest of each of ``values`` over ranks."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        if self.world_size == 1 or not values:
            return values
        self._ensure_group()
        buf = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(buf, op=op)
        return buf.tolist()

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; "
                               "run one learner rank per process")
        os.environ["MASTER_ADDR"] = self.master_addr
        os.environ["MASTER_PORT"] = str(self.master_port)
        if self.master_addr == LOOPBACK:
            # Gloo binds the interface the host name resolves to unless told otherwise; with
            # every rank on this machine, keep the traffic on loopback like the rest of a
            # local erlay job.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # fsdp2 on GPUs gathers and reduce-scatters CUDA tensors: NCCL; gloo for the rest.
        backend = "cpu:gloo,cuda:nccl" if self._fsdp is not None and \
            self.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.dist_timeout_s))
        self._group_ready = True
        log.info("learner rank %d joined a %s group of %d at %s:%d", self.rank, backend,
                 self.world_size, self.master_addr, self.master_port)
