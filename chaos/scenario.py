"""Chaos scenarios: which faults hit a short job, when, and what must hold afterwards.

A scenario is one YAML file in ``configs/chaos/`` (see :data:`SCENARIO_DIR`), validated once
by :func:`load_scenario` into a frozen :class:`Scenario`, so a bad scenario fails before Ray
starts.  A :class:`ScenarioError` names the file, the key path (``faults.2.params.attack``),
what was expected and what was given, with a did-you-mean for unknown keys and names.

What load time checks, beyond the types:

- the job config exists and accepts the scenario's overrides (``erlay.actors.config.load_config``);
- every target is a child of the job's tree (:func:`job_tree_paths`), a known failpoint, a
  worker node of ``multinode``, or the driver, as its ``inject`` requires;
- each fault has exactly one timing form and the per-inject ``params`` it needs;
- each fault's ``count.min`` fits in ``duration_s`` (:func:`schedule` is run once), and a
  fault timed by ``at`` or ``every`` fires at least once;
- the scenario's ``expect`` agrees with its faults' (an escalation ends the job).

Timing forms, in seconds after the first RL step (the warm start is not scenario time):
``at: T`` fires once; ``at_step: N`` fires once, when the job has reported its N-th RL step
(the same point in training on a fast machine and a slow one); ``every: P`` fires at
``start``, ``start + P``, ... (``start`` defaults to ``P``); ``random: {rate_per_s,
seed}`` is a seeded Poisson process from ``start`` (default 0).  ``every`` and ``random``
need ``count.max``.  Nothing fires at or after ``duration_s``, the hard bound after which
the runner stops the job.

A glob target hits one matching child per firing (the runner's choice, round robin); a
failpoint's ``params.in`` is where it is armed, every matching process.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticKnownError

from erlay import configs
from erlay.actors.config import ConfigError, JobConfig, load_config
from erlay.chaos.params import (
    _PARAMS,
    ATTACKS,
    INJECT_DOMAINS,
    INVARIANTS,
    PHASES,
    PLUGINS,
    SMOKE_MAX_DURATION_S,
    Attack,
    Baseline,
    CountBounds,
    Expect,
    FailpointParams,
    Inject,
    Invariant,
    RandomTiming,
    _Model,
    default_expect,
)
from erlay.chaos.scenario_errors import (
    NOTHING,
    Problem,
    ScenarioError,
    describe,
    did_you_mean,
    invalid,
    one_line,
    relocated,
    type_at,
)
from erlay.chaos.schedule import schedule, schedule_problems
from erlay.supervisor.failpoints import KNOWN, FailpointSpec

__all__ = ["ATTACKS", "INVARIANTS", "ROOT", "SCENARIO_DIR", "Attack", "FaultSpec", "Scenario",
           "ScenarioError", "default_expect", "job_tree_paths", "list_scenarios", "load_scenario",
           "resolve_config", "schedule"]

# The root of the job's tree; actors/job.py's ROOT (importing it would pull in Ray).
ROOT = "erlay"
REPO_ROOT = Path(configs.__file__).resolve().parent.parent
SCENARIO_DIR = Path(configs.__file__).resolve().parent / "chaos"

_TREE_PATH = re.compile(rf"^{ROOT}/([^/*?\[\]]+)/([^/]+)$")
_WORKER_NODE = re.compile(r"^worker-(\d+|[*?\[\]0-9-]+)$")


# -------------------------------------------------------------------- the schema
class MultiNode(_Model):
    nodes: int = Field(ge=2, description="Ray nodes: the head (the driver's) and nodes - 1 "
                       "workers, worker-1 ...; node_loss may remove workers only")


class FaultSpec(_Model):
    """One fault of a scenario: what is injected where, when, how often, and what must follow.

    ``params`` is validated per ``inject`` and stored with defaults filled in; ``expect`` is
    always set (see :func:`default_expect`).
    """

    inject: Inject
    target: str = Field(None, validate_default=True, description="tree path or glob, a "
                        "failpoint name, worker-<k> (node_loss) or driver (driver_kill)")
    at: float | None = Field(None, ge=0, description="fire once, this long after RL starts")
    at_step: int | None = Field(None, ge=1, description="fire once, when the job has "
                                "reported this many RL steps")
    every: float | None = Field(None, gt=0, description="fire with this period")
    start: float | None = Field(None, ge=0, description="every: first firing (default: "
                                "every); random: start of the process (default 0)")
    random: RandomTiming | None = None
    count: CountBounds | None = None
    params: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    expect: Expect = Field(None, validate_default=True)

    @field_validator("target", mode="before")
    @classmethod
    def _target(cls, value: Any, info: ValidationInfo) -> Any:
        inject = info.data.get("inject")
        if value is None:
            if inject == "driver_kill":
                return "driver"
            raise PydanticKnownError("missing")
        if not isinstance(value, str) or inject is None:
            return value
        match inject:
            case "failpoint":
                if value not in KNOWN:
                    raise invalid([((), f"expected a failpoint name, one of {', '.join(KNOWN)} "
                                    f"(given {value!r}){did_you_mean(value, KNOWN)}", NOTHING)])
            case "node_loss":
                if not _WORKER_NODE.match(value):
                    raise ValueError("expected a worker node, worker-<k> with k >= 1 (the "
                                     "head, node 0, holds the driver and is never lost)")
            case "driver_kill":
                if value != "driver":
                    raise ValueError("expected 'driver'")
            case "user_error":
                if value not in PLUGINS:
                    raise ValueError(f"expected the plug-in whose code fails, one of "
                                     f"{', '.join(PLUGINS)}")
            case _:
                _check_tree_path(value, INJECT_DOMAINS[inject])
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _params(cls, value: Any, info: ValidationInfo) -> Any:
        inject = info.data.get("inject")
        if value is None:
            value = {}
        if inject is None or not isinstance(value, dict):
            return value
        try:
            params = _PARAMS[inject].model_validate(value)
        except ValidationError as exc:
            raise relocated(exc, ()) from None
        target = info.data.get("target")
        if isinstance(params, FailpointParams) and params.in_ is not None and target:
            _check_failpoint_site(params.in_, target)
        return params.model_dump(by_alias=True)

    @field_validator("expect", mode="before")
    @classmethod
    def _expect(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            return value
        inject, params = info.data.get("inject"), info.data.get("params")
        if inject is None or params is None:
            return "restart"  # the fault is invalid anyway; its real errors are reported
        return default_expect(inject, params)

    @model_validator(mode="after")
    def _timing(self) -> FaultSpec:
        problems: list[Problem] = []
        given = [k for k in ("at", "at_step", "every", "random") if getattr(self, k) is not None]
        once = self.at is not None or self.at_step is not None
        if len(given) != 1:
            key = given[1] if len(given) > 1 else "at"
            problems.append(((key,), "expected exactly one timing of at, at_step, every, "
                             "random; given " + (" and ".join(given) or "none"), NOTHING))
        if once and self.start is not None:
            problems.append((("start",), f"expected no start with {given[0]} (it is the time)",
                             self.start))
        if once and self.count is not None and self.count.max not in (None, 1):
            problems.append((("count", "max"), f"expected 1: {given[0]} fires once",
                             self.count.max))
        if not once and given and (self.count is None or self.count.max is None):
            problems.append((("count", "max"), "required with every and random: a bound on "
                             "how many times it fires", NOTHING))
        if self.inject == "driver_kill" and self.at is None and given:
            problems.append((("at",), "required for driver_kill: one kill, then --resume",
                             NOTHING))
        during = self.params.get("during")
        if during is not None and self.inject in INJECT_DOMAINS:
            phases = PHASES[_domain_of(self.target)]
            if during not in phases:
                problems.append((("params", "during"), f"expected a phase of that domain, one "
                                 f"of {', '.join(phases)}", during))
        if (self.params.get("process") == "checkpoint_writer"
                and _domain_of(self.target) != "learner"):
            problems.append((("params", "process"), "expected a learner rank as the target: "
                             "only learner ranks have a checkpoint writer", "checkpoint_writer"))
        if self.params.get("scope") == "env" and self.at != 0:
            problems.append((("at",), "expected 0: scope env arms every process from its "
                             "start", self.at if self.at is not None else NOTHING))
        if problems:
            raise invalid(problems)
        return self

    @property
    def domain(self) -> str:
        """The fault domain hit: a tree domain, ``node`` or ``driver``."""
        match self.inject:
            case "node_loss":
                return "node"
            case "driver_kill":
                return "driver"
            case "user_error":
                return PLUGINS[self.target]
            case "failpoint":
                where = self.params.get("in")
                if where is not None:
                    return "rollout" if where == "driver" else _domain_of(where)
                return _failpoint_domain(self.target)
        return _domain_of(self.target)

    def failpoint_spec(self) -> FailpointSpec:
        """The :class:`FailpointSpec` of a ``failpoint`` fault."""
        if self.inject != "failpoint":
            raise ValueError(f"a {self.inject} fault has no failpoint spec")
        return FailpointSpec.from_dict(self.params["spec"])


class Scenario(_Model):
    """One chaos scenario, validated whole (see the module docstring)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="defaults to the file's stem")
    description: str = Field(min_length=1)
    config: str = Field(description="job config, relative to the repository root or absolute")
    overrides: tuple[str, ...] = Field((), description="key.sub=value for the job config")
    duration_s: float = Field(gt=0, description="hard bound: the job is stopped after it")
    faults: tuple[FaultSpec, ...]
    invariants: tuple[Invariant, ...] = INVARIANTS  # type: ignore[assignment]
    reward_tolerance: float = Field(0.15, ge=0, description="allowed final-reward gap to "
                                    "the fault-free baseline")
    min_judged_share: float = Field(0.95, gt=0, le=1, description="samples_judged: the share "
                                    "of samples that must still be judged")
    expect: Literal["finished", "escalation"] = "finished"
    offender: str | None = Field(None, min_length=1, description="glob the escalation's "
                                 "offender must match")
    baselines: tuple[Baseline, ...] = ()
    multinode: MultiNode | None = None
    smoke: bool = Field(False, description="part of the CI smoke subset")

    @field_validator("config")
    @classmethod
    def _config_exists(cls, value: str) -> str:
        path = resolve_config(value)
        if not path.is_file():
            raise ValueError(f"expected an existing job config file (relative to {REPO_ROOT} "
                             f"or absolute); {path} does not exist")
        return value

    @field_validator("overrides")
    @classmethod
    def _overrides_apply(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        config = info.data.get("config")
        if config is None:
            return value
        try:
            load_config(resolve_config(config))
        except ConfigError as exc:  # the file itself: reported here, as config is a path
            raise ValueError(f"the job config {config} is invalid: {one_line(exc)}") from None
        try:
            load_config(resolve_config(config), value)
        except ConfigError as exc:
            raise ValueError(f"expected overrides the job config accepts: {one_line(exc)}"
                             ) from None
        return value

    @field_validator("faults")
    @classmethod
    def _some_faults(cls, value: tuple[FaultSpec, ...]) -> tuple[FaultSpec, ...]:
        # Here, not min_length: that would also complain whenever one fault is invalid.
        if not value:
            raise ValueError("expected at least one fault")
        return value

    @field_validator("invariants", "baselines")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        twice = sorted({v for v in value if value.count(v) > 1})
        if twice:
            raise ValueError(f"expected each name once; repeated: {', '.join(twice)}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> Scenario:
        problems: list[Problem] = []
        paths = job_tree_paths(self.job_config(), self.multinode.nodes if self.multinode else 1)
        workers = [f"worker-{k}" for k in range(1, self.multinode.nodes if self.multinode else 1)]
        for i, fault in enumerate(self.faults):
            problems += [(("faults", i, *loc), text, given)
                         for loc, text, given in _fault_sites(fault, paths, workers)]
        escalating = [i for i, f in enumerate(self.faults) if f.expect == "escalation"]
        if self.expect == "escalation" and not escalating:
            problems.append((("expect",), "expected a fault with expect: escalation when the "
                             "scenario expects one", self.expect))
        if self.expect == "finished" and escalating:
            problems.append((("faults", escalating[0], "expect"), "expected no escalation in a "
                             "scenario that expects finished (an escalation ends the job)",
                             "escalation"))
        if self.smoke and self.duration_s > SMOKE_MAX_DURATION_S:
            problems.append((("duration_s",), f"expected at most {SMOKE_MAX_DURATION_S:g} s "
                             "for a smoke scenario (the CI smoke budget)", self.duration_s))
        if self.offender is not None and self.expect != "escalation":
            problems.append((("offender",), "expected only with expect: escalation",
                             self.offender))
        kills = [i for i, f in enumerate(self.faults) if f.inject == "driver_kill"]
        if kills and len(self.faults) > 1:
            problems.append((("faults", kills[0], "inject"), "expected driver_kill as the "
                             "only fault: the job then runs as a subprocess the runner "
                             "cannot inject into", "driver_kill"))
        problems += [(("faults", i, *loc), text, given)
                     for i, loc, text, given in schedule_problems(self.faults, self.duration_s)]
        steps = self.job_config().run.steps
        problems += [(("faults", i, "at_step"), f"expected fewer than run.steps ({steps}): "
                      "the job ends at its last step", f.at_step)
                     for i, f in enumerate(self.faults) if (f.at_step or 0) >= steps]
        if problems:
            raise invalid(problems)
        return self

    @property
    def config_path(self) -> Path:
        """The job config file, resolved."""
        return resolve_config(self.config)

    def job_config(self) -> JobConfig:
        """The job config with the scenario's overrides applied (validated at load)."""
        return load_config(self.config_path, self.overrides)

    def schedule(self) -> list[tuple[float, int]]:
        """:func:`schedule` of this scenario's timed faults within its duration."""
        return schedule(self.faults, self.duration_s)

    def step_schedule(self) -> list[tuple[int, int]]:
        """``(RL step, fault index)`` of the faults timed by ``at_step``, in step order."""
        return sorted((f.at_step, i) for i, f in enumerate(self.faults) if f.at_step)


# ---------------------------------------------------------------------- the tree
def resolve_config(config: str | Path) -> Path:
    """A scenario's job config path: absolute as given, else under the repository root."""
    path = Path(config)
    return path if path.is_absolute() else REPO_ROOT / path


def job_tree_paths(job: JobConfig, nodes: int = 1) -> list[str]:
    """The paths of the children a fault may hit, as ``actors/job.py`` builds the tree:
    learner ranks, engines, one sandbox, one judge and one environment host per node, and
    the coordinator."""
    return ([f"{ROOT}/learner/learner-{r}" for r in range(job.learner.num_ranks)]
            + [f"{ROOT}/generation/engine-{i}" for i in range(job.engine.num_engines)]
            + [f"{ROOT}/{d}/host@node-{i}" for d in ("sandbox", "judge", "environment")
               for i in range(nodes)]
            + [f"{ROOT}/rollout/coordinator"])


def _domain_of(path: str) -> str:
    parts = path.split("/")
    return parts[1] if len(parts) > 1 else path


def _failpoint_domain(name: str) -> str:
    """Where failpoint ``name``'s code runs when no ``in`` says: its prefix names the domain
    (``judge.score``), except ``host.spawn``, in every host, for which it is the sandbox."""
    prefix = name.split(".")[0]
    return prefix if prefix in ("generation", "sandbox", "judge", "learner", "rollout",
                                "environment") else "sandbox"


def _check_tree_path(value: str, domains: tuple[str, ...]) -> None:
    match = _TREE_PATH.match(value)
    if match is None or match.group(1) not in domains:
        raise ValueError(f"expected a child of {' or '.join(f'{ROOT}/{d}' for d in domains)}, "
                         f"like {ROOT}/{domains[0]}/<child or glob>")


def _check_failpoint_site(where: str, name: str) -> None:
    """``params.in`` must be a tree path of the domain whose code has the failpoint."""
    if where == "driver":
        if _failpoint_domain(name) != "rollout":
            raise invalid([(("in",), f"expected a tree path: {name} does not run in the "
                             "driver", where)])
        return
    domain = _failpoint_domain(name)
    allowed = ("sandbox", "judge", "environment") if name == "host.spawn" else (domain,)
    if domain == "rollout":
        raise invalid([(("in",), "expected 'driver' or nothing: the coordinator runs in the "
                         "driver process", where)])
    try:
        _check_tree_path(where, allowed)
    except ValueError as exc:
        raise invalid([(("in",), f"{exc} (where {name} runs)", where)]) from None


def _fault_sites(fault: FaultSpec, paths: list[str], workers: list[str]
                 ) -> list[Problem]:
    """Problems with where ``fault`` lands in this job's tree, by key under the fault."""
    def matches(pattern: str, among: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(p, pattern) for p in among)

    match fault.inject:
        case "node_loss":
            if not workers:
                return [(("inject",), "expected multinode: {nodes: >= 2} for node_loss",
                         fault.inject)]
            if not matches(fault.target, workers):
                return [(("target",), f"expected one of {', '.join(workers)}", fault.target)]
        case "driver_kill" | "user_error":
            pass
        case "failpoint":
            where = fault.params.get("in")
            if where not in (None, "driver") and not matches(where, paths):
                return [(("params", "in"), f"expected a child of the job's tree, one of "
                         f"{', '.join(paths)}", where)]
        case _:
            if not matches(fault.target, paths):
                return [(("target",), f"expected a child of the job's tree, one of "
                         f"{', '.join(paths)}", fault.target)]
    return []


# --------------------------------------------------------------------- loading
def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load and validate a scenario: a path to a YAML file, or a bare name looked up as
    ``configs/chaos/<name>.yaml``.  Raises :class:`ScenarioError` for any problem."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        if not path.is_file():
            raise ScenarioError(f"scenario file not found: {path}")
    else:
        path = SCENARIO_DIR / f"{text}.yaml"
        if not path.is_file():
            known = [p.stem for p in sorted(SCENARIO_DIR.glob("*.yaml"))]
            raise ScenarioError(f"unknown chaos scenario {text!r}{did_you_mean(text, known)}; "
                                f"known: {', '.join(known)}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a mapping of scenario keys, given "
                            f"{type(data).__name__}")
    data.setdefault("name", path.stem)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = [describe(err, lambda loc: type_at(Scenario, loc, data, _params_type))
                 for err in exc.errors()]
        raise ScenarioError(f"{path}: invalid chaos scenario:\n  " + "\n  ".join(lines),
                            lines) from None


def list_scenarios(directory: Path = SCENARIO_DIR) -> list[tuple[str, str, bool]]:
    """``(name, description, smoke)`` of every scenario in ``directory``, by name; each is
    loaded, so an invalid one raises :class:`ScenarioError`."""
    scenarios = [load_scenario(path) for path in sorted(Path(directory).glob("*.yaml"))]
    return sorted((s.name, s.description, s.smoke) for s in scenarios)


def _params_type(model: type[BaseModel], name: str, raw: Any, annotation: Any) -> Any:
    """A fault's ``params`` are typed by its ``inject`` (for did-you-mean and expectations)."""
    if model is FaultSpec and name == "params":
        inject = raw.get("inject") if isinstance(raw, dict) else None
        return _PARAMS.get(inject) if isinstance(inject, str) else None
    return annotation
