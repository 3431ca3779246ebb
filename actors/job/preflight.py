"""Checks of the job's plug-ins and data before anything starts.

``erlay run`` calls :func:`preflight` after the config validates and before it creates the run
directory or starts Ray.  Each problem is one :class:`~erlay.actors.config.ConfigError` line,
so the command exits 2 having started nothing:

- the environment or judge class does not implement its protocol.  The check is structural,
  as :mod:`erlay.environments.base` defines it: a plain class with the protocol's methods is
  valid; the error names the class path and the missing members;
- the class rejects its configured ``kwargs`` (checked against its signature, then by
  building the environment, which the job does anyway);
- a prompt cannot fit ``model.max_seq_len`` together with ``engine.max_new_tokens``: the
  first :data:`PROMPTS_CHECKED` episodes, and as many warm-start ones, are reset and
  tokenized;
- the environment's ``reset`` fails on those episodes;
- ``data.train`` / ``data.validation`` (:mod:`erlay.actors.data`): a missing file or uncached
  hub id, a missing column, a bad row (named by file and 1-based row), an empty dataset, an
  environment class that takes no ``rows``; with a dataset every row's prompt is checked
  against the sequence limit (up to :data:`ROWS_CHECKED` rows), not only the first episodes;
- ``learner.backend`` fsdp2 / megatron on a model or machine it cannot run on
  (:mod:`erlay.actors.job.preflight_learner`).

May import: erlay.supervisor, erlay.environments, erlay.judges, erlay.actors.config,
erlay.actors.model, erlay.actors.job.modelplan, erlay.actors.job.preflight_learner,
erlay.actors.data.
"""

from __future__ import annotations

import inspect
from typing import Any

from erlay.actors.config import ConfigError, JobConfig
from erlay.actors.job.modelplan import ModelPlan, plan_model
from erlay.supervisor.imports import import_path

PROMPTS_CHECKED = 64
ROWS_CHECKED = 100_000   # dataset rows whose prompts are tokenized before the start
WARM_START_BASE = 10_000_000  # the coordinator's warm-start episode indexes start here

ENV_METHODS = ("reset", "step", "observe", "demonstration")


def _bind(target: Any, kwargs: dict[str, Any], key: str, path: str) -> None:
    """The kwargs fit ``target``'s signature, or a ConfigError naming the key and class."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C type: nothing to check up front
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{key}: {path} rejects its kwargs {sorted(kwargs)}: {exc}") from None


def check_environment_class(path: str, kwargs: dict[str, Any]) -> Any:
    """The environment class at ``path``, checked for the protocol's methods and kwargs."""
    target = import_path(path, "environment")
    missing = [m for m in ENV_METHODS if not callable(getattr(target, m, None))]
    if missing and isinstance(target, type):
        raise ConfigError(f"environment.class: {path} does not implement the Environment "
                          f"protocol: missing {', '.join(missing)}")
    _bind(target, kwargs, "environment.kwargs", path)
    return target


def _takes(target: Any, name: str) -> bool:
    """Whether ``target``'s signature accepts the keyword ``name`` (True when unknowable)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_judge_class(path: str, kwargs: dict[str, Any]) -> Any:
    """The judge class at ``path``, checked for ``score`` or ``score_async`` and kwargs."""
    target = import_path(path, "judge")
    if isinstance(target, type) and not (callable(getattr(target, "score", None))
                                         or callable(getattr(target, "score_async", None))):
        raise ConfigError(f"judge.class: {path} does not implement the Judge protocol: "
                          "missing score (or score_async)")
    _bind(target, kwargs, "judge.kwargs", path)
    return target


def build_environment(cfg: JobConfig, rows: list[dict[str, Any]] | None = None) -> Any:
    """Build the job's environment (given dataset ``rows``, the environment that plays
    them), turning every way it can fail into one ConfigError."""
    from erlay.environments.base import load_environment
    path = cfg.environment.cls
    kwargs = dict(cfg.environment.kwargs)
    if rows is not None:
        from erlay.actors.data.rows import environment_kwargs
        target = import_path(path, "environment")
        if not _takes(target, "rows"):
            raise ConfigError(f"data.train: {path} takes no dataset rows (no rows= parameter);"
                              f" use erlay.environments.dataset:DatasetEnv, or give the class "
                              f"rows= and shuffle= parameters")
        kwargs = environment_kwargs(cfg.data, kwargs, rows)
    check_environment_class(path, kwargs)
    try:
        return load_environment(path, **kwargs)
    except TypeError as exc:  # missing members on the built object
        raise ConfigError(f"environment.class: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's constructor: any error is bad input
        raise ConfigError(f"environment.class: building {path} failed: "
                          f"{type(exc).__name__}: {exc}") from None


def check_prompts(cfg: JobConfig, env: Any, plan: ModelPlan, rows: int = 0,
                  warm_start: bool = True) -> None:
    """Reset the first episodes of training and of the warm start (with ``rows`` dataset
    rows: the first ``rows`` episodes, which play every row once); each prompt must leave
    ``engine.max_new_tokens`` of room in the sequence limit (``model.max_seq_len``, or the
    HF model's position limit)."""
    seq_len, tokenizer = plan.max_seq_len, plan.tokenizer
    limit = seq_len - cfg.engine.max_new_tokens
    if limit < 1:
        raise ConfigError(f"engine.max_new_tokens: {cfg.engine.max_new_tokens} leaves no room "
                          f"for a prompt in model.max_seq_len {seq_len}")
    indexes = [*range(max(PROMPTS_CHECKED, min(rows, ROWS_CHECKED))),
               *(range(WARM_START_BASE, WARM_START_BASE + PROMPTS_CHECKED)
                 if cfg.warm_start.steps and warm_start else ())]
    for index in indexes:
        try:
            episode = env.reset(index, cfg.run.seed)
            prompt = tokenizer.prompt_ids(episode.prompt, episode.metadata.get("messages"),
                                          getattr(env, "tools", None))
        except Exception as exc:  # noqa: BLE001 - the user's reset: any error is bad input
            raise ConfigError(f"environment.class: {cfg.environment.cls}.reset({index}, "
                              f"{cfg.run.seed}) failed: {type(exc).__name__}: {exc}") from None
        if len(prompt) > limit:
            # With no model.max_seq_len the model's position limit binds: raising it is no fix.
            bound = ", the model's position limit" if cfg.model.hf and \
                cfg.model.max_seq_len is None else ""
            source = episode.metadata.get("source")
            what = f"{source}'s prompt" if isinstance(source, str) else \
                f"episode {index}'s prompt"
            raise ConfigError(
                f"model.max_seq_len: {what} is {len(prompt)} tokens; with "
                f"engine.max_new_tokens {cfg.engine.max_new_tokens} it needs max_seq_len >= "
                f"{len(prompt) + cfg.engine.max_new_tokens} (is {seq_len}{bound})")


def load_data(cfg: JobConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``data.train``'s rows and ``data.validation``'s (None when unset), every row
    checked (:func:`erlay.actors.data.rows.load_rows`)."""
    from erlay.actors.data.rows import load_rows
    rows = load_rows(cfg.data, "train")
    val_rows = load_rows(cfg.data, "validation") if cfg.data.validation is not None else None
    return rows, val_rows


def check_data(cfg: JobConfig, plan: ModelPlan, rows: list[dict[str, Any]],
               val_rows: list[dict[str, Any]] | None) -> tuple[Any, Any]:
    """Build the environment on the training rows, and on the validation rows, and check
    their prompts; returns ``(train env, validation env or None)``."""
    env = build_environment(cfg, rows)
    check_prompts(cfg, env, plan, rows=len(rows))
    if val_rows is None:
        return env, None
    val_env = build_environment(cfg, val_rows)
    size = min(len(val_rows), cfg.data.validation_size or len(val_rows))
    check_prompts(cfg, val_env, plan, rows=size, warm_start=False)
    return env, val_env


def check_backend(cfg: JobConfig, plan: ModelPlan) -> None:
    """``learner.backend`` against the model and this machine (preflight_learner)."""
    if cfg.learner.backend == "replicated":
        return
    from erlay.actors.job.preflight_learner import check_learner_backend
    from erlay.actors.model.hf import load_hf_config
    hf_config = None
    if plan.is_hf:
        from pathlib import Path
        hf_config = load_hf_config(Path(plan.spec["hf"]), cfg.model.trust_remote_code)
    check_learner_backend(cfg, hf_config)


def preflight(cfg: JobConfig, plan: ModelPlan | None = None) -> Any:
    """Run every check; return the built environment (the job reuses it)."""
    # The dataset first: a bad row is the commonest mistake, and finding it needs no model.
    data = load_data(cfg) if cfg.data.train is not None else None
    plan = plan or plan_model(cfg)   # the model and tokenizer first: the prompts need them
    check_backend(cfg, plan)
    check_judge_class(cfg.judge.cls, dict(cfg.judge.kwargs))
    if data is not None:
        return check_data(cfg, plan, *data)[0]
    env = build_environment(cfg)
    check_prompts(cfg, env, plan)
    return env
