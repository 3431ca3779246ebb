"""``learner.backend: megatron``: a learner rank that trains a megatron-core ``GPTModel``
built from an HF Llama- or Qwen2-style model, with tensor, pipeline and data parallelism.

GPU only: megatron-core 0.16's forward pass (and its pipeline schedule) calls CUDA directly,
so :class:`MegatronLearner` raises a clear error when CUDA is absent.  The CPU tests run it
over gloo with those calls patched in the test (tests/actors/learner/); on a GPU
bench/gpu/megatron_parity.py checks it.  The conversion is
:mod:`erlay.actors.model.megatron_convert`.

:class:`MegatronLearner` has :class:`erlay.actors.learner.rank.Learner`'s public surface
(``train_step``, ``sft``, ``publish``, ``versioned_weights``, ``status``, ``state`` /
``load_state``, ``save_checkpoint``, ``wait_checkpoints``, ``erlay_terminate``, ``progress``)
and the same constructor keywords, plus ``tensor_parallel``, ``pipeline_parallel`` and
``data_parallel`` (``learner.megatron``).  Design:

- **Ranks and groups.** ``world_size = tp x pp x dp`` ranks, one per GPU, in one NCCL group
  formed lazily at the first collective (the supervisor starts ranks one at a time; a
  constructor that waited for its peers would never let the next start), then megatron's
  ``parallel_state`` (order tp-cp-ep-dp-pp: ranks ``0 .. tp-1`` are rank 0's
  tensor-parallel group).  The model is built and loaded at that point too.  A world of one
  builds at once.
- **Weights.** Every rank reads the HF weights (``model.hf``), converts them
  (:func:`~erlay.actors.model.megatron_convert.hf_to_megatron`) and keeps its
  tensor-parallel shard.  After each step rank 0's tensor-parallel group gathers the shards
  and rank 0 keeps the merged HF-named weights: what :meth:`publish` sends the engines and
  what checkpoints hold (``state()["model"]``, HF names), so ``erlay export`` writes a
  megatron checkpoint as it writes the replicated learner's.
- **A step.** Each data-parallel rank trains its contiguous shard of the batch (tensor
  ranks of one data-parallel rank see the same rows), logprobs from the model's logits
  (padded vocabulary dropped, divided by the engines' temperature), the GRPO loss of
  :func:`erlay.actors.learner.grpo.grpo_loss`, gradients averaged over the data-parallel
  group, clipped by the global norm (tensor-parallel parameters' squares summed over the
  tensor group, replicated ones counted once), then torch AdamW on the local parameters.
- **Pipeline.** With ``pipeline_parallel > 1`` each rank builds and loads its stage
  (:func:`~erlay.actors.model.megatron_convert.split_pp` of its tensor shard) and every
  pass, no-grad (proximal, reference) or training, runs megatron's 1F1B schedule
  (:mod:`erlay.actors.learner.megatron_pipeline`); the last stage computes logprobs and
  losses and shares the statistics; the gradient norm sums squares over the pipeline group
  too; rank 0 gathers the tensor-merged stages of data-parallel rank 0 and merges them
  (``merge_pp``) for publishing.  A tied output layer with more than one stage is refused.
- **Not done.** LoRA and MTP heads are refused.  With ``tensor_parallel`` or
  ``pipeline_parallel > 1`` checkpoints hold the merged weights but only rank 0's optimizer
  state is meaningful, so a restore restarts Adam's moments (with TP = PP = 1 they are
  restored exactly).
- **Failures.** The ranks share NCCL groups, so they are one ``one_for_all`` domain: any
  rank's death (kill, hang, OOM) restarts all of them from the last checkpoint, as for the
  replicated learner.
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import distributed as dist

from erlay.actors.learner.batch import (
    TOKEN_WEIGHTED,
    TrainBatch,
    pack_micro_batches,
    pad_rows,
    rank_minibatches,
    rl_learning_rate,
    shard,
    step_metrics,
)
from erlay.actors.learner.grpo import group_advantages, grpo_loss
from erlay.actors.learner.megatron_model import (
    build_gpt_model,
    completion_logprobs,
    init_parallel_state,
    load_megatron_state,
    megatron_logits,
    read_hf_state,
    right_pad,
)
from erlay.actors.learner.megatron_pipeline import Pipeline, sft_row_loss
from erlay.actors.learner.options import LOOPBACK, LearnerOptions, resolve
from erlay.actors.model.megatron_convert import (
    check_parallel,
    hf_to_megatron,
    megatron_shape,
    megatron_to_hf,
    merge_pp,
    merge_tp,
    split_pp,
    split_tp,
)
from erlay.supervisor.progress import Progress

log = logging.getLogger("erlay.learner")

STATE_FORMAT = "megatron-1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronUnavailable(RuntimeError):
    """The megatron backend cannot run here (no CUDA, or megatron-core missing)."""


def require_cuda() -> None:
    """Raise :class:`MegatronUnavailable` unless CUDA is available."""
    if not torch.cuda.is_available():
        raise MegatronUnavailable("learner.backend megatron runs on GPUs only: megatron-core "
                                  "0.16's forward pass needs CUDA, and torch sees none here")


class MegatronLearner:
    """One megatron learner rank (module docstring).  GPU only."""

    def __init__(self, model_config: dict[str, Any], options: LearnerOptions | None = None,
                 **overrides: Any) -> None:
        # Built directly (a test), it is the megatron backend unless told otherwise.
        o = self.options = resolve(options or LearnerOptions(backend="megatron"), overrides)
        # fsdp_*, mtp_loss_weight and init_model_dir are other backends' options.
        if o.backend != "megatron":
            raise ValueError(f"MegatronLearner runs learner.backend megatron, not {o.backend!r}")
        require_cuda()
        if not model_config.get("hf"):
            raise ValueError("the megatron backend needs an HF model (model.hf)")
        if model_config.get("lora") or model_config.get("mtp_heads"):
            raise ValueError("the megatron backend trains full weights: no LoRA, no MTP heads")
        if o.tensor_parallel * o.pipeline_parallel * (o.data_parallel or 1) != o.world_size \
                and o.data_parallel is not None:
            raise ValueError(f"tp {o.tensor_parallel} x pp {o.pipeline_parallel} x dp "
                             f"{o.data_parallel} != world_size {o.world_size}")
        from erlay.actors.model.hf import load_hf_config
        self.model_dir = model_config["hf"]
        self.shape = megatron_shape(load_hf_config(Path(self.model_dir)))
        check_parallel(self.shape, o.tensor_parallel, o.pipeline_parallel)
        if o.pipeline_parallel > 1 and self.shape.tied:
            raise ValueError("learner.megatron.pipeline_parallel > 1 with tied input and output "
                             "embeddings is not implemented")
        torch.set_num_threads(o.torch_threads)
        torch.manual_seed(o.seed)
        random.seed(o.seed)
        self.tp, self.pp = o.tensor_parallel, o.pipeline_parallel
        self.dp = o.world_size // (o.tensor_parallel * o.pipeline_parallel)
        self.rank, self.world_size = o.rank, o.world_size
        self.master_addr, self.master_port = o.master_addr, o.master_port
        self._rendezvous = o.rendezvous   # rank 0's address via Ray (learner.rendezvous)
        if o.rendezvous is not None and o.rank == 0:
            from erlay.actors.learner.rendezvous import announce_master
            self.master_addr, self.master_port = announce_master(o.rendezvous)
        self.dist_timeout_s = o.dist_timeout_s
        self.dtype = _DTYPES.get(str(model_config.get("dtype", "float32")), torch.float32)
        # The rank's device: its GPU.  Only a test that patches megatron's CUDA calls (and
        # require_cuda) runs this class with device "cpu" (tests/actors/learner/
        # test_megatron_learner.py); the job's config refuses it.
        self.device = torch.device("cpu") if o.device == "cpu" else torch.device("cuda")
        self._hyper: dict[str, Any] = {"lr": o.lr, "betas": tuple(o.betas),
                                       "weight_decay": o.weight_decay}
        self.max_grad_norm, self.clip_eps, self.is_cap = o.max_grad_norm, o.clip_eps, o.is_cap
        self.kl_coef, self.seed, self.minibatches = o.kl_coef, o.seed, o.minibatches
        # Without a pipeline, each minibatch runs in micro-batches of this many tokens; a
        # pipeline's micro-batches are its rows (megatron_pipeline.py), one at a time.
        self.micro_batch_tokens = o.micro_batch_tokens
        self.temperature = o.temperature
        self.lr_decay_steps, self.lr_min_ratio = o.lr_decay_steps, o.lr_min_ratio
        self.progress = Progress()
        self._step = self._version = 0
        self._warm_started = False
        self._lock = threading.Lock()
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._published: dict[str, torch.Tensor] | None = None   # rank 0: merged HF weights
        self.checkpoint_dir = Path(o.checkpoint_dir) if o.checkpoint_dir else None
        self.checkpoint_keep = o.checkpoint_keep
        self.checkpoint_deadline_s = o.checkpoint_deadline_s
        self._checkpointer: Any = None
        from erlay.actors.learner.checkpoint import FailedSaves
        self._failed_saves = FailedSaves()   # the replicated learner's rule (rank.Learner)
        self.restored: dict[str, Any] | None = None
        self._pending_state: dict[str, Any] | None = None
        info = None
        from erlay.actors.learner.uploads import fetch_newer_checkpoint, start_mirror
        fetch_newer_checkpoint(o)   # remote storage: this node may lack the newest one
        if self.checkpoint_dir is not None:
            from erlay.actors.learner.checkpoint import latest, load
            info = latest(self.checkpoint_dir)
        if info is not None:   # loaded into the model when it is built
            self._pending_state, extra = load(info.path)
            self._step = int(self._pending_state["step"])
            self._version = int(self._pending_state["version"])
            self.restored = {"step": info.step, "path": str(info.path), **extra}
        self.ledger = None
        if o.ledger_path and o.rank == 0:
            from erlay.actors.learner.ledger import LearnerLedger
            self.ledger = LearnerLedger(o.ledger_path)
        if self.ledger is not None:
            self.ledger.started(self._step, self.restored is not None)
        self._mirror = start_mirror(o)   # remote storage: rank 0 uploads both
        if o.world_size == 1:
            self._ensure_model()

    # ------------------------------------------------------------------ the model, lazily
    def _ensure_model(self) -> None:
        """Form the groups, build the model, load the weights (a checkpoint's or the HF
        directory's): at the first collective call, on every rank together."""
        if self.model is not None:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            # Ray gives the actor one GPU (CUDA_VISIBLE_DEVICES): it is device 0.
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        if not dist.is_initialized():
            if self._rendezvous is not None and self.rank != 0:
                from erlay.actors.learner.rendezvous import lookup_master
                self.master_addr, self.master_port = lookup_master(self._rendezvous,
                                                                   self.dist_timeout_s)
            os.environ["MASTER_ADDR"] = self.master_addr
            os.environ["MASTER_PORT"] = str(self.master_port)
            if self.master_addr == LOOPBACK:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("nccl" if cuda else "gloo", rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=timedelta(seconds=self.dist_timeout_s))
        init_parallel_state(self.tp, self.pp)
        from megatron.core import parallel_state
        if cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(self.seed)
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._dp_rank = parallel_state.get_data_parallel_rank()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._pipe = Pipeline(self.shape, self.device, self.temperature) if self.pp > 1 \
            else None
        self.model = build_gpt_model(self.shape, tp=self.tp, pp=self.pp, dtype=self.dtype,
                                     cpu_init=not cuda)
        self.model.to(self.device)
        pending, self._pending_state = self._pending_state, None
        hf = pending["model"] if pending is not None else read_hf_state(self.model_dir)
        self._load_hf(hf)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **self._hyper)
        if pending is not None:
            self._restore_rest(pending)
        if self.kl_coef > 0:
            self.reference = self._frozen_copy()
        self._refresh_published()
        log.info("megatron learner rank %d/%d (tp %d rank %d, dp %d rank %d) ready",
                 self.rank, self.world_size, self.tp, self._tp_rank, self.dp, self._dp_rank)

    def _frozen_copy(self) -> Any:
        """The KL reference: a new model of this rank's shard holding the current weights
        (``deepcopy`` cannot copy megatron's modules: they hold process groups)."""
        frozen = build_gpt_model(self.shape, tp=self.tp, pp=self.pp, dtype=self.dtype,
                                 cpu_init=self.device.type != "cuda").to(self.device)
        load_megatron_state(frozen, self._local_state())
        return frozen.requires_grad_(False)

    def _load_hf(self, hf: dict[str, torch.Tensor]) -> None:
        full = hf_to_megatron(hf, self.shape, tp=self.tp)
        mine = split_tp(full, self.shape, self.tp)[self._tp_rank]
        if self._pipe is not None:
            mine = split_pp(mine, self.shape, self.pp)[self._pipe.stage]
        load_megatron_state(self.model, {k: v.to(self.device, self.dtype)
                                         for k, v in mine.items()})

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()
                if isinstance(v, torch.Tensor)}

    def _refresh_published(self) -> None:
        """Each stage's tensor group of data-parallel rank 0 gathers its shards, rank 0
        gathers the tensor-merged stages and keeps the merged HF weights on the host.  Every
        rank calls it (ranks of other data-parallel ranks return)."""
        if self._dp_rank != 0:
            return
        local = self._local_state()
        if self.tp == 1:
            shards = [local]
        else:
            shards = [{} for _ in range(self.tp)]
            for name, tensor in local.items():
                parts = [torch.empty_like(tensor) for _ in range(self.tp)]
                dist.all_gather(parts, tensor.contiguous(), group=self._tp_group)
                for r, part in enumerate(parts):
                    shards[r][name] = part
        if self._tp_rank != 0:
            return
        merged = merge_tp([{k: v.float().cpu() for k, v in s.items()} for s in shards],
                          self.shape)
        if self._pipe is not None:
            stages: list[Any] = [None] * self.pp if self.rank == 0 else None
            dist.gather_object(merged, stages, dst=0, group=self._pipe.group)
            merged = merge_pp(stages, self.shape) if self.rank == 0 else merged
        if self.rank == 0:
            self._published = megatron_to_hf(merged, self.shape)

    # ------------------------------------------------------------------ reading the policy
    def version(self) -> int:
        return self._version

    def status(self) -> dict[str, Any]:
        """``{step, version, warm_started, restored, committed}`` (as the replicated learner)."""
        info = None
        if self.checkpoint_dir is not None:
            from erlay.actors.learner.checkpoint import latest
            info = latest(self.checkpoint_dir)
        return {"step": self._step, "version": self._version,
                "warm_started": self._warm_started, "restored": self.restored,
                "committed": info.step if info else None}

    def versioned_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """The version and the merged HF-named float32 weights (rank 0).  Before the model
        is built (peers not joined yet) these are the checkpoint's or the HF directory's."""
        if self.rank != 0:
            raise RuntimeError(f"learner rank {self.rank} does not publish weights; rank 0 does")
        with self._lock:
            if self._published is not None:
                weights = self._published
            elif self._pending_state is not None:
                weights = self._pending_state["model"]
            else:
                weights = read_hf_state(self.model_dir)
            return self._version, {k: v.float().cpu().numpy().copy() for k, v in
                                   weights.items()}

    def weights(self) -> dict[str, np.ndarray]:
        return self.versioned_weights()[1]

    def publish(self) -> Any:
        """A :class:`~erlay.actors.model.refit.Refit` as
        :meth:`erlay.actors.learner.rank.Learner.publish` (of the merged float32 weights
        :meth:`versioned_weights` gives, packed in ``options.serving_dtype``)."""
        from erlay.actors.model.refit import put_refit
        version, weights = self.versioned_weights()
        dtype = self.options.serving_dtype
        return put_refit(version, weights, "float32" if dtype == "auto" else dtype)

    # ------------------------------------------------------------------------- updates
    def _fixed_logprobs(self, model: Any, prompts: list[list[int]],
                        completions: list[list[int]]) -> torch.Tensor | None:
        """No-grad completion logprobs ``[B, L]`` (with a pipeline: on its last stage, else
        None), a micro-batch at a time."""
        if self._pipe is not None:
            return self._pipe.logprobs(model, prompts, completions)
        out = torch.zeros((len(completions), max((len(c) for c in completions), default=0)),
                          device=self.device)
        for micro in self._packs(prompts, completions):
            logp = self._logprobs(model, [prompts[k] for k in micro],
                                  [completions[k] for k in micro])[0]
            out[micro, :logp.shape[1]] = logp
        return out

    def _packs(self, prompts: list[list[int]], completions: list[list[int]]
               ) -> list[list[int]]:
        return pack_micro_batches([len(p) + len(c) for p, c in
                                   zip(prompts, completions, strict=True)],
                                  self.micro_batch_tokens)

    def _micro_grpo(self, tb: TrainBatch, chunk: list[int], prox: torch.Tensor,
                    ref: torch.Tensor | None, advantages: torch.Tensor, n_global: int
                    ) -> dict[str, float]:
        """Forward and backward of ``chunk`` in micro-batches, each one's token-mean loss
        scaled by its tokens over the global count (the un-split minibatch's gradient:
        erlay.actors.learner.passes); the chunk's token-weighted statistics."""
        sums = dict.fromkeys(TOKEN_WEIGHTED, 0.0)
        total = 0
        for micro in self._packs([tb.prompt_ids[i] for i in chunk],
                                 [tb.completion_ids[i] for i in chunk]):
            rows = [chunk[k] for k in micro]
            logp, token_mask = self._logprobs(self.model, [tb.prompt_ids[i] for i in rows],
                                              [tb.completion_ids[i] for i in rows])
            width = logp.shape[1]
            behaviour = pad_rows([tb.behaviour_logprobs[i] for i in rows], width,
                                 torch.float32).to(logp.device)
            trained = pad_rows([tb.token_mask(i) for i in rows], width,
                               torch.bool).to(logp.device)
            loss, stats = grpo_loss(
                logp, prox[micro, :width], behaviour, advantages[rows].to(logp.device),
                token_mask & trained, clip_eps=self.clip_eps, is_cap=self.is_cap,
                kl_coef=self.kl_coef, ref_logp=None if ref is None else ref[micro, :width])
            n = int((token_mask & trained).sum())
            (loss * (n * self.dp / n_global)).backward()
            for key in TOKEN_WEIGHTED:
                sums[key] += stats.get(key, 0.0) * n
            total += n
        return {k: v / max(total, 1) for k, v in sums.items()}

    def _logprobs(self, model: Any, prompts: list[list[int]], completions: list[list[int]],
                  temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = right_pad([p + c for p, c in zip(prompts, completions, strict=True)],
                           device=self.device)
        return completion_logprobs(megatron_logits(model, tokens), prompts, completions,
                                   self.shape.vocab_size,
                                   self.temperature if temperature is None else temperature)

    def train_step(self, batch: dict[str, Any] | TrainBatch,
                   expected_step: int | None = None) -> dict[str, float]:
        """One GRPO update, with :meth:`erlay.actors.learner.core.LearnerCore.train_step`'s
        contract (stale steps, minibatches against fixed proximal logprobs, metrics)."""
        if expected_step is not None and expected_step != self._step:
            return {"stale_step": True, "learner_step": self._step, "version": self._version}
        tb = batch if isinstance(batch, TrainBatch) else TrainBatch.from_dict(batch)
        self._ensure_model()
        with self._lock, self.progress.working("train_step", work=f"step {self._step + 1}"):
            started, start_version = time.perf_counter(), self._version
            lr = rl_learning_rate(self._hyper["lr"], self._step, self.lr_decay_steps,
                                  self.lr_min_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            rewards = torch.tensor(tb.rewards, dtype=torch.float32)
            valid = None if tb.valid is None else torch.tensor(tb.valid, dtype=torch.bool)
            advantages = group_advantages(rewards, tb.group_size, valid=valid)
            chunks = rank_minibatches(len(tb), self.minibatches, self.dp, self._dp_rank)
            fixed = []
            with torch.no_grad():
                for chunk in chunks:
                    prompts = [tb.prompt_ids[i] for i in chunk]
                    comps = [tb.completion_ids[i] for i in chunk]
                    has = any(any(tb.token_mask(i)) for i in chunk)
                    prox = self._fixed_logprobs(self.model, prompts, comps) if has else None
                    ref = self._fixed_logprobs(self.reference, prompts, comps) \
                        if has and self.reference is not None else None
                    fixed.append((prox, ref))
            self.progress.tick()
            sums = dict.fromkeys(TOKEN_WEIGHTED, 0.0)
            local_tokens = global_tokens = 0
            norms = []
            for chunk, (prox, ref) in zip(chunks, fixed, strict=True):
                self.optimizer.zero_grad()
                n_local = sum(sum(tb.token_mask(i)) for i in chunk)
                n_global = int(self._dp_sum(float(n_local)))
                stats: dict[str, float] = {}
                if n_local and self._pipe is not None:
                    stats = self._pipe.grpo(
                        self.model, tb, chunk, prox, ref, advantages, self.dp / n_global,
                        clip_eps=self.clip_eps, is_cap=self.is_cap, kl_coef=self.kl_coef)
                elif n_local:
                    stats = self._micro_grpo(tb, chunk, prox, ref, advantages, n_global)
                norms.append(self._apply_gradients(n_global))
                for key in TOKEN_WEIGHTED:
                    sums[key] += stats.get(key, 0.0) * n_local
                local_tokens += n_local
                global_tokens += n_global
                self.progress.tick()
            self._step += 1
            self._version += 1
            self._refresh_published()
            metrics = step_metrics(tb, step=self._step, version=self._version,
                                   start_version=start_version, lr=lr, sums=sums,
                                   local_tokens=local_tokens, global_tokens=global_tokens,
                                   grad_norms=norms, started=started)
        if self.ledger is not None:
            rows = tb.to_dict()
            self.ledger.trained(self._step - 1, self._version - 1, rows["rollout_ids"],
                                rows["versions"], rows.get("loss_mask"))
        if self._checkpointer is not None:
            self._failed_saves.settle(self._checkpointer.poll)
        return metrics

    def sft(self, prompts: list[list[int]], targets: list[list[int]], steps: int,
            batch_size: int, lr: float | None = None) -> dict[str, Any]:
        """Supervised warm start, with :meth:`LearnerCore.sft`'s contract (cross-entropy at
        temperature 1, whatever the engines' temperature)."""
        if len(prompts) != len(targets) or not prompts or steps < 1 or batch_size < 1:
            raise ValueError("sft needs as many prompts as targets, steps >= 1, batch >= 1")
        self._ensure_model()
        losses: list[float] = []
        tokens = 0
        for group in self.optimizer.param_groups:
            group["lr"] = self._hyper["lr"] if lr is None else lr
        with self._lock, self.progress.working("sft", work=f"{steps} steps"):
            for s in range(steps):
                batch = [(s * batch_size + j) % len(prompts) for j in range(batch_size)]
                mine = shard(batch, self.dp, self._dp_rank)
                self.optimizer.zero_grad()
                n_local = sum(len(targets[i]) for i in mine)
                n_global = self._dp_sum(float(n_local))
                loss_sum, loss = 0.0, None
                if n_local and self._pipe is not None:
                    rows = self._pipe.train(self.model, [prompts[i] for i in mine],
                                            [targets[i] for i in mine],
                                            sft_row_loss(self.dp / n_global), 1.0)
                    loss_sum = self._pipe.share([sum(r["loss_sum"] for r in rows)])[0]
                elif n_local:
                    logp, mask = self._logprobs(self.model, [prompts[i] for i in mine],
                                                [targets[i] for i in mine], 1.0)
                    loss = -(logp * mask).sum()
                    loss_sum = float(loss.detach())
                total = self._dp_sum(loss_sum)
                if loss is not None:
                    (loss * (self.dp / n_global)).backward()
                self._apply_gradients(int(n_global))
                losses.append(total / max(n_global, 1.0))
                tokens += int(n_global)
                self.progress.tick()
            self._version += 1
            self._warm_started = True
            if self.reference is not None:
                self.reference = self._frozen_copy()
            self._refresh_published()
        for group in self.optimizer.param_groups:
            group["lr"] = self._hyper["lr"]
        points = sorted({round(k * (steps - 1) / 10) for k in range(11)})
        return {"steps": steps, "version": self._version, "tokens": tokens,
                "loss_first": losses[0], "loss_last": losses[-1], "loss_min": min(losses),
                "curve": [(p, losses[p]) for p in points]}

    def _dp_sum(self, value: float) -> float:
        if self.dp == 1:
            return value
        buf = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(buf, group=self._dp_group)
        return float(buf[0])

    def _apply_gradients(self, tokens: int) -> float:
        """Average gradients over the data-parallel group, clip by the global norm, step;
        no step without tokens or with a non-finite norm (as the replicated learner)."""
        if tokens == 0:
            return 0.0
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self._dp_group)
            flat /= self.dp
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        split = [p for p in params if getattr(p, "tensor_model_parallel", False)]
        replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in split:
            sq += p.grad.double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq, group=self._tp_group)
        for p in replicated:
            sq += p.grad.double().pow(2).sum()
        if self._pipe is not None:   # every stage's parameters are distinct
            self._pipe.all_sum(sq)
        norm = float(sq.sqrt())
        if not math.isfinite(norm):
            log.warning("megatron learner rank %d: gradient norm %s, step skipped", self.rank,
                        norm)
            return norm
        if self.max_grad_norm > 0 and norm > self.max_grad_norm:
            scale = self.max_grad_norm / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        self.optimizer.step()
        return norm

    # ---------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """Rank 0's resumable state: ``model``, the merged HF-named weights (as the
        replicated learner's ``model`` of an HF policy, so ``erlay export`` writes a megatron
        checkpoint as it writes any), the optimizer (exact with tensor_parallel 1), step,
        version and RNG."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 holds the merged state")
        self._ensure_model()
        with self._lock:
            return {"format": STATE_FORMAT, "shape": self.shape.to_dict(),
                    "model": {k: v.clone() for k, v in self._published.items()},
                    "optimizer": copy.deepcopy(self.optimizer.state_dict())
                    if self.tp == self.pp == 1 else None,
                    "step": self._step, "version": self._version,
                    "warm_started": self._warm_started,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def load_state(self, state: dict[str, Any]) -> int:
        """Restore a :meth:`state` on this rank (its tensor shard of the weights)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"learner state format {state.get('format')!r}, expected "
                             f"{STATE_FORMAT}")
        if state["shape"] != self.shape.to_dict():
            raise ValueError(f"checkpoint model shape {state['shape']} does not match "
                             f"{self.shape.to_dict()}")
        if self.model is None:
            self._pending_state = state
            self._ensure_model()
        else:
            with self._lock:
                self._load_hf(state["model"])
                self._restore_rest(state)
                self._refresh_published()
        return self._version

    def _restore_rest(self, state: dict[str, Any]) -> None:
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:
                group.update(self._hyper)
        self._step, self._version = int(state["step"]), int(state["version"])
        self._warm_started = bool(state.get("warm_started", True))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def save_checkpoint(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Rank 0 saves :meth:`state` asynchronously (the replicated learner's
        :class:`~erlay.actors.learner.checkpoint.AsyncCheckpointer`); ``{step, exposed_s,
        committed, failed}``, as the replicated learner answers (a failed save never fails a
        call: it is in ``failed``)."""
        if self.rank != 0 or self.checkpoint_dir is None:
            return {"step": self._step, "exposed_s": 0.0, "committed": None, "failed": []}
        from erlay.actors.learner.checkpoint import AsyncCheckpointer
        self._ensure_model()   # the process group the checkpoint library asks for, too
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(self.checkpoint_dir, keep=self.checkpoint_keep,
                                                   deadline_s=self.checkpoint_deadline_s)
        started = time.perf_counter()
        self._failed_saves.settle(self._checkpointer.wait)
        self._checkpointer.save(self._step, self.state(), extra or {})
        self._checkpointer.wait_snapshot()
        return {"step": self._step, "exposed_s": time.perf_counter() - started,
                "committed": self._checkpointer.committed, "failed": self._failed_saves.take()}

    def wait_checkpoints(self) -> dict[str, Any]:
        """``{committed, failed}``, as the replicated learner answers."""
        if self._checkpointer is not None:
            self._failed_saves.settle(self._checkpointer.wait)
        from erlay.actors.learner.uploads import settle
        answer = {"committed": self.status()["committed"], "failed": self._failed_saves.take()}
        upload = settle(self._mirror, self.options.upload_timeout_s)
        return answer if upload is None else {**answer, "upload": upload}

    def checkpoint_writer(self) -> dict[str, int] | None:
        """``{"step", "pid"}`` of the checkpoint worker writing a save, as the replicated
        learner answers; else None."""
        writer = self._checkpointer.writer if self._checkpointer is not None else None
        return None if writer is None else {"step": writer[0], "pid": writer[1]}

    def erlay_terminate(self) -> None:
        """Commit pending checkpoints, then leave the process groups."""
        if self._checkpointer is not None:
            try:
                self._checkpointer.close()
            except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask
                log.error("megatron learner rank %d: pending checkpoint failed: %s",
                          self.rank, exc)
        if dist.is_initialized():
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
