"""The rollout coordinator: the asynchronous GRPO loop, as an in-process child of the rollout
domain.  Its ``run()`` returning is the job's normal end: the coordinator is a significant
transient child, so the tree shuts itself down (OTP auto_shutdown) when training is done.

Scheduling (one-step off-policy by default).  After the warm start the engines serve version
``B``.  Step ``n`` trains at learner version ``B + n``.  Generation for step ``n`` may start
once the engines serve ``B + n - max_staleness``, so with ``max_staleness = 1`` generation for
step ``n + 1`` overlaps the update of step ``n``, and with 0 the loop is synchronous.  Every
trajectory records the version of each token segment; one whose oldest segment is older than
``B + n - max_staleness`` when step ``n`` trains is not trained on (it is counted).

Data order is deterministic: step ``n``, group ``g`` plays episode ``n * groups + g``.  The
step comes from the learner (its checkpoint on ``--resume``), so the data position does too: a
dataset-backed environment maps the episode index to its row (epoch and seeded order
included, :func:`erlay.environments.dataset.row_position`), and a resumed run continues at
the same row.  With ``data.validation_every`` the validation rows are played after every
so many steps (:mod:`~erlay.actors.job.validation`): never journaled, never trained on.

User code cannot take the loop down: the environment is called through a
:class:`~erlay.actors.job.plugins.GuardedEnvironment`, so its failures fail samples; a
plug-in that keeps failing raises :class:`~erlay.actors.job.plugins.PluginFailing`, and the
coordinator then ends the job as failed (:meth:`Job.abort`) with that message.  Every call
into another domain has a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from erlay.actors.control import GoodputController
from erlay.actors.job.colocation import NO_COLOCATION, NoColocation, colocation_for
from erlay.actors.job.control_wiring import build_controller
from erlay.actors.job.domains import CHILD_GONE, EnginePool, SandboxClient
from erlay.actors.job.dynamic_sampling import play_with_refills
from erlay.actors.job.env_client import EnvironmentClient
from erlay.actors.job.hostcalls import HostCalls
from erlay.actors.job.judge_client import JudgeClient
from erlay.actors.job.plugins import PluginFailing, RateRule, UserCodeFailed, UserError
from erlay.actors.job.rollout import RolloutHistory, RolloutRunner, SamplingParams, Trajectory
from erlay.actors.job.seam import CoordinatorContext
from erlay.actors.job.step_record import StepTimes, step_record
from erlay.actors.job.structured import all_or_none, cancel_all
from erlay.actors.job.validation import Validator
from erlay.actors.journal.rollout_id import RolloutId
from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import Transition, TransitionKind, TransitionSink
from erlay.actors.learner.core import TrainBatch
from erlay.actors.learner.grpo import staleness_ok
from erlay.actors.model.refit import Refit
from erlay.actors.model.tokens import Tokenizer
from erlay.actors.observe.goodput import StepCounts
from erlay.judges.budget import CircuitBreaker
from erlay.supervisor import telemetry
from erlay.supervisor.deadline import within
from erlay.supervisor.errors import CallDeadlineExceeded
from erlay.supervisor.failpoints import afailpoint
from erlay.supervisor.loopthread import LoopThread
from erlay.supervisor.progress import Progress
from erlay.supervisor.tree import ChildRef

log = logging.getLogger("erlay.rollout")


def demonstration_tokens(pairs: list[tuple[str, str]],
                         tok: Tokenizer) -> list[tuple[list[int], list[int]]]:
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
            ids = tok.prompt_ids(context)
        else:
            prev_context, prev_target = pairs[k - 1]
            observation = context[len(prev_context) + len(prev_target):]
            ids = ids + tok.encode(prev_target, eos=True) + tok.encode(observation)
        out.append((ids, tok.encode(target, eos=True)))
    return out


def _consume_spans(trajectories: list[Trajectory], step: int, version: int,
                   started: float) -> None:
    """A ``consume`` span in each trajectory's rollout trace: trained by ``step``."""
    if not telemetry.enabled():
        return
    for traj in trajectories:
        if traj.trace:
            telemetry.start_span("consume", parent=traj.trace, start_time=started, step=step,
                                 rollout_id=traj.rollout_id, policy_version=version).end()


Window = tuple[float, float]   # wall time (time.time()) at start and end


class RolloutCoordinator:
    """Runs warm start, then ``steps`` GRPO steps; reports metrics through ``report``."""

    def __init__(self, ctx: CoordinatorContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.progress = Progress()
        self.report: Callable[[dict[str, Any]], None] = ctx.report
        self.sink: TransitionSink = ctx.sink
        self.learners: list[ChildRef] = []
        self.runner: RolloutRunner | None = None
        self.base_version = 0
        self.sandbox: SandboxClient | None = None
        self.judge: JudgeClient | None = None
        self.env: EnvironmentClient | None = None
        self.validation_env: EnvironmentClient | None = None
        self.thread: LoopThread | None = None
        self.engines: EnginePool | None = None
        self.journal: Journal | None = ctx.journal
        self.reported_upto = -1   # metrics.jsonl already holds steps up to this one
        self.rewinds = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.checkpoint_exposed_s: list[float] = []   # per save, seconds the learner blocked
        self.validator: Validator | None = None   # with data.validation_every, from setup
        self.control: GoodputController | None = None   # with control.enabled, from setup
        self.fill_rounds: dict[int, int] = {}   # dynamic sampling's refill rounds, by step
        self.colocation: NoColocation = NO_COLOCATION   # placement.colocate: from setup

    async def setup(self) -> None:
        """Start this incarnation's own loop thread and build the clients there."""
        self.thread = LoopThread(f"erlay-coordinator-{id(self):x}")
        try:
            await self.thread.run(self._setup())
        except BaseException:
            self.thread.close()
            raise

    async def _setup(self) -> None:
        self.loop = asyncio.get_running_loop()  # chaos injects tool calls onto this loop
        tree, paths = self.ctx.tree, self.ctx.paths
        cfg = self.cfg
        self.learners = [tree.ref(p) for p in paths.learners]
        self.engines = EnginePool(tree, paths.engines,
                                  update_timeout_s=cfg.engine.update_timeout_s)
        # The goodput controller's ticks run on this loop: LoopThread.close cancels them.
        self.colocation = colocation_for(cfg, self.engines.refs)
        self.control = control = build_controller(cfg, self.engines, tree, self.ctx.control)
        self.sandbox = SandboxClient(tree, paths.sandbox_hosts, paths.sandbox_workers,
                                     cfg.sandbox.max_attempts,
                                     call_timeout_s=cfg.sandbox.call_timeout_s,
                                     limits=control.sandbox if control else None)
        plugins = cfg.plugins
        rule = RateRule(plugins.window, plugins.max_failure_rate, plugins.min_calls)
        env_calls = HostCalls(tree, paths.environment_hosts, call_timeout_s=plugins.timeout_s)
        infos = await EnvironmentClient.describe(env_calls.run)
        self.env = EnvironmentClient(env_calls.run, cfg.environment.cls, infos["train"],
                                     timeout_s=plugins.timeout_s, rule=rule)
        breaker = cfg.judge.breaker
        judge_calls = HostCalls(tree, paths.judge_hosts, call_timeout_s=cfg.judge.timeout_s,
                                breaker=lambda: CircuitBreaker(
                                    breaker.failure_threshold, breaker.cool_down_s,
                                    window=breaker.window, min_calls=breaker.min_calls,
                                    open_rate=breaker.open_rate),
                                limits=control.judge if control else None)
        self.judge = JudgeClient(judge_calls.run, cfg.judge.cls, retries=cfg.judge.retries,
                                 timeout_s=cfg.judge.timeout_s, rule=rule,
                                 deadline=control.judge.deadline if control else None)
        sampling = SamplingParams(self.cfg.engine.max_new_tokens, self.cfg.engine.temperature,
                                  self.cfg.engine.chunk_tokens, self.cfg.run.seed,
                                  stop=tuple(self.cfg.engine.stop))
        self.runner = RolloutRunner(self.env, self.ctx.tokenizer, self.engines, self.sandbox,
                                    self.judge, self.sink, sampling, self.ctx.max_seq_len,
                                    observer=self.ctx.observer, control=control)
        if control is not None:
            control.start()
        self.runner.batcher.idle_s = 2 * cfg.engine.decode_deadline_s
        if "validation" in infos:
            self.validation_env = EnvironmentClient(
                env_calls.run, cfg.environment.cls, infos["validation"], which="validation",
                timeout_s=plugins.timeout_s, rule=rule)
            self.validator = Validator(self.validation_env, self.runner,
                                       cfg.data.validation_every, cfg.data.validation_size,
                                       cfg.run.seed, self.ctx.validation_rows)
        # The driver's heap is set up by now (Ray, torch, the job's objects): frozen, the
        # collector's full passes skip it instead of pausing this event loop, which sees
        # every engine failure and dispatches every resume, for half a second each.
        gc.collect()
        gc.freeze()

    def tool_call(self, key: str, code: str) -> concurrent.futures.Future[dict[str, Any]]:
        """Run ``code`` as a tool call under idempotency ``key`` through this incarnation's
        sandbox client, on its loop, as a rollout would (chaos: hostile code).  Raises
        LookupError before :meth:`setup` has built the client."""
        if self.sandbox is None or self.loop is None:
            raise LookupError("the rollout coordinator is not running")
        return asyncio.run_coroutine_threadsafe(self.sandbox.execute(key, code), self.loop)

    async def stop(self) -> None:
        """A polite stop: cancel the work on the coordinator's thread and wait for it to
        end (bounded by :class:`LoopThread`'s cancel wait), then close the thread."""
        if self.thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.thread.close)

    # ------------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Train steps ``start..steps-1``, where ``start`` is the learner's own step: 0 on a
        fresh job, the restored checkpoint's step on ``--resume``, the live learner's step
        when only this coordinator restarted.

        Exactly-once: step ``n`` trains on the rollouts ``r{n}-*``, whatever the timeline.
        If the learner domain restarts and restores an older checkpoint, ``train_step``
        says so (``stale_step``) and the loop rewinds to the learner's step; the steps since
        that checkpoint are fed again from the journal, each rollout to the same step."""
        assert self.thread is not None, "setup() starts the coordinator's thread"
        try:
            await self.thread.run(self._run())
        except PluginFailing as exc:
            # Not a crash to restart from: the user's code is broken, and a restart would
            # fail the same way.  End the job, failed, with the one message that says why.
            log.error("%s", exc)
            self.ctx.abort(str(exc))
        except Exception:
            # The supervisor records the exit reason; the traceback is what a user debugging
            # a crash loop needs, and only this process has it.
            log.exception("rollout coordinator crashed")
            raise
        finally:
            await self.stop()

    async def _run(self) -> None:
        assert self.runner is not None and self.engines is not None
        cfg = self.cfg
        # Colocated, the warm start has the device too; and a successor of a coordinator
        # that died mid-step finds its engines asleep or not (sleeping is idempotent).
        await self.colocation.release()
        n = await self._restore_or_warm_start()
        self.colocation.step_stats()   # the start's hand-off belongs to no step's record
        steps, lookahead = cfg.run.steps, self.colocation.lookahead(cfg.rollout.max_staleness)
        generation: dict[int, asyncio.Task[tuple[list[Trajectory], Window]]] = {}
        # A crash (or a stop) ends this incarnation's generation too: left running, the
        # steps it generated ahead would go on writing chunks, tool calls and judgements
        # into the journal beside the successor's replay of the same rollouts.
        try:
            while n < steps:
                for ahead in range(n, min(steps, n + lookahead + 1)):
                    if ahead not in generation:
                        generation[ahead] = asyncio.create_task(self._generate_step(ahead),
                                                                name=f"gen-step-{ahead}")
                step_started = time.monotonic()
                if self.control is not None:
                    self.control.awaiting(n, cfg.rollout.prompts_per_step
                                          * cfg.rollout.group_size)
                trajectories, gen_window = await generation.pop(n)
                gen_wait = time.monotonic() - step_started
                tails = await self._engine_tails()
                batch, counts = self._batch(n, trajectories)
                await self.colocation.release()   # colocated: the engines free the device
                train_started, train_began = time.monotonic(), time.time()
                metrics = await self._train(batch, n)
                if metrics.get("stale_step"):
                    n = await self._rewind(n, int(metrics["learner_step"]))
                    continue
                # Chaos: a crash after the learner's step (in its ledger) and before the
                # journal records its consumption; exactly-once must tell a step a
                # checkpoint kept from one the failed run lost.
                await afailpoint("rollout.after_train")
                weights = await self._refit()
                train_seconds = time.monotonic() - train_started
                windows = {"gen_window": gen_window, "train_window": (train_began, time.time())}
                self._consume(trajectories, n, weights.version)
                _consume_spans(trajectories, n, weights.version, time.time() - train_seconds)
                # Report before checkpointing: a checkpoint may let the journal compact this
                # step's rollouts, and a successor reports unreported steps from the journal.
                if n > self.reported_upto:
                    self._report_step(n, trajectories, counts,
                                      {**metrics, **tails, **windows,
                                       **self.colocation.step_stats()},
                                      gen_window[1] - gen_window[0], gen_wait, train_seconds,
                                      time.monotonic() - step_started)
                    self.reported_upto = n
                if (n + 1) % cfg.checkpoint.every_steps == 0 or n + 1 == steps:
                    self.checkpoint_exposed_s.append(await self._checkpoint())
                if self.validator is not None and self.validator.due(n):
                    self.report(await self.validator.validate(n))
                n += 1
        finally:
            await cancel_all(generation.values())
        waited = await self._learner_call("wait_checkpoints",
                                          all_ranks=self.cfg.learner.backend != "replicated")
        self._saves_failed((waited or {}).get("failed") or [])
        upload = (waited or {}).get("upload")   # remote storage: the learner's last uploads
        if upload is not None and not upload["ok"]:
            self.ctx.abort(f"the learner's checkpoints and ledger did not reach the run's "
                           f"remote home: {upload['error']}")
        self.ctx.training_ended(n)
        self.progress.end()

    async def _engine_tails(self) -> dict[str, Any]:
        """The torch engines' tail reports since the last step (erlay.actors.engine.tail), merged:
        decode steps at low concurrency, their mean concurrency, draft acceptance.  Empty
        for the vllm backend, and for an engine that is restarting."""
        if self.cfg.engine.backend != "torch" or self.engines is None:
            return {}
        reports = []
        for ref in self.engines.refs:
            try:
                reports.append(await asyncio.wait_for(ref.actor.tail_report.remote(), 5.0))
            except Exception:  # noqa: BLE001 - a report is optional; a restart is not news here
                continue
        tail = [r for r in reports if r["tail_steps"]]
        drafted = sum(r["drafted"] for r in reports)
        return {
            "engine_tail_steps": sum(r["tail_steps"] for r in reports),
            "engine_tail_concurrency_mean": round(
                sum(r["tail_concurrency_mean"] * r["tail_steps"] for r in tail)
                / max(1, sum(r["tail_steps"] for r in tail)), 3) if tail else None,
            "engine_tail_spec_steps": sum(r["spec_steps"] for r in reports),
            "engine_tail_acceptance": round(sum(
                (r["acceptance"] or 0) * r["drafted"] for r in reports) / drafted, 4)
            if drafted else None,
            # Decode wall time of the engines since the last step, and the part of it spent
            # saving KV caches for hand-off (engine.kv_handoff).
            "engine_decode_s": round(sum(r.get("decode_s", 0.0) for r in reports), 4),
            "engine_kv_save_s": round(sum(r.get("kv_save_s", 0.0) for r in reports), 4),
        }

    async def _refit(self) -> Refit:
        """Publish the learner's weights to the engines; colocated, the engines take their
        weights' memory back first (the refit loads into it) and their KV cache after."""
        await self.colocation.reclaim_weights()
        weights = await self._publish()
        await self.colocation.reclaim_cache()
        return weights

    async def _restore_or_warm_start(self) -> int:
        """The step to train next.  A learner that is past its warm start (restored from a
        checkpoint, or alive while this coordinator restarted) keeps its timeline; else
        warm-start, publish, and checkpoint at step 0, so a resume never warm-starts
        again."""
        status = await self._learner_call("status")
        if self.journal is not None:
            # Compaction keeps every rollout consumed since the newest committed checkpoint
            # (all of them before the first): a restore can go back that far.
            self.journal.retain_from_step(int(status.get("committed") or 0))
        self.reported_upto = max((int(m["step"]) for m in self.ctx.run_dir.rl_steps()),
                                 default=-1)
        if status["warm_started"]:
            step = int(status["step"])
            self.base_version = int(status["version"]) - step
            await self._refit()
            log.warning("continuing at step %d (learner v%d%s)", step, status["version"],
                        ", restored from a checkpoint" if status.get("restored") else "")
            await self._account_unreported(step)
            return step
        await self._warm_start()
        await self._checkpoint()
        return 0

    async def _account_unreported(self, learner_step: int) -> None:
        """Steps the learner trained that this coordinator's predecessor did not live to
        record: mark their rollouts consumed (they were trained on) and report them from the
        journal, flagged ``recovered`` (the learner's loss for them is gone), so the
        metrics have no gap and the journal no rollout left unconsumed."""
        for n in range(self.reported_upto + 1, learner_step):
            trajectories, _ = await self._generate_step(n)  # all journaled: nothing runs
            self._consume(trajectories, n, self.base_version + n + 1)
            _, counts = self._batch(n, trajectories)
            self._report_step(n, trajectories, counts, {"recovered": True,
                                                         "version": self.base_version + n + 1},
                              0.0, 0.0, 0.0, 0.0)
            self.reported_upto = n

    def _consume(self, trajectories: list[Trajectory], n: int, version: int) -> None:
        """Journal step ``n``'s rollouts as consumed at ``version``; a rollout of a group
        dynamic sampling dropped is consumed with weight 0 and says so."""
        for traj in trajectories:
            self.sink.record(Transition(TransitionKind.CONSUMED, traj.rollout_id, {
                "step": n, "version": version, **({"filtered": True} if traj.filtered else {})}))

    async def _rewind(self, n: int, learner_step: int) -> int:
        """The learner restored a checkpoint at ``learner_step`` < ``n``: serve its weights
        and go back to that step."""
        self.rewinds += 1
        log.warning("learner restarted from its checkpoint at step %d while step %d was "
                    "training; feeding steps %d..%d again from the journal", learner_step, n,
                    learner_step, n)
        self.report({"phase": "rewind", "from_step": n, "to_step": learner_step})
        await self._refit()
        return learner_step

    async def _checkpoint(self) -> float:
        """Snapshot the journal, then save the learner asynchronously with the snapshot's
        name; compaction then keeps what a restore to the newest committed checkpoint needs.
        Returns the seconds the learner was blocked."""
        snapshot = None
        with telemetry.span("checkpoint", root=True) as span:
            if self.journal is not None:
                snapshot = self.journal.snapshot().snapshot
            # A sharded learner's save is a collective (every rank calls it); a replicated
            # one saves on rank 0 alone.
            result = await self._learner_call("save_checkpoint", {
                "journal_snapshot": snapshot, "base_version": self.base_version},
                all_ranks=self.cfg.learner.backend != "replicated")
            span.set_attribute("erlay.step", int(result["step"]))
            span.set_attribute("erlay.exposed_s", float(result["exposed_s"]))
        if self.journal is not None and result.get("committed") is not None:
            self.journal.retain_from_step(int(result["committed"]))
        self.report({"phase": "checkpoint", "step": result["step"],
                     "exposed_s": round(float(result["exposed_s"]), 6),
                     "committed": result.get("committed"), "journal_snapshot": snapshot})
        self._saves_failed(result.get("failed") or [])
        return float(result["exposed_s"])

    def _saves_failed(self, failed: list[dict[str, Any]]) -> None:
        """Record each checkpoint save the learner gave up on (its writer made no progress
        for ``checkpoint.deadline_s``, or failed): a ``checkpoint_failed`` metrics record,
        a ``save_failed`` event of the learner, and the telemetry counter.  Training goes on
        from the newest committed checkpoint; the next save starts a new writer."""
        for save in failed:
            log.warning("checkpoint of step %s failed: %s", save.get("step"), save.get("reason"))
            self.report({"phase": "checkpoint_failed", "step": save.get("step"),
                         "reason": save.get("reason")})
            self.ctx.checkpoint_failed(int(save.get("step") or 0), str(save.get("reason")))

    async def _generate_step(self, n: int) -> tuple[list[Trajectory], Window]:
        """All rollouts of step ``n``: ``prompts_per_step`` groups of ``group_size``, each
        continued from what the journal holds of it (nothing, for a new one), plus, with
        dynamic sampling, the refill groups (:mod:`~erlay.actors.job.dynamic_sampling`;
        a dropped group's samples come back ``filtered``); and the wall time window
        (``time.time()`` at start and end) the step's generation ran in."""
        started = time.time()
        groups = self.cfg.rollout.prompts_per_step
        if self.cfg.algorithm.dynamic_sampling:
            algorithm = self.cfg.algorithm
            filled = await play_with_refills(self._play_group, n, groups,
                                             algorithm.max_fill_rounds,
                                             algorithm.max_fill_groups(groups),
                                             self._journaled_groups(n))
            for i in filled.dropped:
                for traj in filled.groups[i]:
                    traj.filtered = True
            self.fill_rounds[n] = filled.rounds
            played = filled.groups
        else:
            # Every group at once: their resets reach the environment hosts in one batch,
            # and a group whose reset is slow holds up no other.
            played = list(await all_or_none(self._play_group(n, g, n * groups + g)
                                            for g in range(groups)))
        return [traj for group in played for traj in group], (started, time.time())

    async def _play_group(self, n: int, g: int, index: int) -> list[Trajectory]:
        """Group ``g`` of step ``n``, playing episode ``index``: its reset, then its
        rollouts."""
        assert self.runner is not None
        cfg = self.cfg.rollout
        episode: Any
        try:
            episode = await self.env.reset(index, self.cfg.run.seed)
        except UserCodeFailed as exc:  # every rollout of the group fails with it
            episode = exc.error
        plays = []
        for k in range(cfg.group_size):
            rid = RolloutId(n, g, k).format()
            plays.append(self.runner.play(rid, n, g, episode, index, self._history(rid)))
        return list(await all_or_none(plays))

    def _journaled_groups(self, n: int) -> set[int]:
        """The groups of step ``n`` the journal holds a rollout of."""
        if self.journal is None or self.cfg.supervision.mode == "job_restart":
            return set()
        with self.journal.locked() as state:
            ids = [RolloutId.parse(rid) for rid in (*state.rollouts, *state.consumed)]
        return {i.group for i in ids if i is not None and i.step == n}

    def _history(self, rollout_id: str) -> RolloutHistory | None:
        if self.journal is None or self.cfg.supervision.mode == "job_restart":
            return None  # the baseline throws in-flight work away, as whole-job restarts do
        with self.journal.locked() as state:
            record = state.rollout(rollout_id)
            if record is None:
                if rollout_id in state.consumed:  # compacted: its checkpoint has committed
                    raise RuntimeError(f"rollout {rollout_id} was compacted out of the "
                                       "journal but must be fed again")
                return None
            return RolloutHistory.from_parts(
                True, record.chunks, [int(o["turn"]) for o in record.observations],
                record.tool_results, record.judgements, record.completed is not None,
                (record.completed or {}).get("user_error"))

    def _batch(self, n: int, trajectories: list[Trajectory]) -> tuple[TrainBatch, StepCounts]:
        """The step's TrainBatch and its :class:`StepCounts`.  Stale trajectories, samples
        whose judge failed and samples user code failed are kept in their group for shape,
        with every token masked out, and counted; the invalid ones (judge or user code
        failed) also stay out of their group's advantage statistics, so they are never
        scored as 0."""
        learner_version = self.base_version + n
        counts = StepCounts()
        masks = []
        for traj in trajectories:
            fresh = staleness_ok([v for v in traj.versions if v >= 0] or [learner_version],
                                 learner_version, self.cfg.rollout.max_staleness)
            mask = [m and fresh and traj.valid and not traj.filtered for m in traj.loss_mask]
            counts.add(traj, fresh, sum(mask))
            masks.append(mask)
        batch = TrainBatch(
            prompt_ids=[t.prompt_ids for t in trajectories],
            completion_ids=[t.completion_ids for t in trajectories],
            behaviour_logprobs=[t.logprobs for t in trajectories],
            versions=[t.versions for t in trajectories],
            rewards=[t.reward for t in trajectories],
            group_size=self.cfg.rollout.group_size,
            rollout_ids=[t.rollout_id for t in trajectories],
            loss_mask=masks, valid=[t.valid for t in trajectories])
        return batch, counts

    # ----------------------------------------------------------------- other domains
    async def _warm_start(self) -> None:
        """A short supervised warm start on the environment's demonstrations, then publish
        the first weights to every engine."""
        ws = self.cfg.warm_start
        self.progress.begin("warm_start")
        if ws.steps > 0:
            prompts, targets = [], []
            # All at once: the environment hosts get them in a few batches.
            demonstrations = await all_or_none(self._demonstration(10_000_000 + i)
                                                 for i in range(ws.examples))
            failed = sum(pairs is None for pairs in demonstrations)
            for pairs in demonstrations:
                if pairs is None:
                    continue
                for context, target in demonstration_tokens(pairs, self.ctx.tokenizer):
                    prompts.append(context)
                    targets.append(target)
            if not prompts:
                raise PluginFailing(UserError(self.cfg.environment.cls, "demonstration",
                                              "exception", "no demonstration succeeded"),
                                    failed, ws.examples)
            result = await self._learner_call("sft", prompts, targets, ws.steps, ws.batch_size,
                                              ws.lr, all_ranks=True)
            self.report({"phase": "warm_start", "demonstrations_failed": failed, **result})
        weights = await self._refit()
        self.base_version = weights.version

    async def _demonstration(self, index: int) -> list[tuple[str, str]] | None:
        """Episode ``index``'s demonstration; None when the environment failed on it (that
        demonstration is skipped, and counted)."""
        try:
            episode = await self.env.reset(index, self.cfg.run.seed)
            return await self.env.demonstration(episode)
        except UserCodeFailed:
            return None

    async def _learner_call(self, method: str, *args: Any, all_ranks: bool = False) -> Any:
        """Call rank 0 (or every rank with the same arguments, as data-parallel steps need),
        waiting out a restart of the learner domain; returns rank 0's answer.

        Each call has a deadline (``learner.call_timeout_s``).  Past it the learner is
        presumed hung: the call is not repeated on the same incarnation (a late answer
        would train a step twice); the coordinator waits for the learner domain to restart
        it (its heartbeat and progress deadlines decide), then calls the new incarnation."""
        ranks = self.learners if all_ranks else self.learners[:1]
        timeout_s = self.cfg.learner.call_timeout_s
        while True:
            incarnations = self._incarnations(ranks)
            try:
                # Every rank's actor first, then the calls: a rank that is not running (a
                # restart in progress) must stop the attempt before any call is made.
                # Calling the ranks already restarted would leave them in a collective (a
                # sharded save, a train step) their peers never join, and the next attempt
                # would call them again.
                actors = [r.actor for r in ranks]
                results = await asyncio.gather(*(
                    within(getattr(actor, method).remote(*args), timeout_s,
                           f"{r.path}.{method}") for r, actor in zip(ranks, actors,
                                                                     strict=True)))
                return results[0]
            except CHILD_GONE as exc:
                log.warning("learner unavailable during %s (%s); waiting for its restart",
                            method, type(exc).__name__)
                if isinstance(exc, CallDeadlineExceeded):
                    await self._await_restart(ranks, incarnations)
                await asyncio.sleep(0.2)

    @staticmethod
    def _incarnations(ranks: list[ChildRef]) -> list[int | None]:
        out: list[int | None] = []
        for ref in ranks:
            try:
                out.append(ref.incarnation)
            except CHILD_GONE:
                out.append(None)
        return out

    async def _await_restart(self, ranks: list[ChildRef], before: list[int | None]) -> None:
        """Wait until some rank runs a new incarnation (bounded: a learner that answers
        again without a restart gets called again after the deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.learner.call_timeout_s
        while loop.time() < deadline and self._incarnations(ranks) == before:
            await asyncio.sleep(0.5)

    async def _train(self, batch: TrainBatch, n: int) -> dict[str, Any]:
        self.progress.begin("train_step")
        try:
            with telemetry.span("train_step", root=True, step=n,
                                samples=len(batch.rollout_ids)) as span:
                metrics = dict(await self._learner_call("train_step", batch.to_dict(), n,
                                                        all_ranks=True))
                span.set_attribute("erlay.stale_step", bool(metrics.get("stale_step")))
                return metrics
        finally:
            self.progress.tick()

    async def _publish(self) -> Refit:
        assert self.engines is not None
        with telemetry.span("weight_update", root=True) as span:
            published: Refit = await self._learner_call("publish")
            span.set_attribute("erlay.policy_version", int(published.version))
            span.set_attribute("erlay.refit_bytes", published.manifest.nbytes)
            # The learner owns the objects it put; re-put them from the driver so engines
            # admitted after a learner restart can still load them.  One bucket at a time
            # (the driver holds at most one), each fetch and put under a deadline, the put
            # on a thread, so a full store fails the publication instead of stalling this
            # loop.
            deadline = self.cfg.learner.call_timeout_s
            refs = []
            for i, ref in enumerate(published.refs):
                what = f"learner weights bucket {i + 1}/{len(published.refs)}"
                bucket = await within(ref, deadline, what)
                refs.append(await within(asyncio.to_thread(ray.put, bucket), deadline,
                                         f"re-put of {what}"))
                del bucket
            weights = Refit(published.manifest, tuple(refs))
            await self.engines.publish(weights)
        return weights

    # -------------------------------------------------------------------------- metrics
    def _report_step(self, n: int, trajectories: list[Trajectory], counts: StepCounts,
                     metrics: dict[str, Any], gen_seconds: float, gen_wait: float,
                     train_seconds: float, step_seconds: float) -> None:
        assert self.sandbox is not None and self.judge is not None
        self.report(step_record(
            n, trajectories, counts, metrics, StepTimes(gen_seconds, gen_wait, train_seconds,
                                                        step_seconds),
            learner_version=self.base_version + n, fill_rounds=self.fill_rounds.pop(n, 0),
            sandbox_calls=self.sandbox.calls,
            hedges=(self.runner.hedges, self.runner.hedge_tokens_twice) if self.runner
            else (0, 0),
            kv_handoffs=dict(self.runner.kv_handoffs) if self.runner else {}))
