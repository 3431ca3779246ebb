"""Running a chaos scenario: the job, its baselines, the faults on schedule, the verdicts.

``run_scenario(scenario)``:

1. runs the baselines the scenario asks for (or its invariants need): a fault-free run and a
   whole-job-restart run (``supervision.mode=job_restart``: the same faults, recovered the
   way most RL stacks do), all with the same seeds;
2. runs the job with the faults injected on the scenario's schedule, counted from the first
   RL step, and stops it at the scenario's duration bound if it has not ended by then;
3. checks every invariant from the journal, the events and the metrics (never from logs),
   looks for processes the job left behind, and writes ``chaos-report.json`` and
   ``chaos-report.md`` into the chaos run's directory.

A fault that could not be injected (its target was gone, the job ended first) fails the
``faults_injected`` invariant.  A job that stops making progress is stopped at the
scenario's duration bound and reported as ``stalled``, with its last progress: the report
is always written.  Orphans are counted only among the processes this run started: the
runner watches the descendants of this process, their sessions and process groups, while
the run lasts (:class:`ProcessWatch`); other work on the machine never counts.

A driver kill cannot be injected into this process; that scenario runs the job as an
``erlay run`` subprocess, SIGKILLs it and resumes it with ``--resume``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from erlay.actors.config import JobConfig, load_config
from erlay.actors.job.driver import Job, JobResult
from erlay.actors.rundir import RunDir
from erlay.chaos.faults import FaultRecord
from erlay.chaos.gather import observe_run
from erlay.chaos.injectors import FAILPOINT_HOMES, Injector
from erlay.chaos.invariants import RunObservation, Verdict, check_all
from erlay.chaos.processes import ProcessWatch
from erlay.chaos.report import build_report, goodput, goodput_wall_s, write_report
from erlay.chaos.scenario import ATTACKS, FaultSpec, Scenario, schedule
from erlay.supervisor import failpoints
from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.raylocal import shutdown_ray

log = logging.getLogger("erlay.chaos")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunOutcome:
    """One run of the scenario's job (chaos or baseline) and what it left behind."""

    name: str
    run_dir: RunDir
    status: str                       # finished | failed | stalled
    reason: str
    wall_s: float
    observation: RunObservation
    faults: list[FaultRecord] = field(default_factory=list)
    attack_results: list[dict[str, Any]] = field(default_factory=list)
    not_injected: list[str] = field(default_factory=list)


@dataclass
class ChaosResult:
    scenario: str
    run: RunOutcome
    verdicts: list[Verdict]
    report: dict[str, Any]
    report_paths: tuple[Path, Path]
    baselines: dict[str, RunOutcome]

    @property
    def ok(self) -> bool:
        return all(v.ok is not False for v in self.verdicts)


def job_config(scenario: Scenario, config: Path | None, parent: Path,
               extra: list[str] | None = None) -> JobConfig:
    return load_config(config or scenario.config_path,
                       [*scenario.overrides, f"run.storage={parent}", *(extra or [])])


def run_scenario(scenario: Scenario, *, config: Path | None = None,
                 parent: Path | None = None, say: Any = print,
                 with_baselines: bool = True) -> ChaosResult:
    """Run ``scenario`` with its baselines; returns the verdicts and the report.

    ``with_baselines=False`` (the CI smoke subset) runs only the job with faults: the
    invariants that compare with a fault-free run are then skipped, and say so."""
    parent = Path(parent or ROOT / "runs" / "chaos")
    needs_clean = bool({"replay_identical", "reward_within_tolerance"} &
                       set(scenario.invariants)) or "fault_free" in scenario.baselines
    baselines: dict[str, RunOutcome] = {}
    if needs_clean and with_baselines:
        say(f"chaos {scenario.name}: fault-free baseline")
        baselines["fault_free"] = run_once(scenario, config, parent, "fault-free",
                                           inject=False)
    if "job_restart" in scenario.baselines and with_baselines:
        say(f"chaos {scenario.name}: whole-job-restart baseline (same faults)")
        baselines["job_restart"] = run_once(scenario, config, parent, "job-restart",
                                            inject=True, mode="job_restart")
    say(f"chaos {scenario.name}: run with faults")
    run = run_once(scenario, config, parent, "chaos", inject=True)
    clean = baselines.get("fault_free")
    verdicts = check_all(run.observation, fault_free=clean.observation if clean else None,
                         tolerance=scenario.reward_tolerance, expect_end=scenario.expect,
                         offender_pattern=scenario.offender, selected=list(scenario.invariants),
                         min_judged_share=scenario.min_judged_share)
    summary = {name: {"goodput": goodput(b.observation.metrics, goodput_wall_s(b.observation)),
                      "wall_s": goodput_wall_s(b.observation), "status": b.status}
               for name, b in baselines.items()}
    report = build_report(scenario.name, run.observation, verdicts, baselines=summary,
                          reason=run.reason if run.status != "finished" else "")
    report["attack_results"] = run.attack_results
    paths = write_report(run.run_dir.path, report)
    return ChaosResult(scenario.name, run, verdicts, report, paths, baselines)


# ------------------------------------------------------------------------ one run
def run_once(scenario: Scenario, config: Path | None, parent: Path, name: str, *,
             inject: bool, mode: str = "local") -> RunOutcome:
    if inject and any(f.inject == "driver_kill" for f in scenario.faults):
        return _run_with_driver_kill(scenario, config, parent, name)
    extra = ["supervision.mode=job_restart"] if mode == "job_restart" else []
    cluster = _start_cluster(scenario) if scenario.multinode else None
    if cluster is not None:
        extra.append(f"ray.address={cluster.address}")
    cfg = job_config(scenario, config, parent, extra)
    env_faults = {f.target: f.params["spec"] for f in scenario.faults
                  if inject and f.inject == "failpoint" and f.params.get("scope") == "env"}
    watch = ProcessWatch().start()
    if env_faults:
        # Armed in every process of the job from its first instruction (a crash loop): a
        # job-level runtime env reaches every Ray worker; the driver stays unarmed.
        from erlay.supervisor.raylocal import ensure_ray
        ensure_ray(cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                   runtime_env={"env_vars": {
                       failpoints.ENV_VAR: failpoints.env_value(env_faults)}})
    job = Job(cfg, RunDir.create(parent, f"{scenario.name}-{name}"))
    results: list[JobResult | BaseException] = []

    def target() -> None:
        try:
            results.append(job.run(progress=False))
        except BaseException as exc:  # noqa: BLE001 - reported as the run's status
            results.append(exc)

    started = time.time()
    thread = threading.Thread(target=target, name=f"chaos-{name}", daemon=True)
    thread.start()
    injector = Injector(job)
    for spec in scenario.faults:
        if inject and spec.params.get("scope") == "env":
            home = spec.params.get("in") or FAILPOINT_HOMES.get(spec.target, "driver")
            injector._record("failpoint", home, _expect(spec),
                             f"{spec.target} {json.dumps(spec.params['spec'])}, from start")
    status = "finished"
    not_injected: list[str] = []
    stalled = ""
    try:
        deadline = _wait_for_rl(job, thread, scenario.duration_s)
        if inject:
            not_injected = _inject_on_schedule(scenario, injector, job, thread, deadline,
                                               cluster)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            status = "stalled"
            stalled = _last_progress(job, scenario.duration_s)
            log.error("chaos: %s did not end within %.0f s (%s); stopping it", name,
                      scenario.duration_s, stalled)
            if job.tree is not None:
                job.tree.stop()   # bounded: it kills what does not stop
            thread.join(120)
    except Exception as exc:
        log.exception("chaos: %s failed in the runner", name)
        status, stalled = "stalled", f"the runner failed: {exc!r}"
        if job.tree is not None:
            job.tree.stop()
        thread.join(120)
    finally:
        injector.close()
        if cluster is not None:  # the cluster owns its nodes' processes: it ends them
            import ray
            ray.shutdown()
            cluster.shutdown()
        else:
            shutdown_ray()
    wall_s = time.time() - started
    result = results[0] if results else None
    reason = stalled
    if isinstance(result, JobResult):
        status = status if status == "stalled" else result.status
        reason = stalled or result.reason
    elif result is not None and not stalled:
        status, reason = "failed", repr(result)
    orphans = watch.orphans()
    observation = observe_run(cfg, job.run_dir, injector.records, wall_s, status,
                              result.offender if isinstance(result, JobResult) else None,
                              orphans, started_at=job._t0, not_injected=not_injected)
    return RunOutcome(name, job.run_dir, status, reason, wall_s, observation,
                      list(injector.records), list(injector.attack_results), not_injected)


def _expect(spec: FaultSpec) -> str:
    return spec.expect or "restart"


def _wait_for_rl(job: Job, thread: threading.Thread, duration_s: float) -> float:
    """Block until the first RL step is reported (faults are timed from there); returns the
    monotonic deadline of the run.  The warm start is not part of the scenario's time."""
    give_up = time.monotonic() + max(600.0, duration_s)
    while thread.is_alive() and time.monotonic() < give_up:
        if job.run_dir.rl_steps():
            break
        time.sleep(0.1)
    return time.monotonic() + duration_s


def _inject_on_schedule(scenario: Scenario, injector: Injector, job: Job,
                        thread: threading.Thread, deadline: float,
                        cluster: Any = None) -> list[str]:
    """Fire the timed faults at their offsets from now (the first RL step) and the
    ``at_step`` faults once the job has reported that many RL steps, until the job ends or
    the deadline passes.  Returns what could not be injected: a fault whose injection
    failed, and each firing the job ended (or the deadline came) before."""
    t0 = time.monotonic()
    timed = list(schedule(list(scenario.faults), scenario.duration_s))
    stepped = scenario.step_schedule()
    failed: list[str] = []
    while (timed or stepped) and thread.is_alive() and time.monotonic() < deadline:
        due: list[int] = []
        while timed and time.monotonic() >= t0 + timed[0][0]:
            due.append(timed.pop(0)[1])
        if stepped and len(job.run_dir.rl_steps()) >= stepped[0][0]:
            due.append(stepped.pop(0)[1])
        for index in due:
            problem = _fire(scenario.faults[index], injector, cluster, thread.is_alive)
            if problem is not None:
                failed.append(f"faults.{index} ({scenario.faults[index].inject} "
                              f"{scenario.faults[index].target}): {problem}")
        if not due:
            time.sleep(0.02 if not stepped else 0.05)
    return failed + unfired(scenario, [i for _, i in timed], [i for _, i in stepped])


def unfired(scenario: Scenario, timed_left: list[int], stepped_left: list[int]) -> list[str]:
    """What the job ending first kept from firing, given the fault indices of the firings
    still pending: every ``at``/``at_step`` fault, and each repeating fault that fired fewer
    than its ``count.min`` times (firings past ``count.min`` are extras a job that ended
    early may go without).  Faults armed at process start (``scope: env``) never pend."""
    scheduled = Counter(i for _, i in schedule(list(scenario.faults), scenario.duration_s))
    missed = Counter(timed_left)
    out = []
    for index in [*timed_left, *stepped_left]:
        fault = scenario.faults[index]
        if fault.params.get("scope") == "env":
            continue
        if fault.count is not None and scheduled[index] - missed[index] >= fault.count.min:
            continue
        out.append(f"faults.{index} ({fault.inject} {fault.target}): never fired, "
                   "the job ended first")
    return out


RETARGET_S = 10.0  # how long a fault waits for a target that is between incarnations


def _fire(spec: FaultSpec, injector: Injector, cluster: Any,
          job_alive: Callable[[], bool] = lambda: True) -> str | None:
    """Inject one fault; the reason it could not be injected, or None.

    A target that is not running right now (between two incarnations, or its supervisor
    restarting) is tried again for up to :data:`RETARGET_S` while the job runs: the fault
    then lands on the next incarnation rather than being dropped."""
    if spec.params.get("scope") == "env":
        return None  # armed at process start
    give_up = time.monotonic() + RETARGET_S
    while True:
        try:
            if spec.inject == "node_loss":
                injector.node_loss(cluster)
            else:
                inject_one(injector, spec)
            return None
        except (LookupError, ChildNotRunning) as exc:
            if job_alive() and time.monotonic() < give_up:
                time.sleep(0.2)
                continue
            problem = exc
        except Exception as exc:  # noqa: BLE001 - reported as a failed injection
            problem = exc
        log.warning("chaos: could not inject %s into %s: %s", spec.inject, spec.target,
                    problem)
        return f"{type(problem).__name__}: {problem}"


def _last_progress(job: Job, duration_s: float) -> str:
    """What a stalled run did last: its last RL step, or phase, and how long ago."""
    last = job.last_metrics or {}
    when = time.time() - job._t0 - float(last.get("time", 0.0))
    where = (f"RL step {last['step']}" if "step" in last else
             f"phase {last.get('phase', 'start-up')}")
    return (f"stalled: no end within the {duration_s:g} s bound; last progress: {where}, "
            f"{when:.0f} s before the stop")


def inject_one(injector: Injector, spec: FaultSpec) -> FaultRecord:
    """Apply one fault of the scenario to the running job."""
    params, expect = spec.params, _expect(spec)
    match spec.inject:
        case "sigkill" | "sigterm" | "sigstop":
            return injector.signal(spec.inject, spec.target, stop_s=params.get("stop_s"),
                                   expect=expect, during=params.get("during"),
                                   process=params.get("process", "child"),
                                   wait_s=float(params.get("wait_s", 3.0)))
        case "ray_kill":
            return injector.ray_kill(spec.target, expect=expect)
        case "failpoint":
            return injector.failpoint(spec.target, dict(params["spec"]), params.get("in"),
                                      expect=expect)
        case "sandbox_attack":
            return injector.sandbox_attack(params["attack"], ATTACKS[params["attack"]])
        case "judge_fault":
            mode = params["mode"]
            where = spec.target if spec.target.startswith("erlay/") else "erlay/judge/host@*"
            if mode == "garbage":
                return injector.failpoint("judge.verdict", {
                    "action": "corrupt", "count": int(params.get("count") or 3)},
                    where, expect="absorbed")
            return injector.failpoint("judge.score", {"action": mode, "count": int(
                params.get("count") or 1)}, where, expect=expect)
        case "delay":
            from erlay.chaos.params import DELAY_SITES
            site = params.get("site") or DELAY_SITES[spec.domain]
            return injector.delay(spec.target, site, float(params["delay_s"]),
                                  params.get("count"), params.get("probability"))
        case "user_error":
            return injector.user_error(spec.target, params["mode"],
                                       float(params.get("probability", 1.0)),
                                       params.get("count"), params.get("seed"),
                                       float(params.get("freeze_s", 300.0)))
        case "partial":
            return injector.partial(spec.target, float(params["fraction"]),
                                    int(params.get("seed", 0)))
        case "slow_checkpoint":
            return injector.failpoint("learner.checkpoint", {
                "action": "delay", "delay_s": float(params["delay_s"]),
                "count": int(params.get("count") or 1)}, "erlay/learner/learner-0",
                expect="absorbed")
        case _:
            raise ValueError(f"inject {spec.inject!r} is not supported in-process")


# Lost nodes are noticed in about 1.5 s instead of Ray's default of about 15 s.
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
               "health_check_timeout_ms": 500, "health_check_initial_delay_ms": 0}


def _start_cluster(scenario: Scenario) -> Any:
    """A local multi-node Ray (``ray.cluster_utils.Cluster``), all on loopback: the head
    plus ``multinode.nodes - 1`` worker nodes, with fast node-health checks."""
    import ray
    from ray.cluster_utils import Cluster

    import erlay.supervisor.raylocal  # noqa: F401 - sets the loopback-only variable before Ray
    if ray.is_initialized():
        shutdown_ray()
    spec = scenario.multinode
    nodes = int(spec["nodes"] if isinstance(spec, dict) else spec.nodes)  # type: ignore[union-attr]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "_system_config": FAST_HEALTH, "include_dashboard": False,
        "node_ip_address": "127.0.0.1"})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


# --------------------------------------------------------------- driver kill
def _run_with_driver_kill(scenario: Scenario, config: Path | None, parent: Path,
                          name: str) -> RunOutcome:
    """``erlay run`` in a subprocess; SIGKILL it at the fault's time after the first RL
    step; then ``erlay run --resume`` to the end.  Faults other than the kill are ignored."""
    cfg = job_config(scenario, config, parent / f"{scenario.name}-{name}")
    fault = next(f for f in scenario.faults if f.inject == "driver_kill")
    delay = fault.at if fault.at is not None else 5.0
    args = [sys.executable, "-m", "erlay.supervisor.cli", "run",
            str(config or scenario.config_path),
            *scenario.overrides, f"run.storage={parent / f'{scenario.name}-{name}'}",
            "--no-progress"]
    watch = ProcessWatch().start()
    started = time.time()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    run_path = _wait_for_rundir(parent / f"{scenario.name}-{name}", proc, scenario.duration_s)
    time.sleep(delay)
    alive = proc.poll() is None
    records = [FaultRecord(id=0, kind="driver_kill", target="driver", domain="driver",
                           at=time.time(), expect="absorbed", detail=f"pid {proc.pid}")]
    if alive:
        os.kill(proc.pid, signal.SIGKILL)
    code = proc.wait(timeout=30)
    # The kill landed only if the driver was running and died of it: a driver that had
    # already ended proves nothing about a resume.
    not_injected = [] if alive and code == -signal.SIGKILL else [
        f"faults.0 (driver_kill driver): the driver ended with exit code {code} "
        + ("before the kill" if not alive else "instead of dying of the SIGKILL")]
    time.sleep(2.0)  # Ray's processes share the driver's fate; let them go
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    resumed = subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", "run", "--resume",
                              str(run_path), "--no-progress"], cwd=ROOT, capture_output=True,
                             text=True, timeout=scenario.duration_s + 300)
    wall_s = time.time() - started
    status = "finished" if resumed.returncode == 0 else "failed"
    run_dir = RunDir(run_path)
    observation = observe_run(cfg, run_dir, records, wall_s, status, None, watch.orphans(),
                              not_injected=not_injected)
    return RunOutcome(name, run_dir, status, resumed.stderr[-2000:], wall_s, observation,
                      records, not_injected=not_injected)


def _wait_for_rundir(parent: Path, proc: subprocess.Popen[bytes], bound: float) -> Path:
    deadline = time.monotonic() + max(600.0, bound)
    while time.monotonic() < deadline and proc.poll() is None:
        for run in parent.glob("*"):
            if RunDir(run).rl_steps():
                return run
        time.sleep(0.1)
    raise RuntimeError(f"the job under {parent} never reached its first RL step")
