"""The vocabulary of chaos scenarios: fault kinds, their parameters, what each is expected
to cause, and the hostile payloads.  Pure data and pydantic models; :mod:`.scenario` builds
a validated scenario from them.

Fault kinds, by level:

- process: ``sigkill``, ``sigterm``, ``sigstop`` (of an actor child or a host; ``stop_s``
  continues it, none leaves it frozen for its heartbeat to find; ``process:
  checkpoint_writer`` stops a learner rank's checkpoint writer mid-save instead, for the
  write's deadline, ``checkpoint.deadline_s``, to find), ``ray_kill``, ``node_loss``,
  ``driver_kill``;
- code: ``failpoint`` (any named failpoint), ``delay`` (slow calls at a domain's work),
  ``slow_checkpoint``, ``judge_fault``;
- user code: ``user_error`` (the environment or the judge raises, hangs, returns garbage,
  or freezes its process holding the GIL),
  ``partial`` (a judge or sandbox fails a given fraction of calls), ``sandbox_attack``
  (hostile code as a tool call).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from erlay.chaos.scenario_errors import invalid
from erlay.supervisor.failpoints import KNOWN, FailpointSpec

Inject = Literal["sigkill", "sigstop", "sigterm", "ray_kill", "node_loss", "failpoint",
                 "sandbox_attack", "judge_fault", "slow_checkpoint", "driver_kill", "delay",
                 "user_error", "partial"]
Expect = Literal["restart", "absorbed", "escalation"]
Invariant = Literal["no_rollout_lost", "no_duplicate_consumption", "exactly_once",
                    "staleness_within_bound", "steps_in_order", "tool_calls_once",
                    "judgements_stable", "checkpoints_intact", "replay_identical",
                    "faults_detected", "restart_intensity_respected", "no_orphans",
                    "reward_within_tolerance", "expected_end", "faults_injected",
                    "samples_judged", "kv_handoff_adopted"]
Baseline = Literal["fault_free", "job_restart"]
Attack = Literal["endless_loop", "fork_bomb", "memory_hog", "disk_fill", "output_flood",
                 "kill_parent"]
ALL_INVARIANTS: tuple[str, ...] = get_args(Invariant)
# Checked only where a scenario names them: they hold for what that scenario sets up, not
# for every run (a failover to an engine serving newer weights rightly re-prefills).
OPT_IN_INVARIANTS = ("kv_handoff_adopted",)
INVARIANTS: tuple[str, ...] = tuple(n for n in ALL_INVARIANTS if n not in OPT_IN_INVARIANTS)
SMOKE_MAX_DURATION_S = 90.0  # each smoke scenario's share of the CI smoke budget

# Hostile code a sandbox_attack submits as a tool call.  Each must end in a typed result
# (timeout, memory, output limit, ...) with the worker and its host alive.
ATTACKS: dict[str, str] = {
    "endless_loop": "while True:\n    pass\n",
    "fork_bomb": (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"),
    "memory_hog": (
        "hog = []\n"
        "for _ in range(10):\n"
        "    hog.append(b'x' * (1 << 30))  # 10 GiB in all, every page written\n"),
    "disk_fill": (
        "block = b'\\0' * (1 << 20)\n"
        "with open('fill.bin', 'wb') as f:\n"
        "    while True:\n"
        "        f.write(block)\n"),
    "output_flood": "while True:\n    print('x' * 1000)\n",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\n",
}

# Which tree domains each process-level inject may hit.  The rollout domain runs in the
# driver (the coordinator is in-process), so a signal there is a driver kill: use
# driver_kill, or the rollout.dispatch failpoint for a coordinator crash.
INJECT_DOMAINS: dict[str, tuple[str, ...]] = {
    "sigkill": ("learner", "generation", "sandbox", "judge", "environment"),
    "sigstop": ("learner", "generation", "sandbox", "judge", "environment"),
    "sigterm": ("learner", "generation", "sandbox", "judge", "environment"),
    "ray_kill": ("learner", "generation", "sandbox", "judge", "environment"),
    "sandbox_attack": ("sandbox",),
    "judge_fault": ("judge",),
    "slow_checkpoint": ("learner",),
    "delay": ("learner", "generation", "sandbox", "judge", "environment"),
    "partial": ("sandbox", "judge"),
}
# The plug-ins a user_error may hit, and the domain whose worker processes run them.
PLUGINS: dict[str, str] = {"environment": "environment", "judge": "judge"}
# Where a delay lands when its params name no failpoint: the work each domain does.
DELAY_SITES: dict[str, str] = {"generation": "generation.decode_step",
                               "learner": "learner.train_step", "sandbox": "sandbox.exec",
                               "judge": "judge.score", "environment": "environment.call"}
# Progress phases a signal may wait for (``params.during``), by domain: the phases whose
# deadlines the job arms (actors/job/driver.py) plus the engine's weight update.
PHASES: dict[str, tuple[str, ...]] = {
    "generation": ("decode_step", "weight_update"),
    "learner": ("train_step",),
    "sandbox": ("tool_call",),
    "judge": ("judge_call",),
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RandomTiming(_Model):
    rate_per_s: float = Field(gt=0, description="mean firings per second")
    seed: int = Field(description="seed of the arrival times: a seed gives one schedule")


class CountBounds(_Model):
    min: int = Field(0, ge=0, description="fewest firings within duration_s (checked at load)")
    max: int | None = Field(None, ge=1, description="most firings; required for every/random")

    @model_validator(mode="after")
    def _ordered(self) -> CountBounds:
        if self.max is not None and self.max < self.min:
            raise invalid([(("max",), f"expected max >= min ({self.min})", self.max)])
        return self


class SignalParams(_Model):
    during: str | None = Field(None, description="wait until the target holds work in this "
                               "progress phase, then inject (e.g. decode_step, tool_call)")
    wait_s: float = Field(3.0, gt=0, le=600, description="with during: how long to wait for "
                          "that phase before injecting anyway (said in the fault record)")


class SigstopParams(SignalParams):
    stop_s: float | None = Field(gt=0, description="SIGCONT after this long; null: never, a "
                                 "hang for the target's progress deadline to find")
    process: Literal["child", "checkpoint_writer"] = Field(
        "child", description="child: the target's own process; checkpoint_writer: a learner "
        "rank's checkpoint writer, once it holds a save (stopped mid-save)")


class FailpointParams(_Model):
    spec: dict[str, Any] = Field(description="an erlay.supervisor.failpoints.FailpointSpec")
    in_: str | None = Field(None, alias="in", description="where to arm it: a tree path or "
                            "glob (every match), or 'driver'; default: where its code runs")
    scope: Literal["remote", "env"] = Field("remote", description="remote: armed in the "
                                            "running processes at the firing time; env: "
                                            "armed in every process from its start (at: 0)")

    @field_validator("spec")
    @classmethod
    def _valid_spec(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            return FailpointSpec.from_dict(value).to_dict()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expected a failpoint spec ({exc})") from None


class SandboxAttackParams(_Model):
    attack: Attack = Field(description="which payload of ATTACKS to run as a tool call")


class JudgeFaultParams(_Model):
    mode: Literal["raise", "hang", "garbage"] = Field(description="how the judge misbehaves")
    count: int | None = Field(None, ge=1, description="judgements affected (runner default)")


class SlowCheckpointParams(_Model):
    delay_s: float = Field(gt=0, description="extra seconds each affected save takes")
    count: int | None = Field(None, ge=1, description="saves affected (runner default)")


class DelayParams(_Model):
    delay_s: float = Field(gt=0, description="extra seconds each affected call takes")
    site: str | None = Field(None, description="the failpoint where the delay is added; "
                             "default: the domain's work (decode step, train step, sandbox "
                             "run, judge call)")
    count: int | None = Field(None, ge=1, description="calls affected (default: all)")
    probability: float | None = Field(None, gt=0, le=1, description="share of calls affected")

    @field_validator("site")
    @classmethod
    def _known(cls, value: str | None) -> str | None:
        if value is not None and value not in KNOWN:
            raise ValueError(f"expected a failpoint name, one of {', '.join(KNOWN)}")
        return value


class UserErrorParams(_Model):
    mode: Literal["raise", "hang", "bad_return", "freeze"] = Field(
        description="how the user's code fails; freeze: it holds the GIL (a catastrophic "
        "regex, a C loop) for freeze_s, stopping its whole process")
    freeze_s: float = Field(300.0, gt=0, description="freeze: how long the GIL is held")
    probability: float = Field(1.0, gt=0, le=1, description="share of calls that fail")
    count: int | None = Field(None, ge=1, description="calls that fail at most")
    seed: int | None = Field(None, description="seed of the random draws")


class PartialParams(_Model):
    fraction: float = Field(gt=0, lt=1, description="share of calls that fail")
    seed: int = Field(0, description="seed of the random draws")


_PARAMS: dict[str, type[_Model]] = {
    "sigkill": SignalParams, "sigterm": SignalParams, "ray_kill": SignalParams,
    "sigstop": SigstopParams, "node_loss": _Model, "driver_kill": _Model,
    "failpoint": FailpointParams, "sandbox_attack": SandboxAttackParams,
    "judge_fault": JudgeFaultParams, "slow_checkpoint": SlowCheckpointParams,
    "delay": DelayParams, "user_error": UserErrorParams, "partial": PartialParams,
}


def default_expect(inject: str, params: dict[str, Any]) -> Expect:
    """What a fault's ``expect`` is when the scenario does not say, from its kind and params.

    Absorbed faults leave no restart behind: hostile code ends as a sandbox result, a garbage
    verdict is a marked sample, a short pause or a delay only slows the job, user code that
    fails fails its sample, a partly failing judge or sandbox is retried or marked, and a
    killed driver is no child of any supervisor (``--resume`` must carry on).
    """
    match inject:
        case "sigkill" | "sigterm" | "ray_kill" | "node_loss":
            return "restart"
        case "delay" | "user_error" | "partial":
            return "absorbed"  # a slow call, a failed sample, a retried judgement
        case "sigstop":
            if params.get("process") == "checkpoint_writer":
                return "absorbed"  # the learner kills the writer; that save fails, no restart
            return "restart" if params.get("stop_s") is None else "absorbed"
        case "failpoint":
            return "absorbed" if params["spec"]["action"] in ("delay", "corrupt") else "restart"
        case "judge_fault":
            # raise: the worker's own code crashes it (restarted, the judgement retried);
            # hang: the judgement's deadline kills its process, replaced in place, and the
            # sample fails as a timeout; garbage: a marked sample.
            return "restart" if params["mode"] == "raise" else "absorbed"
        case "sandbox_attack" | "slow_checkpoint" | "driver_kill":
            return "absorbed"
    raise AssertionError(f"no default expectation for {inject!r}")


