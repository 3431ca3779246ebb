"""The job: wires the RL components into one supervision tree and runs it to the end.

    erlay                      one_for_one, auto_shutdown any_significant
    ├── learner                one_for_all   learner-0..R-1    actor children
    ├── generation             one_for_one   engine-0..E-1     actor children
    ├── sandbox                one_for_one   host@node-i       one host per node, N workers
    ├── judge                  one_for_one   host@node-i       one host per node, N worker
    │                                                          processes (the judge's code)
    ├── environment            one_for_one   host@node-i       one host per node, N worker
    │                                                          processes (the environment)
    └── rollout                rest_for_one  coordinator       in-process, significant

No user code runs in the driver: the environment and the judge run in worker processes of
their hosts (:mod:`erlay.supervisor.worker_process`), one call at a time, each call under a
deadline, so a call that freezes its process costs that worker and that sample.

The coordinator is a transient significant child of ``rollout``, which is a transient
significant child of the root: when training finishes the coordinator returns, and OTP's
auto_shutdown stops the whole tree in reverse start order.  If a subtree exceeds its restart
intensity and the failure climbs to the root, the job fails with the offender named.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.config import ConfigError, DomainFlags, JobConfig
from erlay.actors.control.policy import Action
from erlay.actors.engine.kv_handoff import driver_owner
from erlay.actors.job.coordinator import RolloutCoordinator
from erlay.actors.job.env_worker import EnvironmentSpec
from erlay.actors.job.learner_wiring import learner_class, learner_options
from erlay.actors.job.modelplan import plan_model
from erlay.actors.job.node_runtime import (
    HandoffDir,
    actor_env,
    declared_env,
    finish_nodes,
    prepare_nodes,
    remove_handoff,
)
from erlay.actors.job.placement import SPREAD_OUT, Placement, reserve, vllm_engine_args
from erlay.actors.job.seam import CoordinatorContext, DomainPaths
from erlay.actors.job.validation import environment_spec
from erlay.actors.journal.store import FsyncPolicy, Journal
from erlay.actors.journal.transitions import NullTransitions, TeeTransitions, TransitionSink
from erlay.actors.observe.summary import plot_rewards, write_summary
from erlay.actors.observe.telemetry import JobTelemetry
from erlay.actors.observe.trackers import Trackers
from erlay.actors.rundir import RunDir
from erlay.actors.storage.mirror import Mirror, driver_files, snapshot_marks
from erlay.supervisor.errors import ChildStartError, SupervisorFailed, VersionMismatch
from erlay.supervisor.events import EventKind, FanoutSink, JsonlSink, LoggingSink, SupervisorEvent
from erlay.supervisor.gcpauses import short_gc_pauses
from erlay.supervisor.host import host_spec
from erlay.supervisor.raylocal import alive_nodes, ensure_ray, shutdown_ray
from erlay.supervisor.reason import ExitReason
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    Liveness,
    SupervisorFlags,
    SupervisorStart,
    WorkerStart,
)
from erlay.supervisor.tree import SupervisionTree

log = logging.getLogger("erlay.job")
progress_log = logging.getLogger("erlay.progress")
"""One INFO line per RL step when there is no progress bar (``erlay run --no-progress``)."""
ROOT = "erlay"


@dataclass
class JobResult:
    status: str            # "finished" | "failed"
    reason: str
    wall_s: float
    run_dir: RunDir
    offender: str | None = None


def _flags(strategy: str, domain: DomainFlags, **kw: Any) -> SupervisorFlags:
    return SupervisorFlags(strategy, intensity=domain.intensity, period=domain.period, **kw)


def _live(specs: list[ChildSpec], domain: DomainFlags) -> list[ChildSpec]:
    """``specs`` with the domain's heartbeat (``supervision.<domain>.heartbeat_*``)."""
    liveness = Liveness(domain.heartbeat_s, domain.heartbeat_misses)
    return [dataclasses.replace(spec, liveness=liveness) for spec in specs]


def engine_spares(cfg: JobConfig) -> int:
    """Warm spare engines (``engine.spares``; unset: 1 for the torch engine, 0 for vLLM and
    when colocated, where a spare would have no bundle to wait in)."""
    if cfg.engine.spares is not None:
        return cfg.engine.spares
    return 1 if cfg.engine.backend == "torch" and not cfg.placement.colocate else 0


def engine_restart_delay(cfg: JobConfig) -> tuple[float, float]:
    """The engines' ``(restart_delay_s, spare_delay_s)``.

    A new engine process starts ``engine.restart_delay_s`` after a failure in a job of more
    than one engine, because its start-up (imports, model build, warm-up) would slow the
    failover of the failed engine's rollouts to the others; a lone engine has no one to fail
    over to, so it restarts at once.  With spares the restart adopts one at once (nothing
    starts on its critical path) and the delay moves to the new spare's start."""
    delay = cfg.engine.restart_delay_s if cfg.engine.num_engines > 1 else 0.0
    return (0.0, delay) if engine_spares(cfg) else (delay, 0.0)


def step_line(record: dict[str, Any], total: int) -> str:
    """The progress line of one RL step record: step (1-based, of ``total``), mean reward
    (``-`` when no sample was judged), generated tokens per second (the step's own rate,
    else its tokens over its ``step_s``) and the restarts so far in this run."""
    mean = record.get("reward_mean")
    rate = record.get("tokens_per_s")
    if rate is None:
        step_s = float(record.get("step_s") or 0.0)
        rate = record.get("gen_tokens", 0) / step_s if step_s > 0 else None
    return (f"step {int(record['step']) + 1}/{total} "
            f"reward {'-' if mean is None else f'{mean:.3f}'} "
            f"tokens/s {'-' if rate is None else f'{rate:.0f}'} "
            f"restarts {record.get('restarts', 0)}")


class RestartCounter:
    """Counts restart events for the progress bar."""

    def __init__(self) -> None:
        self.restarts = 0

    def emit(self, event: SupervisorEvent) -> None:
        if event.context is EventKind.RESTART:
            self.restarts += 1


class Job:
    """One RL job: config in, run directory out."""

    def __init__(self, cfg: JobConfig, run_dir: RunDir,
                 transitions: TransitionSink | None = None, *, journal: bool = True) -> None:
        """``journal=False`` runs without the rollout journal (and so without replay after a
        coordinator restart or ``--resume``).  ``transitions``, when given, also receives
        every transition (tests, benchmarks)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.plan = plan_model(cfg)
        self._handoff_dir: HandoffDir | None = None
        self.placement: Placement = SPREAD_OUT   # placement.colocate: reserved by run()
        self.tokenizer = self.plan.tokenizer
        # What the environment workers build (the dataset's rows included); nothing of the
        # user's is built or called in this process.
        self.env_spec: EnvironmentSpec = environment_spec(cfg)
        self.abort_reason: str | None = None   # set when the job must stop, failed
        self.completed_steps: int | None = None   # the coordinator's, when training ends
        self.mirror: Mirror | None = None   # remote storage: uploads the driver's files
        self.journal: Journal | None = None
        if journal:
            jc = cfg.journal
            self.journal = Journal.open(
                run_dir.journal, fsync=FsyncPolicy(jc.fsync_every_records, jc.fsync_every_s,
                                                   jc.fsync),
                segment_bytes=int(jc.segment_mb * 1024 * 1024), snapshot_every=jc.snapshot_every)
            if not self.journal.recovery.clean:
                log.warning("journal: %s", self.journal.recovery.describe())
        sinks = [s for s in (self.journal, transitions) if s is not None]
        self.transitions: TransitionSink = (TeeTransitions(*sinks) if len(sinks) > 1 else
                                            sinks[0] if sinks else NullTransitions())
        self.coordinator: RolloutCoordinator | None = None   # the running incarnation
        self.metrics: queue.Queue[dict[str, Any]] = queue.Queue()
        self.restarts = RestartCounter()
        self._jsonl = JsonlSink(run_dir.events)
        self.telemetry = JobTelemetry(cfg.telemetry, run_dir.path, run_dir.path.name)
        self.events = FanoutSink([self._jsonl, LoggingSink(), self.restarts,
                                  self.telemetry.event_sink()])
        self.trackers = Trackers.for_job(cfg, run_dir.path)  # logging: TensorBoard, MLflow, W&B
        self.tree: SupervisionTree | None = None
        self.paths: DomainPaths | None = None
        self._t0 = time.time()
        self.span_exporter: Any = None  # tests: an extra (in-memory) span exporter
        self.last_metrics: dict[str, Any] | None = None     # for `erlay status`
        self.last_rl_metrics: dict[str, Any] | None = None
        self.control_actions = 0                            # the goodput controller's
        self.last_control: Action | None = None

    def abort(self, reason: str) -> None:
        """End the job as failed with ``reason`` (a broken plug-in): the tree then shuts
        down as if training had ended, and :meth:`run` reports the failure."""
        self.abort_reason = reason

    def checkpoint_failed(self, step: int, reason: str) -> None:
        """Called by the coordinator for a learner save given up: one ``save_failed`` event
        of the learner (events.jsonl, the log, OpenTelemetry) and the failure counter."""
        self.events.emit(SupervisorEvent(f"{ROOT}/learner", "learner-0", EventKind.SAVE_FAILED,
                                         f"checkpoint of step {step}: {reason}", 0,
                                         time.time()))
        self.telemetry.checkpoint_failed()

    @property
    def control_summary(self) -> dict[str, Any] | None:
        """``erlay status``'s line on the goodput controller: actions so far, the latest."""
        if not self.cfg.control.enabled:
            return None
        last = self.last_control
        return {"actions": self.control_actions,
                "last": last.to_dict() if last is not None else None}

    def control_action(self, action: Action) -> None:
        """Called by the goodput controller for each action: one ``control`` event (events.jsonl,
        the log, OpenTelemetry) and one ``control`` metrics record, both with its reason."""
        self.control_actions += 1
        self.last_control = action
        self.events.emit(SupervisorEvent(f"{ROOT}/control", action.target.rpartition("/")[2],
                                         EventKind.CONTROL, f"{action.kind}: {action.reason}",
                                         0, time.time(), dict(action.to_dict())))
        # Straight to metrics.jsonl: not a phase of the job (status keeps its last one), and
        # not a tracker series (its fields are words).
        self.run_dir.append_metrics({"time": round(time.time() - self._t0, 3),
                                     "phase": "control", **action.to_dict(),
                                     "started_at": round(self._t0, 3)})

    def _start_coordinator(self) -> RolloutCoordinator:
        """A new incarnation of the rollout coordinator (the rollout domain calls this at
        every start), handed exactly what it needs of the job."""
        assert self.tree is not None and self.paths is not None, "the tree is built first"
        self.coordinator = RolloutCoordinator(CoordinatorContext(
            cfg=self.cfg, run_dir=self.run_dir, tree=self.tree, paths=self.paths,
            journal=self.journal, sink=self.transitions, tokenizer=self.tokenizer,
            max_seq_len=self.plan.max_seq_len, validation_rows=self.env_spec.validation_rows,
            observer=self.telemetry, report=self.report_metrics, abort=self.abort,
            checkpoint_failed=self.checkpoint_failed, training_ended=self._training_ended,
            control=self.control_action))
        return self.coordinator

    @property
    def restart_count(self) -> int:
        """Restarts in the job's tree so far (``erlay status``, the progress bar)."""
        return self.restarts.restarts

    def _training_ended(self, step: int) -> None:
        self.completed_steps = step

    def tool_call(self, key: str, code: str) -> concurrent.futures.Future[dict[str, Any]]:
        """Chaos's hook into a running job: ``code`` as a tool call through the running
        coordinator's sandbox client, as a rollout would make it.  Raises LookupError when
        no coordinator is running."""
        if self.coordinator is None:
            raise LookupError("the rollout coordinator is not running")
        return self.coordinator.tool_call(key, code)

    def report_metrics(self, record: dict[str, Any]) -> None:
        """Called by the coordinator: one line in metrics.jsonl, one update of the bar."""
        # started_at: the wall clock of `time` 0, so reports can place events on steps
        record = {"time": round(time.time() - self._t0, 3), **record,
                  "restarts": self.restarts.restarts, "started_at": round(self._t0, 3)}
        if record.get("phase") == "rl":
            record.update(self.telemetry.step(record))
            self.last_rl_metrics = record  # `erlay status` shows its step and reward
        self.last_metrics = record
        self.run_dir.append_metrics(record)
        self.trackers.log(record, self.telemetry.totals())
        self.metrics.put(record)

    # -------------------------------------------------------------------- the tree
    def model_config(self) -> dict[str, Any]:
        model_dir = self.cfg.engine.vllm.model_dir
        # model_dir is the built-in model's (the plan refuses it beside model.hf): an HF
        # model's learner ranks and engines all load plan.spec's directory.
        if self.cfg.engine.backend == "vllm" and model_dir:
            # The served checkpoint fixes the policy's shape; the learner loads its weights.
            from erlay.actors.model.hf_export import read_model_dir
            shape, _ = read_model_dir(model_dir)
            if shape["vocab_size"] < self.tokenizer.vocab_size:
                raise ConfigError(f"engine.vllm.model_dir: its vocabulary ({shape['vocab_size']}"
                                  f" tokens) is smaller than the tokenizer's "
                                  f"({self.tokenizer.vocab_size})")
            return shape
        return dict(self.plan.spec)

    def _engine_start(self, model: dict[str, Any], opts: dict[str, Any],
                      spare_delay_s: float) -> ActorStart:
        """The start spec of one generation engine of the configured backend (every engine's
        is equal, so they share the warm spares)."""
        cfg = self.cfg
        spares = dict(spares=engine_spares(cfg), spare_delay_s=spare_delay_s,
                      spare_first_delay_s=cfg.engine.spare_start_delay_s)
        if cfg.engine.backend == "vllm":
            from erlay.actors.engine.vllm_engine import VllmEngine
            vllm = cfg.engine.vllm
            if cfg.engine.kv_handoff.enabled:
                log.info("engine.kv_handoff applies to the torch engine only: a failed vLLM "
                         "engine's rollouts prefill their contexts again (docs/generation.md)")
            options = {**opts, "num_gpus": vllm.num_gpus} if vllm.num_gpus else opts
            return ActorStart(VllmEngine, args=(model,), kwargs=dict(
                max_batch=cfg.engine.max_batch, seed=cfg.run.seed, model_dir=vllm.model_dir,
                speculative_config=vllm.speculative_config, engine_args=vllm_engine_args(cfg),
                rpc_timeout_s=vllm.rpc_timeout_s, torch_threads=cfg.engine.torch_threads),
                options=options, ready_timeout_s=vllm.start_timeout_s,
                boot_ahead=cfg.supervision.boot_ahead, **spares)
        from erlay.actors.engine.torch_engine import TorchEngine
        return ActorStart(TorchEngine, args=(model,), kwargs=dict(
            max_batch=cfg.engine.max_batch, torch_threads=cfg.engine.torch_threads,
            seed=cfg.run.seed, spec_k=cfg.engine.spec_k,
            spec_max_concurrency=cfg.engine.spec_max_concurrency,
            spec_verify=cfg.engine.spec_verify, spec_draft=cfg.engine.spec_draft,
            kv_handoff=self._handoff_options()),
            options=opts, boot_ahead=cfg.supervision.boot_ahead, **spares)

    def handoff_dir(self) -> HandoffDir | None:
        """The run's node-local KV hand-off directory (torch engine with engine.kv_handoff)."""
        handoff = self.cfg.engine.kv_handoff
        if self.cfg.engine.backend != "torch" or not handoff.enabled:
            return None
        if self._handoff_dir is None:
            self._handoff_dir = HandoffDir(handoff.root, self.run_dir.path.name,
                                           driver_owner())
        return self._handoff_dir

    def _handoff_options(self) -> dict[str, Any] | None:
        where = self.handoff_dir()
        if where is None:
            return None
        return {"dir": where.path,
                "budget_bytes": self.cfg.engine.kv_handoff.node_budget_mb << 20}

    def build(self) -> SupervisionTree:
        cfg, sup = self.cfg, self.cfg.supervision
        model = self.model_config()
        env = {**actor_env(cfg.node), **self.telemetry.actor_env()}
        # Every actor of the job configures its telemetry from ERLAY_TELEMETRY (see
        # supervisor.telemetry), so its spans join the job's traces.
        opts: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        declared = declared_env(cfg.node)  # hosts forward it to all they spawn
        # The ranks meet at rank 0's node, which Ray picks: rank 0 announces its address
        # under this job's key (erlay.actors.learner.rendezvous).
        rendezvous = f"learner-master:{self.run_dir.path.resolve()}"
        learner_opts = {**opts, "num_gpus": cfg.learner.num_gpus} if cfg.learner.num_gpus \
            else opts
        learners = [ChildSpec(f"learner-{r}", ActorStart(learner_class(cfg), args=(
            model, learner_options(cfg, r, rendezvous=rendezvous, run_dir=self.run_dir)),
            options=self.placement.learner(r, learner_opts), boot_ahead=sup.boot_ahead),
            deadlines={"train_step": cfg.learner.train_deadline_s,
                       "sft": cfg.learner.train_deadline_s})
            for r in range(cfg.learner.num_ranks)]
        restart_delay_s, spare_delay_s = engine_restart_delay(cfg)
        engines = [ChildSpec(f"engine-{i}", self._engine_start(
                                 model, self.placement.engine(i, opts), spare_delay_s),
                             deadlines={"decode_step": cfg.engine.decode_deadline_s},
                             shutdown=15.0 if cfg.engine.backend == "vllm" else None,
                             restart_delay_s=restart_delay_s)
                   for i in range(cfg.engine.num_engines)]
        nodes = sorted(n["NodeID"] for n in alive_nodes())
        pool = SupervisorFlags("simple_one_for_one", intensity=sup.sandbox.intensity,
                               period=sup.sandbox.period)
        sandbox_template = ChildSpec("sandbox", InProcessStart(
            "erlay.sandbox.worker:SandboxWorker", args=(dict(cfg.sandbox.limits),)),
            deadlines={"tool_call": self.tool_deadline()})
        workers = cfg.sandbox.workers_per_node
        # Each worker runs code as its own uid (60000 + slot); hosts that share a machine
        # (simulated nodes) must not share slots.
        sandbox_hosts = [host_spec(f"node-{i}", pool, (sandbox_template,), node_id=node,
                                   instances=tuple((i * workers + s,) for s in range(workers)),
                                   options=opts, env=declared, boot_ahead=sup.boot_ahead)
                         for i, node in enumerate(nodes)]
        judge_hosts = self._worker_hosts(nodes, "judge", WorkerStart(
            "erlay.judges.server:JudgeServer", args=(cfg.judge.cls, dict(cfg.judge.kwargs)),
            call_timeout_s=cfg.judge.timeout_s, ready_timeout_s=cfg.plugins.build_timeout_s),
            cfg.judge.workers_per_node, opts, declared)
        env_hosts = self._worker_hosts(nodes, "environment", WorkerStart(
            "erlay.actors.job.env_worker:EnvironmentServer", args=(self.env_spec,),
            call_timeout_s=cfg.plugins.timeout_s, ready_timeout_s=cfg.plugins.build_timeout_s),
            cfg.environment.workers_per_node, opts, declared)
        coordinator = ChildSpec("coordinator", InProcessStart(self._start_coordinator),
                                restart="transient", significant=True, shutdown=30.0)

        def domain(cid: str, flags: SupervisorFlags, children: list[ChildSpec],
                   **kw: Any) -> ChildSpec:
            return ChildSpec(cid, SupervisorStart(flags, tuple(children)), type="supervisor",
                             **kw)

        root_flags = _flags("one_for_one", sup.root, auto_shutdown="any_significant")
        flags = {d: getattr(sup, d) for d in ("learner", "generation", "sandbox", "judge",
                                             "environment", "rollout")}
        if sup.mode == "job_restart":
            # The baseline recovery mode of the root: no domain may restart anything (intensity
            # 0 escalates at the first failure), and the root answers any escalation by
            # restarting every domain (one_for_all): the learner reloads its checkpoint and
            # the coordinator starts that step over without replaying the journal.
            flags = {d: f.model_copy(update={"intensity": 0}) for d, f in flags.items()}
            root_flags = SupervisorFlags("one_for_all", intensity=max(sup.root.intensity, 50),
                                         period=sup.root.period,
                                         auto_shutdown="any_significant")
        children = [
            domain("learner", _flags("one_for_all", flags["learner"]),
                   _live(learners, flags["learner"])),
            domain("generation", _flags("one_for_one", flags["generation"]),
                   _live(engines, flags["generation"])),
            domain("sandbox", _flags("one_for_one", flags["sandbox"]),
                   _live(sandbox_hosts, flags["sandbox"])),
            domain("judge", _flags("one_for_one", flags["judge"]),
                   _live(judge_hosts, flags["judge"])),
            domain("environment", _flags("one_for_one", flags["environment"]),
                   _live(env_hosts, flags["environment"])),
            domain("rollout", _flags("rest_for_one", flags["rollout"],
                                     auto_shutdown="any_significant"), [coordinator],
                   restart="transient", significant=True),
        ]
        self.paths = DomainPaths(
            learners=[f"{ROOT}/learner/{c.id}" for c in learners],
            engines=[f"{ROOT}/generation/{c.id}" for c in engines],
            sandbox_hosts=[f"{ROOT}/sandbox/{h.id}" for h in sandbox_hosts],
            sandbox_workers=[f"sandbox-{i + 1}" for i in range(cfg.sandbox.workers_per_node)],
            judge_hosts=[f"{ROOT}/judge/{h.id}" for h in judge_hosts],
            environment_hosts=[f"{ROOT}/environment/{h.id}" for h in env_hosts])
        self.tree = SupervisionTree(ROOT, root_flags, children, sink=self.events)
        return self.tree

    def _worker_hosts(self, nodes: list[str], domain: str, start: WorkerStart, workers: int,
                      opts: dict[str, Any], declared: dict[str, str]) -> list[ChildSpec]:
        """One host per node for a domain of worker processes (the judge, the
        environment): a simple_one_for_one pool of ``workers`` worker processes each.  Its
        flags are the domain's: a process replaced after a call it froze or killed counts
        toward no intensity (see :mod:`erlay.supervisor.worker_process`); a worker that
        cannot start, or fails for its own reasons, does."""
        flags = getattr(self.cfg.supervision, domain)
        pool = SupervisorFlags("simple_one_for_one", intensity=flags.intensity,
                               period=flags.period)
        template = ChildSpec(domain, start, shutdown=5.0)
        return [host_spec(f"node-{i}", pool, (template,), node_id=node,
                          instances=tuple(() for _ in range(workers)), options=opts,
                          env=declared, boot_ahead=self.cfg.supervision.boot_ahead)
                for i, node in enumerate(nodes)]

    def tool_deadline(self) -> float:
        wall = float(self.cfg.sandbox.limits.get("wall_timeout_s", 5.0))
        return wall * 2 + 5.0

    # --------------------------------------------------------------------- running
    def run(self, *, progress: bool = True, on_start: Any = None) -> JobResult:
        """Start Ray (or attach), run the tree until training ends, write the run dir.
        Garbage collection runs with short pauses meanwhile (the supervision loop shares
        this process: :mod:`erlay.supervisor.gcpauses`)."""
        with short_gc_pauses():
            return self._run(progress, on_start)

    def _run(self, progress: bool, on_start: Any) -> JobResult:
        cfg = self.cfg
        self.run_dir.config.write_text(cfg.to_yaml(), encoding="utf-8")
        if self.run_dir.remote is not None:   # the driver's files go to the store too
            self.mirror = Mirror(self.run_dir.path, self.run_dir.remote, driver_files,
                                 cfg.run.upload_every_s, name="driver mirror",
                                 marks=snapshot_marks).start()
        from erlay.actors.observe.status import StatusPublisher, identity_metadata
        ray_info = ensure_ray(cfg.ray.address, num_cpus=cfg.ray.num_cpus,
                              include_dashboard=cfg.ray.include_dashboard,
                              metadata=identity_metadata(  # `ray job list` names the run
                                  cfg.run.name, self.run_dir.path.name, self.run_dir.path,
                                  self.run_dir.config))
        started = time.time()
        nodes = sorted(n["NodeID"] for n in alive_nodes())
        try:
            # Seed JIT caches, make the KV hand-off directory; stack versions agree, or stop.
            prepare_nodes(cfg.node, nodes, self.handoff_dir())
            self.placement = reserve(cfg)   # colocated pairs' bundles, or nothing
        except Exception as exc:  # noqa: BLE001 - a lost node, a timeout: end cleanly, say why
            remove_handoff(nodes, self.handoff_dir())   # made on the nodes that answered
            if ray_info["started"]:
                shutdown_ray()
            why = (f"nodes run different versions; nothing was started:\n{exc.table}"
                   if isinstance(exc, VersionMismatch) else
                   f"preparing the nodes failed; nothing was started: {exc!r}")
            return self._end(JobResult("failed", why, time.time() - started, self.run_dir))
        self.telemetry.start(self.span_exporter)
        self.trackers.start()
        tree = self.build()
        status = StatusPublisher.for_job(self, tree)  # `erlay status` reads what it publishes
        result: JobResult | None = None
        try:
            status.start()  # before the boot, so that a slow boot shows too
            tree.start()
            if on_start is not None:
                on_start(tree)
            stalled = self._follow(tree, progress)
            if stalled is not None:
                tree.stop()
                result = JobResult("failed", stalled, time.time() - started, self.run_dir,
                                   "rollout")
            else:
                reason: ExitReason = tree.wait()
                result = self._outcome(reason, time.time() - started)
        except SupervisorFailed as exc:
            result = JobResult("failed", str(exc), time.time() - started, self.run_dir,
                               exc.offender)
        except ChildStartError as exc:  # the boot failed: nothing is left running
            result = JobResult("failed", f"the tree did not start: {exc}",
                               time.time() - started, self.run_dir, exc.child)
        except BaseException:
            tree.stop()
            self._close()
            raise
        finally:
            if result is not None:
                status.finish(result.status, result.reason,
                              0 if result.status == "finished" else 1)
            status.stop()
            # The elected node archives JIT caches; every node's KV hand-off caches go.
            finish_nodes(cfg.node, nodes, self.run_dir.path.name, self.handoff_dir())
            self.placement.remove()
            if ray_info["started"]:  # a Ray this job started ends with it, agents and all
                shutdown_ray()
            # The coordinator froze the driver's heap for the run (coordinator.py: setup);
            # unfrozen, the process's exit collects it as usual.  Left frozen, native
            # modules' leak checks (nanobind's, from triton) print hundreds of lines at
            # exit, after the job's own last word.
            gc.unfreeze()
        assert result is not None  # every other way out raised
        return self._end(result)

    def _outcome(self, reason: ExitReason, wall_s: float) -> JobResult:
        """Finished only when every configured step trained; anything else is a failure
        that says why (a broken plug-in, a domain that ended the job early)."""
        if self.abort_reason is not None:
            return JobResult("failed", self.abort_reason, wall_s, self.run_dir, "rollout")
        if self.completed_steps != self.cfg.run.steps:
            done = self.completed_steps if self.completed_steps is not None else \
                1 + max((int(m["step"]) for m in self.run_dir.rl_steps()), default=-1)
            return JobResult("failed", f"the job ended after {done} of {self.cfg.run.steps} "
                             f"steps: the tree stopped ({reason})", wall_s, self.run_dir,
                             "rollout")
        return JobResult("finished", str(reason), wall_s, self.run_dir)

    def _end(self, result: JobResult) -> JobResult:
        self._close()
        self.trackers.close(result.status, self._export)
        plot_rewards(self.run_dir)
        # The summary's wall time runs from this driver's start (its records' started_at),
        # Ray's start-up included, so that a resumed run's segments and outages add up.
        write_summary(self.run_dir, result.status, time.time() - self._t0, result.reason,
                      started_at=self._t0)
        self._append_attribution()
        return self._uploaded(result)

    def _uploaded(self, result: JobResult) -> JobResult:
        """``result``, once the driver's files reached the remote home; a run whose files
        did not (past ``run.upload_timeout_s``) failed, and says where its local copy is."""
        if self.mirror is None:
            return result
        done = self.mirror.close(self.cfg.run.upload_timeout_s)
        if done.ok:
            return result
        why = (f"the run directory was not uploaded to {self.run_dir.location}: {done.error}; "
               f"the local copy is {self.run_dir.path}")
        log.error("%s", why)
        if result.status != "finished":
            return result
        return dataclasses.replace(result, status="failed", reason=why, offender="storage")

    def _export(self, out: Path) -> Path:
        """The run's newest checkpoint as an HF model directory in ``out`` (``erlay
        export``), for the trackers that keep the final model."""
        from erlay.actors.job.export import export_run
        return export_run(self.run_dir.path, out).out

    def _append_attribution(self) -> None:
        """The failure-attribution table (by domain and cause, with recovery times and
        time lost) at the end of summary.md; ``erlay report`` has the full report."""
        from erlay.actors.observe.report import attribution_section
        try:
            lines = attribution_section(self.run_dir.path)
        except Exception:  # the summary without the table beats no summary
            log.warning("summary: the failure attribution failed", exc_info=True)
            return
        with self.run_dir.summary.open("a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines) + "\n\nFull report: `erlay report "
                    f"{self.run_dir.location}`\n")

    def _close(self) -> None:
        self.telemetry.close()
        self._jsonl.close()
        if self.journal is not None:
            self.journal.close()

    def _follow(self, tree: SupervisionTree, progress: bool) -> str | None:
        """Drain metrics into a progress bar (without ``progress``: one :func:`step_line` per
        RL step, logged at INFO by ``erlay.progress``) until the tree ends.  Returns why the
        job is stalled, when no metrics came for ``run.stall_timeout_s`` (else None)."""
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=self.cfg.run.steps, unit="step", dynamic_ncols=True,
                       mininterval=0.5)
        last = time.time()
        heard = time.monotonic()
        samples = 0
        try:
            while tree.alive:
                try:
                    record = self.metrics.get(timeout=0.5)
                except queue.Empty:
                    silent = time.monotonic() - heard
                    if silent > self.cfg.run.stall_timeout_s:
                        return self._stall_reason(silent)
                    continue
                heard = time.monotonic()
                if record.get("phase") != "rl":
                    continue
                if bar is None:  # --no-progress: a cluster log needs one line per step
                    progress_log.info("%s", step_line(record, self.cfg.run.steps))
                    continue
                now = time.time()
                samples = record["samples"]
                bar.update(1)
                mean = record.get("reward_mean")
                bar.set_postfix(reward="-" if mean is None else f"{mean:.3f}",
                                samples_s=f"{samples / max(now - last, 1e-6):.0f}",
                                restarts=record["restarts"], refresh=False)
                last = now
        finally:
            if bar is not None:
                bar.close()
        return None

    def _stall_reason(self, silent: float) -> str:
        last = self.last_metrics or {}
        where = (f"step {last['step']}" if "step" in last else
                 f"phase {last.get('phase', 'start-up')}")
        return (f"stalled: no progress for {silent:.0f} s (run.stall_timeout_s "
                f"{self.cfg.run.stall_timeout_s:g}); last progress: {where}")
