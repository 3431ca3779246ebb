"""The rollout coordinator: the asynchronous GRPO loop, as an in-process child of the rollout
domain.  Its ``run()`` returning is the job's normal end: the coordinator is a significant
transient child, so the tree shuts itself down (OTP auto_shutdown) when training is done.

Scheduling (one-step off-policy by default).  After the warm start the engines serve version
``B``.  Step ``n`` trains at learner version ``B + n``.  Generation for step ``n`` may start
once the engines serve ``B + n - max_staleness``, so with ``max_staleness = 1`` generation for
step ``n + 1`` overlaps the update of step ``n``, and with 0 the loop is synchronous.  Every
trajectory records the version of each token segment; one whose oldest segment is older than
``B + n - max_staleness`` when step ``n`` trains is not trained on (it is counted).

Data order is deterministic: step ``n``, group ``g`` plays episode ``n * groups + g``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.domains import CHILD_GONE, EnginePool, JudgeClient, SandboxClient, Weights
from actors.grpo import staleness_ok
from actors.learner_core import TrainBatch
from actors.rollout import RolloutRunner, SamplingParams, Trajectory
from actors.tokenizer import CharTokenizer
from actors.transitions import Transition, TransitionKind, TransitionSink
from supervisor.progress import Progress
from supervisor.tree import ChildRef

log = logging.getLogger("erlay.rollout")


def demonstration_tokens(pairs: list[tuple[str, str]],
                         tok: CharTokenizer) -> list[tuple[list[int], list[int]]]:
    """Token-level (context, target) pairs laid out exactly as a rollout lays them out.

    A rollout's context for turn k holds every earlier turn's tokens *with* their EOS, then
    the observation; demonstration contexts are plain text without EOS.  Building the
    contexts from the targets keeps the warm start and RL on the same token sequences.
    Relies on the environment's invariant: context[k+1] = context[k] + target[k] + obs_k.
    """
    out = []
    ids: list[int] = []
    for k, (context, target) in enumerate(pairs):
        if k == 0:
            ids = tok.encode(context, bos=True)
        else:
            prev_context, prev_target = pairs[k - 1]
            observation = context[len(prev_context) + len(prev_target):]
            ids = ids + tok.encode(prev_target, eos=True) + tok.encode(observation)
        out.append((ids, tok.encode(target, eos=True)))
    return out


class RolloutCoordinator:
    """Runs warm start, then ``steps`` GRPO steps; reports metrics through ``report``."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.cfg = job.cfg
        self.progress = Progress()
        self.report: Callable[[dict[str, Any]], None] = job.report_metrics
        self.sink: TransitionSink = job.transitions
        self.learners: list[ChildRef] = []
        self.runner: RolloutRunner | None = None
        self.base_version = 0
        self.sandbox: SandboxClient | None = None
        self.judge: JudgeClient | None = None
        self.engines: EnginePool | None = None

    async def setup(self) -> None:
        tree, paths = self.job.tree, self.job.paths
        self.learners = [tree.ref(p) for p in paths.learners]
        self.engines = EnginePool(tree, paths.engines)
        self.sandbox = SandboxClient(tree, paths.sandbox_hosts, paths.sandbox_workers,
                                     self.cfg.sandbox.max_attempts)
        self.judge = JudgeClient(tree, paths.judge_hosts, paths.judge_workers,
                                 self.cfg.judge.retries)
        sampling = SamplingParams(self.cfg.engine.max_new_tokens, self.cfg.engine.temperature,
                                  self.cfg.engine.chunk_tokens, self.cfg.run.seed)
        self.runner = RolloutRunner(self.job.env, self.job.tokenizer, self.engines, self.sandbox,
                                    self.judge, self.sink, sampling, self.cfg.model.max_seq_len)

    # ------------------------------------------------------------------------ the loop
    async def run(self) -> None:
        assert self.runner is not None and self.engines is not None
        cfg = self.cfg
        await self._warm_start()
        steps, lookahead = cfg.run.steps, cfg.rollout.max_staleness
        generation: dict[int, asyncio.Task[tuple[list[Trajectory], float]]] = {}
        for n in range(min(steps, lookahead + 1)):
            generation[n] = asyncio.create_task(self._generate_step(n), name=f"gen-step-{n}")
        for n in range(steps):
            step_started = time.monotonic()
            trajectories, gen_seconds = await generation.pop(n)
            gen_wait = time.monotonic() - step_started
            batch, dropped = self._batch(n, trajectories)
            train_started = time.monotonic()
            metrics = await self._train(batch)
            weights = await self._publish()
            train_seconds = time.monotonic() - train_started
            for traj in trajectories:
                if traj.rollout_id in batch.rollout_ids:
                    self.sink.record(Transition(TransitionKind.CONSUMED, traj.rollout_id,
                                                {"step": n, "version": weights.version}))
            ahead = n + 1 + lookahead
            if ahead < steps:
                generation[ahead] = asyncio.create_task(self._generate_step(ahead),
                                                        name=f"gen-step-{ahead}")
            self._report_step(n, trajectories, dropped, metrics, gen_seconds, gen_wait,
                              train_seconds, time.monotonic() - step_started)
        self.progress.end()

    async def _generate_step(self, n: int) -> tuple[list[Trajectory], float]:
        """All rollouts of step ``n``: ``prompts_per_step`` groups of ``group_size``."""
        assert self.runner is not None
        cfg = self.cfg.rollout
        started = time.monotonic()
        plays = []
        for g in range(cfg.prompts_per_step):
            index = n * cfg.prompts_per_step + g
            episode = self.job.env.reset(index, self.cfg.run.seed)
            for k in range(cfg.group_size):
                rid = f"r{n:05d}-g{g:03d}-{k}"
                plays.append(self.runner.play(rid, n, g, episode, index))
        trajectories = await asyncio.gather(*plays)
        return list(trajectories), time.monotonic() - started

    def _batch(self, n: int, trajectories: list[Trajectory]) -> tuple[TrainBatch, int]:
        """The step's TrainBatch.  Stale trajectories and samples whose judge failed are
        kept in their group for shape, with every token masked out, and counted."""
        learner_version = self.base_version + n
        dropped = 0
        masks = []
        for traj in trajectories:
            fresh = staleness_ok([v for v in traj.versions if v >= 0] or [learner_version],
                                 learner_version, self.cfg.rollout.max_staleness)
            keep = fresh and traj.judged_ok
            dropped += not keep
            masks.append([m and keep for m in traj.loss_mask])
        batch = TrainBatch(
            prompt_ids=[t.prompt_ids for t in trajectories],
            completion_ids=[t.completion_ids for t in trajectories],
            behaviour_logprobs=[t.logprobs for t in trajectories],
            versions=[t.versions for t in trajectories],
            rewards=[t.reward for t in trajectories],
            group_size=self.cfg.rollout.group_size,
            rollout_ids=[t.rollout_id for t in trajectories],
            loss_mask=masks)
        return batch, dropped

    # ----------------------------------------------------------------- other domains
    async def _warm_start(self) -> None:
        """A short supervised warm start on the environment's demonstrations, then publish
        the first weights to every engine."""
        ws = self.cfg.warm_start
        self.progress.begin("warm_start")
        if ws.steps > 0:
            prompts, targets = [], []
            for i in range(ws.examples):
                episode = self.job.env.reset(10_000_000 + i, self.cfg.run.seed)
                for context, target in demonstration_tokens(
                        self.job.env.demonstration(episode), self.job.tokenizer):
                    prompts.append(context)
                    targets.append(target)
            result = await self._learner_call("sft", prompts, targets, ws.steps, ws.batch_size,
                                              ws.lr, all_ranks=True)
            self.report({"phase": "warm_start", **result})
        weights = await self._publish()
        self.base_version = weights.version

    async def _learner_call(self, method: str, *args: Any, all_ranks: bool = False) -> Any:
        """Call rank 0 (or every rank with the same arguments, as data-parallel steps need),
        waiting out a restart of the learner domain; returns rank 0's answer."""
        ranks = self.learners if all_ranks else self.learners[:1]
        while True:
            try:
                results = await asyncio.gather(*(getattr(r.actor, method).remote(*args)
                                                 for r in ranks))
                return results[0]
            except CHILD_GONE as exc:
                log.warning("learner unavailable during %s (%s); waiting for its restart",
                            method, type(exc).__name__)
                await asyncio.sleep(0.2)

    async def _train(self, batch: TrainBatch) -> dict[str, Any]:
        self.progress.begin("train_step")
        try:
            return dict(await self._learner_call("train_step", batch.to_dict(), all_ranks=True))
        finally:
            self.progress.tick()

    async def _publish(self) -> Weights:
        assert self.engines is not None
        version, (ref,) = await self._learner_call("publish")
        # The learner owns the object it put; re-put it from the driver so engines admitted
        # after a learner restart can still load it.
        weights = Weights(version, ray.put(await ref))
        await self.engines.publish(weights)
        return weights

    # -------------------------------------------------------------------------- metrics
    def _report_step(self, n: int, trajectories: list[Trajectory], dropped: int,
                     metrics: dict[str, Any], gen_seconds: float, gen_wait: float,
                     train_seconds: float, step_seconds: float) -> None:
        assert self.sandbox is not None and self.judge is not None
        rewards = [t.reward for t in trajectories]
        tokens = sum(t.generated_tokens for t in trajectories)
        versions = [t.min_version for t in trajectories if t.min_version >= 0]
        learner_version = self.base_version + n
        self.report({
            "phase": "rl", "step": n, "version": metrics.get("version"),
            "reward_mean": sum(rewards) / len(rewards),
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "samples": len(trajectories), "gen_tokens": tokens,
            "failures": sum(t.failure is not None for t in trajectories),
            "judge_marked": sum(not t.judged_ok for t in trajectories),
            "tool_calls": sum(t.tool_calls for t in trajectories),
            "resumed_turns": sum(t.resumed for t in trajectories),
            "dropped": dropped,
            "staleness_max": max((learner_version - v for v in versions), default=0),
            "sandbox_calls": self.sandbox.calls,
            "gen_s": round(gen_seconds, 4), "gen_wait_s": round(gen_wait, 4),
            "train_s": round(train_seconds, 4), "step_s": round(step_seconds, 4),
            "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
        })
