"""Preflight checks of ``learner.backend`` that need the model: what the config keys alone
cannot decide (:mod:`erlay.actors.config.learner` checks those).

:func:`backend_problem` is pure: given the config, the HF model's config and what this
machine has, it returns the one-line reason the backend cannot run, or None.
:func:`check_learner_backend` gathers those facts and raises it as a
:class:`~erlay.actors.config.ConfigError`, so ``erlay run`` exits 2 before anything starts:

- ``fsdp2`` or ``megatron`` with the built-in model (no ``model.hf``): both shard an HF model;
- ``megatron`` without megatron-core installed (the ``megatron`` extra);
- ``megatron`` on a model the conversion does not cover (not Llama- or Qwen2-style, RoPE
  scaling, sliding windows, ...: :func:`erlay.actors.model.megatron_convert.megatron_shape`);
- ``megatron`` with a tensor-parallel size that does not divide the attention or key-value
  heads or the MLP width, or a pipeline size that does not divide the layers;
- ``megatron`` with ``pipeline_parallel > 1`` on a model with tied input and output
  embeddings (not implemented: the tied gradient is not summed over the stages), LoRA or
  MTP heads;
- ``megatron`` on a machine where torch sees no CUDA device, unless the job attaches to a
  cluster (``ray.address`` or ``RAY_ADDRESS``), whose GPU nodes this machine cannot see.

May import: erlay.actors.config, erlay.actors.model.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from erlay.actors.config import ConfigError, JobConfig


def backend_problem(cfg: JobConfig, hf_config: Any, *, cuda_available: bool,
                    megatron_installed: bool, attached: bool) -> str | None:
    """Why ``cfg.learner.backend`` cannot run this model here (one line), or None."""
    learner = cfg.learner
    backend = learner.backend
    if backend == "replicated":
        return None
    if hf_config is None:
        return (f"learner.backend {backend} shards a Hugging Face model (model.hf); the "
                f"built-in model trains with learner.backend: replicated")
    if backend != "megatron":
        return None
    from erlay.actors.model.megatron_convert import (
        MegatronConfigError,
        check_parallel,
        megatron_shape,
    )
    if not megatron_installed:
        return ("learner.backend megatron needs megatron-core: pip install 'erlay[megatron]' "
                "(megatron-core 0.16)")
    m = learner.megatron
    try:
        shape = megatron_shape(hf_config)
        check_parallel(shape, m.tensor_parallel, m.pipeline_parallel)
    except MegatronConfigError as exc:
        return f"learner.backend megatron: {exc}"
    if m.pipeline_parallel > 1 and shape.tied:
        return ("learner.megatron.pipeline_parallel > 1 with tied input and output embeddings "
                "(tie_word_embeddings) is not implemented; use tensor_parallel and "
                "data_parallel for this model")
    if cfg.model.lora is not None or cfg.model.mtp_heads:
        return ("learner.backend megatron trains the full model: it takes no model.lora and "
                "no model.mtp_heads")
    if not cuda_available and not attached:
        return ("learner.backend megatron runs on GPUs, and torch sees no CUDA device on this "
                "machine (attach to a GPU cluster with ray.address, or use backend fsdp2)")
    return None


def check_learner_backend(cfg: JobConfig, hf_config: Any) -> None:
    """:func:`backend_problem` with this machine's facts; raises ConfigError.  ``hf_config``
    is the HF model's config, or None for the built-in model."""
    if cfg.learner.backend == "replicated":
        return
    cuda = False
    if cfg.learner.backend == "megatron":
        import torch
        cuda = torch.cuda.is_available()
    installed = importlib.util.find_spec("megatron") is not None and \
        importlib.util.find_spec("megatron.core") is not None
    attached = bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    problem = backend_problem(cfg, hf_config, cuda_available=cuda,
                              megatron_installed=installed, attached=attached)
    if problem:
        raise ConfigError(problem)
