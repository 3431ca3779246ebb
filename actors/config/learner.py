"""The ``learner`` section of a job config: ranks, optimiser, device, and how the model is
parallelised over the ranks (``backend``: replicated, fsdp2 or megatron; docs/scaling.md).

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig`).  Checks that
need the model's own config (a tensor-parallel size that must divide the head count) run in
preflight, where the HF config is read; this module checks what the keys alone decide.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FsdpSection(Section):
    """``backend: fsdp2``: ``fully_shard`` per transformer block, then the root."""

    cpu_offload: bool = Field(False, description="keep parameters, gradients and optimizer "
                              "state on the host between uses (FSDP2 CPUOffloadPolicy)")
    reshard_after_forward: bool = Field(True, description="free each block's gathered "
                                        "parameters after its forward pass (ZeRO-3); false "
                                        "keeps them until backward (ZeRO-2: faster, more "
                                        "memory)")


class MegatronSection(Section):
    """``backend: megatron``: a megatron-core ``GPTModel`` built from the HF config."""

    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel size; must divide the "
                                 "attention and key-value head counts")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline-parallel size; must divide "
                                   "the layer count")
    data_parallel: int = Field(1, ge=1, description="data-parallel size; tensor x pipeline x "
                               "data must equal learner.num_ranks")


class LearnerSection(Section):
    """How the policy trains: ranks, optimiser, device, and the parallelism backend."""

    num_ranks: int = Field(1, ge=1, description="learner ranks (one actor each, one_for_all)")
    backend: Literal["replicated", "fsdp2", "megatron"] = Field(
        "replicated", description="how the model spreads over the ranks: replicated (every "
        "rank holds all of it; gradients all-reduced), fsdp2 (an HF model sharded with "
        "fully_shard) or megatron (megatron-core tensor/pipeline/data parallel; GPU only)")
    fsdp: FsdpSection = FsdpSection()
    megatron: MegatronSection = MegatronSection()
    lr: float = Field(3e-4, gt=0, description="RL learning rate (Adam)")
    lr_decay_steps: int = Field(0, ge=0, description="cosine-decay the RL learning rate over "
                                "this many steps (0 = constant)")
    lr_min_ratio: float = Field(0.1, gt=0, le=1, description="final learning rate / lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    mtp_loss_weight: float = Field(0.0, ge=0, description="weight of the MTP heads' "
                                   "cross-entropy beside the RL loss (trains the heads only)")
    clip_eps: float = Field(0.2, gt=0, description="PPO/GRPO ratio clip (dapo and gspo use "
                            "their own algorithm.*.clip_low/clip_high)")
    is_cap: float = Field(2.0, ge=1.0, description="truncated importance-weight cap")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient (0 = off); "
                           "reinforce_pp folds it into the reward, the others add a loss term")
    minibatches: int = Field(1, ge=1, description="optimizer steps per RL step, each on a "
                             "contiguous slice of the batch")
    micro_batch_tokens: int = Field(16384, ge=1, description="token budget of one forward/"
                                    "backward pass (rows x their padded length); a "
                                    "minibatch is packed into micro-batches up to it and "
                                    "their gradients accumulate to one optimizer step. It "
                                    "bounds activation memory (docs/scaling.md)")
    logits_chunk_mb: int = Field(256, ge=1, description="MiB of fp32 logits computed at "
                                 "once when scoring tokens (the [tokens, vocab] tensor is "
                                 "never whole)")
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = Field(
        "auto", description="fp32; bf16-mixed (fp32 master weights and optimizer state, "
        "bf16 compute); bf16 (bf16 weights and state); auto = bf16-mixed on cuda, fp32 on cpu")
    activation_checkpointing: bool = Field(False, description="recompute each decoder "
                                           "layer's activations in backward instead of "
                                           "keeping them (less memory, ~1/3 more compute)")
    torch_threads: int = Field(1, ge=1, description="torch threads of each learner process")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where each "
                        "rank keeps the model and computes: cpu, or cuda (the rank's GPU; set "
                        "num_gpus so Ray gives it one)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per learner rank (Ray resource)")
    train_deadline_s: float = Field(300.0, gt=0, description="hang deadline of a train step")
    call_timeout_s: float = Field(900.0, gt=0, description="deadline of one call into the "
                                  "learner (a train step, a checkpoint, publishing weights); "
                                  "past it the coordinator waits for the learner's restart")

    @model_validator(mode="after")
    def _megatron_sizes(self) -> LearnerSection:
        if self.backend != "megatron":
            return self
        m = self.megatron
        product = m.tensor_parallel * m.pipeline_parallel * m.data_parallel
        if product != self.num_ranks:
            raise ValueError(f"megatron tensor_parallel x pipeline_parallel x data_parallel "
                             f"= {m.tensor_parallel} x {m.pipeline_parallel} x "
                             f"{m.data_parallel} = {product}, but learner.num_ranks is "
                             f"{self.num_ranks}")
        if not self.device.startswith("cuda"):
            raise ValueError("backend megatron runs on GPUs only (megatron-core's attention "
                             "needs CUDA): set learner.device: cuda and learner.num_gpus: 1")
        return self
