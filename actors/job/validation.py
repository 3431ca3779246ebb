"""Validation: the ``data.validation`` rows played every ``data.validation_every`` steps.

The coordinator calls :meth:`Validator.validate` after step ``n`` trained, published and
(when due) checkpointed, when :meth:`Validator.due` says so.  A validation plays one rollout
per row through the same :class:`~erlay.actors.job.rollout.RolloutRunner` path as training
(engines, sandbox, judge, the same tokenizer and sequence limit), against the weights the
engines serve after step ``n``.  Contract:

- **Never trained on, never journaled.**  Its runner records into a
  :class:`~erlay.actors.journal.transitions.NullTransitions` sink, so no DISPATCHED, CHUNK or
  COMPLETED transition of a validation rollout reaches the journal, and nothing is CONSUMED:
  exactly-once accounting of training rollouts (the journal, the learner's ledger, the chaos
  invariants) sees only training rollouts.  Its rollout ids (``v{step:05d}-{row:04d}``) never
  collide with training ones (``r...``), so judge and sandbox idempotency keys do not either.
- **Reported apart.**  One ``metrics.jsonl`` record of phase ``validation`` per run:
  ``val_reward`` (mean over the judged rollouts), ``val_accuracy``, ``val_samples``,
  ``val_valid`` (judged and no user-code failure), ``val_failures``, ``val_s``.  The training
  records (phase ``rl``) are unchanged.
- **The same rows each time.**  Validation episode ``i`` (``i < data.validation_size``) is
  the validation environment's episode ``i`` under ``run.seed``: a fixed seeded sample of the
  validation rows, so successive validations are comparable.
- **Never fatal by itself.**  A validation that fails for an infrastructure reason is
  reported (``error``) and training goes on; a broken plug-in still stops the job
  (:class:`~erlay.actors.job.plugins.PluginFailing` propagates, as in training).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from erlay.actors.config import JobConfig
from erlay.actors.data.rows import environment_kwargs, load_rows
from erlay.actors.job.env_worker import EnvironmentSpec
from erlay.actors.job.plugins import PluginFailing, UserCodeFailed
from erlay.actors.job.structured import all_or_none
from erlay.actors.journal.transitions import NullTransitions

if TYPE_CHECKING:
    from erlay.actors.job.env_client import EnvironmentClient
    from erlay.actors.job.rollout import RolloutRunner, Trajectory

log = logging.getLogger("erlay.validation")


def environment_spec(cfg: JobConfig) -> EnvironmentSpec:
    """How the environment workers build the job's environments: the training one and,
    with ``data.validation_every``, the validation one.  With ``data.train`` both are built
    on the dataset's rows (:func:`~erlay.actors.data.rows.environment_kwargs`), which are
    loaded here, in the driver, before the tree starts; ``erlay run`` has checked them
    already (preflight).  Nothing is built here: no user code runs in the driver."""
    kwargs = dict(cfg.environment.kwargs)
    if cfg.data.train is None:
        return EnvironmentSpec(cfg.environment.cls, kwargs)
    train = environment_kwargs(cfg.data, kwargs, load_rows(cfg.data, "train"))
    if cfg.data.validation is None or not cfg.data.validation_every:
        return EnvironmentSpec(cfg.environment.cls, train)
    rows = load_rows(cfg.data, "validation")
    return EnvironmentSpec(cfg.environment.cls, train,
                           environment_kwargs(cfg.data, kwargs, rows), len(rows))


def summarize(step: int, trajectories: list[Trajectory], seconds: float) -> dict[str, Any]:
    """The ``validation`` metrics record of one validation run.  Pure."""
    valid = [t for t in trajectories if t.valid]
    rewards = [t.reward for t in valid]
    return {"phase": "validation", "step": step,
            "val_reward": sum(rewards) / len(rewards) if rewards else None,
            "val_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None,
            "val_samples": len(trajectories), "val_valid": len(valid),
            "val_failures": sum(t.failure is not None for t in trajectories),
            "val_gen_tokens": sum(t.generated_tokens for t in trajectories),
            "val_s": round(seconds, 4)}


class Validator:
    """Plays the validation rows through a rollout runner of its own (see the module
    docstring).  Built by the coordinator once its domain clients exist."""

    def __init__(self, env: EnvironmentClient, training: RolloutRunner, every: int,
                 size: int | None, seed: int, rows: int) -> None:
        self.env = env
        self.every = every
        self.seed = seed
        self.size = min(rows, size) if size else rows
        from erlay.actors.job.rollout import RolloutRunner  # the job's heavy half: on use
        # Same engines, sandbox, judge, tokenizer and sampling; its own sink (nothing is
        # journaled) and no observer (training's latency metrics stay training's).
        self.runner = RolloutRunner(env, training.tok, training.engines, training.sandbox,
                                    training.judge, NullTransitions(), training.sampling,
                                    training.max_seq_len, observer=None)
        self.runner.batcher = training.batcher   # one batcher per engine pool
        self.runs = 0

    def due(self, step: int) -> bool:
        """Whether to validate after step ``step`` (0-based) has trained."""
        return self.every > 0 and (step + 1) % self.every == 0

    async def validate(self, step: int) -> dict[str, Any]:
        """Play every validation episode once; return the ``validation`` record (with
        ``error`` instead of the figures when the run failed for a reason other than a
        broken plug-in)."""
        started = time.monotonic()
        try:
            # Concurrent, so the resets travel to the environment hosts in one batch.
            trajectories = await all_or_none(self._play(step, i) for i in range(self.size))
        except PluginFailing:
            raise
        except Exception as exc:  # noqa: BLE001 - validation informs; it never ends training
            log.warning("validation after step %d failed: %s: %s", step, type(exc).__name__,
                        exc)
            return {"phase": "validation", "step": step,
                    "error": f"{type(exc).__name__}: {exc}"[:300]}
        self.runs += 1
        return summarize(step, list(trajectories), time.monotonic() - started)

    async def _play(self, step: int, i: int) -> Trajectory:
        episode: Any
        try:
            episode = await self.env.reset(i, self.seed)
        except UserCodeFailed as exc:
            episode = exc.error
        return await self.runner.play(f"v{step:05d}-{i:04d}", step, i, episode, i)
