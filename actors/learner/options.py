"""Every learner rank's options: one object, one place for their defaults.

The job builds one :class:`LearnerOptions` per rank from its config
(:func:`erlay.actors.job.driver.learner_options`) and hands it to whichever backend
``learner.backend`` names (:class:`~erlay.actors.learner.rank.Learner` for replicated and
fsdp2, :class:`~erlay.actors.learner.megatron_backend.MegatronLearner`); each reads what it
uses.  A learner built directly (a test, a benchmark) may give keyword overrides instead
(:func:`resolve`).  Adding an option touches the config, :func:`learner_options` and the code
that uses it, nothing in between.

    >>> LearnerOptions(lr=1e-3).lr
    0.001
    >>> resolve(LearnerOptions(seed=3), {"rank": 1}).seed, resolve(None, {"rank": 1}).rank
    (3, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from erlay.actors.learner.objectives import Objective

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LearnerOptions:
    """One learner rank's options (see the module docstring)."""

    # The policy update: the objective (GRPO by default) and the optimiser.
    objective: Objective = field(default_factory=Objective)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0
    temperature: float = 1.0        # the engines' sampling temperature
    lr_decay_steps: int = 0
    lr_min_ratio: float = 0.1
    mtp_loss_weight: float = 0.0
    minibatches: int = 1
    # Memory: the token budget of one forward/backward pass (rows x padded length), the
    # logits chunk, the compute precision and per-layer recompute (docs/scaling.md).
    micro_batch_tokens: int = 16384
    logits_chunk_mb: int = 256
    precision: str = "auto"         # auto | fp32 | bf16-mixed | bf16
    activation_checkpointing: bool = False
    # Refit: the engines' model dtype, in which rank 0 publishes (erlay.actors.model.refit),
    # and whether LoRA adapters travel merged (an engine serving the plain model: vLLM).
    serving_dtype: str = "float32"
    refit_merge_lora: bool = False
    seed: int = 0
    torch_threads: int = 1
    device: str = "cpu"
    # The ranks and how they meet.
    rank: int = 0
    world_size: int = 1
    master_addr: str = LOOPBACK
    master_port: int = 29500
    dist_timeout_s: float = 120.0
    rendezvous: str | None = None   # rank 0 announces its address under this key
    # The backend.
    backend: str = "replicated"     # replicated | fsdp2 | megatron
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    tensor_parallel: int = 1        # megatron
    pipeline_parallel: int = 1
    data_parallel: int | None = None
    # Durable state: checkpoints, the ledger, the weights to start from.
    checkpoint_dir: str | None = None
    checkpoint_keep: int = 3
    checkpoint_deadline_s: float = 300.0
    ledger_path: str | None = None
    init_model_dir: str | None = None
    # Remote run storage: the run's URL; rank 0 uploads its checkpoints and ledger there
    # (erlay.actors.learner.uploads), any rank fetches a checkpoint its disk lacks.
    remote_url: str | None = None
    upload_every_s: float = 5.0
    upload_timeout_s: float = 300.0


def resolve(options: LearnerOptions | None, overrides: Mapping[str, Any]) -> LearnerOptions:
    """``options`` (the defaults when None) with ``overrides`` applied; TypeError names an
    override that is no option."""
    base = options or LearnerOptions()
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(LearnerOptions)})
    if unknown:
        raise TypeError(f"no learner option named {', '.join(unknown)}")
    return dataclasses.replace(base, **overrides) if overrides else base
