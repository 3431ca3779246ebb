"""Checks of the job's plug-ins and data before anything starts.

``erlay run`` calls :func:`preflight` after the config validates and before it creates the run
directory or starts Ray.  Each problem is one :class:`~erlay.actors.config.ConfigError` line,
so the command exits 2 having started nothing.

No plug-in code runs in this process.  The environment and the judge are built once, with the
config's kwargs, in a build process of their own under ``plugins.build_timeout_s``
(:mod:`erlay.actors.job.preflight_build`), spawned first so it works while this process loads
the model's tokenizer; it resets the episodes below and sends their prompts back to be
tokenized here.  Refused, in this order:

- ``data.train`` / ``data.validation`` (:mod:`erlay.actors.data`): a missing file or uncached
  hub id, a missing column, a bad row (named by file and 1-based row), an empty dataset;
- the model (:mod:`erlay.actors.job.modelplan`), and ``learner.backend`` fsdp2 / megatron on
  a model or machine it cannot run on (:mod:`erlay.actors.job.preflight_learner`);
- ``engine.max_new_tokens`` leaving no room for a prompt in the sequence limit;
- the judge class does not implement its protocol (structurally, as
  :mod:`erlay.judges.base` defines it), or rejects its ``kwargs`` (checked against its
  signature); its constructor raises, hangs past the deadline, or ends its process;
- the same for the environment class (:mod:`erlay.environments.base`), plus one given a
  dataset's rows that takes no ``rows``; with a dataset the environment is built on its rows,
  and on ``data.validation``'s rows too when that is set;
- its ``reset`` fails on the episodes checked: the first :data:`PROMPTS_CHECKED` episodes
  (with a dataset, every row up to :data:`ROWS_CHECKED`) and as many warm-start ones;
- one of those prompts cannot fit ``model.max_seq_len`` together with
  ``engine.max_new_tokens``.

May import: erlay.supervisor, erlay.environments, erlay.judges, erlay.actors.config,
erlay.actors.model, erlay.actors.job.modelplan, erlay.actors.job.preflight_learner,
erlay.actors.job.preflight_build, erlay.actors.data.
"""

from __future__ import annotations

import sys
from typing import Any

from erlay.actors.config import ConfigError, JobConfig
from erlay.actors.job.modelplan import ModelPlan, plan_model
from erlay.actors.job.preflight_build import (
    BuildProcess,
    BuildRequest,
    EnvironmentBuild,
    PluginCall,
    Prompts,
    Refusal,
)

PROMPTS_CHECKED = 64
ROWS_CHECKED = 100_000   # dataset rows whose prompts are tokenized before the start
WARM_START_BASE = 10_000_000  # the coordinator's warm-start episode indexes start here

Rows = list[dict[str, Any]]


def build_request(cfg: JobConfig, data: tuple[Rows, Rows | None] | None) -> BuildRequest:
    """What the build process builds and resets (pure): the judge; the environment, on
    ``data.train``'s rows when there are rows, and on ``data.validation``'s too when set."""
    kwargs = dict(cfg.environment.kwargs)
    warm = tuple(range(WARM_START_BASE, WARM_START_BASE + PROMPTS_CHECKED)) \
        if cfg.warm_start.steps else ()
    if data is None:
        environments = (EnvironmentBuild(PluginCall(cfg.environment.cls, kwargs), None,
                                         (*range(PROMPTS_CHECKED), *warm)),)
    else:
        from erlay.actors.data.rows import environment_kwargs
        rows, val_rows = data
        train = EnvironmentBuild(
            PluginCall(cfg.environment.cls, environment_kwargs(cfg.data, kwargs, rows)),
            len(rows), (*_first(len(rows)), *warm))
        environments = (train,)
        if val_rows is not None:
            size = min(len(val_rows), cfg.data.validation_size or len(val_rows))
            environments = (train, EnvironmentBuild(
                PluginCall(cfg.environment.cls, environment_kwargs(cfg.data, kwargs, val_rows)),
                len(val_rows), tuple(_first(size))))
    return BuildRequest(PluginCall(cfg.judge.cls, dict(cfg.judge.kwargs)), environments,
                        cfg.run.seed, tuple(sys.path))


def _first(rows: int) -> range:
    """The episodes that play each of ``rows`` dataset rows once (at least the first
    :data:`PROMPTS_CHECKED`, at most :data:`ROWS_CHECKED`)."""
    return range(max(PROMPTS_CHECKED, min(rows, ROWS_CHECKED)))


def prompt_room(cfg: JobConfig, plan: ModelPlan) -> int:
    """The tokens a prompt may take: the sequence limit less ``engine.max_new_tokens``."""
    limit = plan.max_seq_len - cfg.engine.max_new_tokens
    if limit < 1:
        raise ConfigError(f"engine.max_new_tokens: {cfg.engine.max_new_tokens} leaves no room "
                          f"for a prompt in model.max_seq_len {plan.max_seq_len}")
    return limit


def check_prompts(cfg: JobConfig, plan: ModelPlan, prompts: Prompts) -> None:
    """Each reset episode's prompt, tokenized as the rollouts will, must leave
    ``engine.max_new_tokens`` of room in the sequence limit (``model.max_seq_len``, or the HF
    model's position limit)."""
    limit, tokenizer = prompt_room(cfg, plan), plan.tokenizer
    for index, text, messages, source in prompts.episodes:
        try:
            prompt = tokenizer.prompt_ids(text, messages, prompts.tools)
        except Exception as exc:  # noqa: BLE001 - what the user's reset returned: bad input
            raise ConfigError(f"environment.class: {cfg.environment.cls}.reset({index}, "
                              f"{cfg.run.seed}) failed: {type(exc).__name__}: {exc}") from None
        if len(prompt) > limit:
            # With no model.max_seq_len the model's position limit binds: raising it is no fix.
            bound = ", the model's position limit" if cfg.model.hf and \
                cfg.model.max_seq_len is None else ""
            what = f"{source}'s prompt" if source is not None else f"episode {index}'s prompt"
            raise ConfigError(
                f"model.max_seq_len: {what} is {len(prompt)} tokens; with "
                f"engine.max_new_tokens {cfg.engine.max_new_tokens} it needs max_seq_len >= "
                f"{len(prompt) + cfg.engine.max_new_tokens} (is {plan.max_seq_len}{bound})")


def load_data(cfg: JobConfig) -> tuple[Rows, Rows | None]:
    """``data.train``'s rows and ``data.validation``'s (None when unset), every row
    checked (:func:`erlay.actors.data.rows.load_rows`)."""
    from erlay.actors.data.rows import load_rows
    rows = load_rows(cfg.data, "train")
    val_rows = load_rows(cfg.data, "validation") if cfg.data.validation is not None else None
    return rows, val_rows


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


def preflight(cfg: JobConfig, plan: ModelPlan | None = None) -> None:
    """Run every check (module docstring); raise the first problem as a ConfigError."""
    # The dataset first: a bad row is the commonest mistake, and finding it needs no model.
    data = load_data(cfg) if cfg.data.train is not None else None
    with BuildProcess(build_request(cfg, data), cfg.plugins.build_timeout_s) as build:
        plan = plan or plan_model(cfg)   # meanwhile: the model and its tokenizer
        check_backend(cfg, plan)
        prompt_room(cfg, plan)
        results = build.finish()
    for result in results:
        match result:
            case Prompts():
                check_prompts(cfg, plan, result)
            case Refusal(line=line):
                raise ConfigError(line)
