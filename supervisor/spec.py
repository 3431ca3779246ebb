"""Child specs and supervisor flags, validated at construction as OTP's ``check_childspec`` does.

A bad spec raises :class:`~erlay.supervisor.errors.InvalidSpec` naming the field, what was expected
and what was given, before anything starts.  Strings are accepted wherever an enum is expected
(``restart="transient"``) so specs can come straight from YAML.

Deviations from OTP, all deliberate:

- ``period`` and shutdown timeouts are seconds and may be fractional; OTP uses integer seconds
  and milliseconds respectively.  Tests run the same semantics at a smaller time scale.
- A start function cannot return ``ignore``.  A child that should not run is not specified.
- ``modules`` (release handling) has no meaning here and does not exist.
- ``deadlines`` and ``progress_poll_s`` are erlay additions: per-phase progress deadlines used
  for hang detection (see :mod:`erlay.supervisor.health`).
- ``liveness`` is an erlay addition too: a heartbeat the supervisor sends every child, which
  finds a child that stops answering (SIGSTOP, a blocked event loop, a frozen host) whatever
  work it holds.
- ``restart_delay_s`` is an erlay addition (Akka's backoff supervisor has its like): a child's
  restart after an exit starts that many seconds late, so that the work the child's failure
  moved elsewhere (an engine's rollouts, failing over) does not compete with its replacement's
  start-up.  The restart is counted toward the intensity at the exit, as in OTP.  Only under
  one_for_one and simple_one_for_one, which restart the child alone.

Example: a spec is data, checked when made, before anything starts::

    >>> flags = SupervisorFlags("one_for_all", intensity=3, period=10)
    >>> flags.strategy
    <Strategy.ONE_FOR_ALL: 'one_for_all'>
    >>> ChildSpec("engine-0", InProcessStart(dict), restart="transient").restart
    <Restart.TRANSIENT: 'transient'>
    >>> SupervisorFlags(intensity=-1)
    Traceback (most recent call last):
    ...
    erlay.supervisor.errors.InvalidSpec: intensity: expected an integer >= 0, got -1
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from erlay.supervisor.errors import InvalidSpec
from erlay.supervisor.naming import child_path


class Restart(enum.Enum):
    """When a terminated child is restarted (OTP's restart type)."""

    PERMANENT = "permanent"  # always
    TRANSIENT = "transient"  # only after an abnormal exit
    TEMPORARY = "temporary"  # never, not even when a sibling's restart terminated it


class ChildType(enum.Enum):
    WORKER = "worker"
    SUPERVISOR = "supervisor"


class Strategy(enum.Enum):
    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"
    SIMPLE_ONE_FOR_ONE = "simple_one_for_one"


class AutoShutdown(enum.Enum):
    NEVER = "never"
    ANY_SIGNIFICANT = "any_significant"
    ALL_SIGNIFICANT = "all_significant"


class ShutdownKind(enum.Enum):
    BRUTAL_KILL = "brutal_kill"
    TIMEOUT = "timeout"
    INFINITY = "infinity"


@dataclass(frozen=True)
class Shutdown:
    """How a child is stopped: kill at once, ask then kill after ``timeout_s``, or ask and wait."""

    kind: ShutdownKind
    timeout_s: float = math.inf

    @staticmethod
    def parse(value: Shutdown | str | float | int) -> Shutdown:
        """Accept ``"brutal_kill"``, ``"infinity"``, a number of seconds, or a Shutdown."""
        if isinstance(value, Shutdown):
            return value
        if value == "brutal_kill":
            return Shutdown(ShutdownKind.BRUTAL_KILL, 0.0)
        if value == "infinity":
            return Shutdown(ShutdownKind.INFINITY, math.inf)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return Shutdown(ShutdownKind.TIMEOUT, float(value))
        raise InvalidSpec("shutdown", value,
                          '"brutal_kill", "infinity" or a number of seconds >= 0')


BRUTAL_KILL = Shutdown(ShutdownKind.BRUTAL_KILL, 0.0)
INFINITY = Shutdown(ShutdownKind.INFINITY, math.inf)


def _enum(cls: type[enum.Enum], name: str, value: object) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = " | ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise InvalidSpec(name, value, allowed) from None


class StartSpec:
    """Marker base for the ways a child can be started; the shell interprets each kind."""


@dataclass(frozen=True)
class ActorStart(StartSpec):
    """A dedicated Ray actor: ``cls`` is a plain class, wrapped and made remote by the shell.

    ``options`` go to ``.options()``.  ``max_restarts`` must stay 0 because the supervisor owns
    restarts; ``num_cpus`` defaults to 0 so supervised actors never starve the job of CPUs.
    ``ready_timeout_s`` bounds the constructor plus ``erlay_ready`` (None: the starter's
    default); a child that loads a large engine sets it, and running past it is a start
    failure, which counts against the restart intensity like any other.

    ``boot_ahead`` (a deviation from OTP, off by default): when the *tree* boots, the actor is
    created and asked for ``erlay_ready`` at once, so its constructor and ready hook (a new
    process importing torch, loading a model, starting an engine) run beside its elder
    siblings' instead of after them.  It still counts as started in order: its readiness is
    awaited, and the start reported, only after every child before it has started (its
    ``ready_timeout_s`` counts from then).  Set it only when the constructor and ready hook
    need nothing from the children started before it; a boot that fails first kills the
    actors created ahead.  Restarts never create ahead.

    ``spares`` (a deviation from OTP, 0 by default): keep that many actors of this spec
    built and ready beside the child, under its supervisor; a restart of any child of the
    supervisor with an equal spec adopts one instead of building a new actor, and the pool is
    refilled ``spare_delay_s`` later (:mod:`erlay.supervisor.spares`); the first spares are
    built ``spare_first_delay_s`` after the child's first start.  Only for a class that
    does not need its tree path (``_erlay_wants_path``: a spare does not know which child it
    will serve) and a child started without dynamic arguments.
    """

    cls: type
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    ready_timeout_s: float | None = None
    boot_ahead: bool = False
    spares: int = 0
    spare_delay_s: float = 0.0
    spare_first_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.cls, type):
            raise InvalidSpec("start.cls", self.cls, "a class")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) \
                or self.spares < 0:
            raise InvalidSpec("start.spares", self.spares, "an integer >= 0")
        if self.spares and getattr(self.cls, "_erlay_wants_path", False):
            raise InvalidSpec("start.spares", self.spares,
                              "0 for a class that needs its tree path (a host)")
        for name in ("spare_delay_s", "spare_first_delay_s"):
            if not getattr(self, name) >= 0:
                raise InvalidSpec(f"start.{name}", getattr(self, name), "seconds >= 0")
        if self.ready_timeout_s is not None and not self.ready_timeout_s > 0:
            raise InvalidSpec("start.ready_timeout_s", self.ready_timeout_s, "a number > 0")
        if self.options.get("max_restarts", 0) != 0:
            raise InvalidSpec("start.options.max_restarts", self.options["max_restarts"],
                              "0 (the supervisor owns restarts, not Ray)")


@dataclass(frozen=True)
class InProcessStart(StartSpec):
    """An object created inside the hosting process by ``factory(*args, **kwargs)``.

    ``factory`` is a callable or a ``"module:attr"`` import path.  See
    :mod:`erlay.supervisor.hosted` for the object's contract.
    """

    factory: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.factory, str):
            if ":" not in self.factory:
                raise InvalidSpec("start.factory", self.factory, '"module:attr" or a callable')
        elif not callable(self.factory):
            raise InvalidSpec("start.factory", self.factory, '"module:attr" or a callable')


@dataclass(frozen=True)
class SubprocessStart(StartSpec):
    """A subprocess in its own session and process group.

    With ``wait_ready`` the child is started only once it writes a line to the file descriptor
    named by the ``ERLAY_READY_FD`` environment variable, within ``ready_timeout_s``.
    ``env`` is added to the forwarded environment of the hosting process.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    wait_ready: bool = False
    ready_timeout_s: float = 10.0
    log_path: str | None = None

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise InvalidSpec("start.argv", self.argv, "a non-empty tuple of strings")
        if self.ready_timeout_s <= 0:
            raise InvalidSpec("start.ready_timeout_s", self.ready_timeout_s, "a number > 0")


@dataclass(frozen=True)
class WorkerStart(StartSpec):
    """A worker process (:mod:`erlay.supervisor.worker_process`): ``factory(*args, **kwargs)``
    built in a subprocess of its own, which serves calls one at a time.

    ``factory`` is a ``"module:attr"`` path, imported inside the subprocess, so the hosting
    process never imports the code it runs.  ``call_timeout_s`` is a call's deadline unless
    the caller gives one; ``ready_timeout_s`` bounds the process's start, the object's
    construction included.  ``env`` is added to the host's forwarded environment.
    """

    factory: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    call_timeout_s: float = 10.0
    ready_timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or ":" not in self.factory:
            raise InvalidSpec("start.factory", self.factory, '"module:attr"')
        for name in ("call_timeout_s", "ready_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value > 0:
                raise InvalidSpec(f"start.{name}", value, "a number of seconds > 0")


@dataclass(frozen=True)
class SupervisorFlags:
    """OTP's supervisor flags.  Defaults are OTP's: one_for_one, 1 restart in 5 seconds."""

    strategy: Strategy | str = Strategy.ONE_FOR_ONE
    intensity: int = 1
    period: float = 5.0
    auto_shutdown: AutoShutdown | str = AutoShutdown.NEVER

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _enum(Strategy, "strategy", self.strategy))
        object.__setattr__(self, "auto_shutdown",
                           _enum(AutoShutdown, "auto_shutdown", self.auto_shutdown))
        if not isinstance(self.intensity, int) or isinstance(self.intensity, bool) \
                or self.intensity < 0:
            raise InvalidSpec("intensity", self.intensity, "an integer >= 0")
        if not isinstance(self.period, (int, float)) or isinstance(self.period, bool) \
                or not self.period > 0:
            raise InvalidSpec("period", self.period, "a number of seconds > 0")


@dataclass(frozen=True)
class Liveness:
    """A heartbeat: every ``period_s`` the supervisor asks the child for its progress, with
    ``period_s`` to answer; a child that has answered none for longer than
    ``period_s * misses`` is hung.

    The answer comes from erlay's own methods on the child (the actor's event loop or its
    monitor thread, the host's loop, the subprocess's run state), never from the user's
    class, so any child is covered: a frozen process (SIGSTOP), a blocked event loop, a
    process wedged in C code holding the GIL.  Detection takes more than
    ``period_s * (misses - 1)`` and at most ``period_s * (misses + 1)`` after the child froze
    (the silence counts from its last answer), plus the supervisor loop's lateness
    (``bench/supervision.py``'s ``frozen_detect_ms``).
    """

    period_s: float = 5.0
    misses: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.period_s, (int, float)) or isinstance(self.period_s, bool) \
                or not self.period_s > 0:
            raise InvalidSpec("liveness.period_s", self.period_s, "seconds > 0")
        if not isinstance(self.misses, int) or isinstance(self.misses, bool) or self.misses < 1:
            raise InvalidSpec("liveness.misses", self.misses, "an integer >= 1")

    @property
    def deadline_s(self) -> float:
        """Silence longer than this is a hang."""
        return self.period_s * self.misses


DEFAULT_LIVENESS = Liveness()


@dataclass(frozen=True)
class ChildSpec:
    """OTP's child spec plus erlay's progress deadlines and liveness heartbeat.

    ``shutdown`` defaults as in OTP: 5 s for a worker, infinity for a supervisor.  An
    ``infinity`` shutdown of an actor child lasts while the child keeps answering its
    heartbeat: a frozen child is killed once ``liveness`` says so, so a stop is bounded.
    ``deadlines`` maps a work phase (``"decode_step"``) to the seconds a child holding work
    in that phase may go without progress before it is declared hung and restarted.
    ``progress_poll_s`` defaults to a quarter of the tightest deadline (0.05 s to 10 s).
    ``liveness`` is the heartbeat (:class:`Liveness`, 5 s x 3 by default); None turns it off.
    ``restart_delay_s`` (an erlay addition, 0 by default) defers each restart of the child
    after an exit by that many seconds, during which the supervisor serves other events
    (one_for_one and simple_one_for_one only; see :mod:`erlay.supervisor.core`).
    """

    id: str
    start: StartSpec
    restart: Restart | str = Restart.PERMANENT
    shutdown: Shutdown | str | float | None = None
    type: ChildType | str = ChildType.WORKER
    significant: bool = False
    deadlines: Mapping[str, float] = field(default_factory=dict)
    progress_poll_s: float | None = None
    liveness: Liveness | None = DEFAULT_LIVENESS
    restart_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or "/" in self.id:
            raise InvalidSpec("id", self.id, "a non-empty string without '/'")
        if not isinstance(self.start, StartSpec):
            raise InvalidSpec(f"{self.id}.start", self.start,
                              "ActorStart, InProcessStart, SubprocessStart, WorkerStart or "
                              "SupervisorStart")
        object.__setattr__(self, "restart", _enum(Restart, f"{self.id}.restart", self.restart))
        object.__setattr__(self, "type", _enum(ChildType, f"{self.id}.type", self.type))
        if self.shutdown is None:
            default = INFINITY if self.type is ChildType.SUPERVISOR else Shutdown.parse(5.0)
            object.__setattr__(self, "shutdown", default)
        else:
            object.__setattr__(self, "shutdown", Shutdown.parse(self.shutdown))
        if not isinstance(self.significant, bool):
            raise InvalidSpec(f"{self.id}.significant", self.significant, "true or false")
        if self.significant and self.restart is Restart.PERMANENT:
            raise InvalidSpec(f"{self.id}.significant", True,
                              "false for a permanent child (OTP: bad_combination "
                              "[{restart, permanent}, {significant, true}])")
        if isinstance(self.start, SupervisorStart) and self.type is not ChildType.SUPERVISOR:
            raise InvalidSpec(f"{self.id}.type", self.type.value,  # type: ignore[union-attr]
                              '"supervisor" for a SupervisorStart child')
        for phase, seconds in self.deadlines.items():
            if not isinstance(seconds, (int, float)) or not seconds > 0:
                raise InvalidSpec(f"{self.id}.deadlines.{phase}", seconds, "seconds > 0")
        if self.progress_poll_s is None:
            # A quarter of the tightest deadline: a hang is found within 1.25 deadlines, and
            # a child with a 30 s deadline costs one progress call every 7.5 s.
            poll = min(self.deadlines.values()) / 4 if self.deadlines else 1.0
            object.__setattr__(self, "progress_poll_s", min(max(poll, 0.05), 10.0))
        elif not self.progress_poll_s > 0:
            raise InvalidSpec(f"{self.id}.progress_poll_s", self.progress_poll_s, "seconds > 0")
        if self.liveness is not None and not isinstance(self.liveness, Liveness):
            raise InvalidSpec(f"{self.id}.liveness", self.liveness, "a Liveness or None")
        delay = self.restart_delay_s
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) \
                or not math.isfinite(delay) or delay < 0:
            raise InvalidSpec(f"{self.id}.restart_delay_s", delay, "seconds >= 0")

    @property
    def poll_interval_s(self) -> float | None:
        """How often the supervisor polls this child (progress and heartbeat), or None when
        it has neither deadlines nor a heartbeat."""
        intervals = [self.progress_poll_s] if self.deadlines else []
        if self.liveness is not None:
            intervals.append(self.liveness.period_s)
        return min(intervals) if intervals else None  # type: ignore[type-var]

    @property
    def restart_type(self) -> Restart:
        return self.restart  # type: ignore[return-value]

    @property
    def child_type(self) -> ChildType:
        return self.type  # type: ignore[return-value]

    @property
    def shutdown_policy(self) -> Shutdown:
        return self.shutdown  # type: ignore[return-value]


@dataclass(frozen=True)
class SupervisorStart(StartSpec):
    """A nested supervisor run by the same runtime as its parent."""

    flags: SupervisorFlags
    children: tuple[ChildSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "children", tuple(self.children))
        validate_children(self.flags, self.children)


def boot_ahead_children(path: str, children: Sequence[ChildSpec]
                        ) -> list[tuple[str, ActorStart]]:
    """The ``(path, start)`` of every ``boot_ahead`` actor a boot of ``children`` under
    ``path`` starts, nested supervisors included, in start order.  The template of a
    simple_one_for_one supervisor is not started at boot, so it is never listed."""
    found: list[tuple[str, ActorStart]] = []
    for spec in children:
        child = child_path(path, spec.id)
        start = spec.start
        if isinstance(start, SupervisorStart):
            if start.flags.strategy is not Strategy.SIMPLE_ONE_FOR_ONE:
                found += boot_ahead_children(child, start.children)
        elif isinstance(start, ActorStart) and start.boot_ahead:
            found.append((child, start))
    return found


def validate_children(flags: SupervisorFlags, children: Sequence[ChildSpec]) -> None:
    """Check a start spec against its flags, as OTP's ``check_startspec`` does.

    Raises InvalidSpec for duplicate ids, a significant child under ``auto_shutdown=never``,
    a ``restart_delay_s`` under a strategy that restarts several children together, or a
    simple_one_for_one supervisor without exactly one template spec.
    """
    seen: set[str] = set()
    for spec in children:
        if not isinstance(spec, ChildSpec):
            raise InvalidSpec("children", spec, "ChildSpec instances")
        if spec.id in seen:
            raise InvalidSpec("children", spec.id, "unique child ids (duplicate_child_name)")
        seen.add(spec.id)
        validate_child(flags, spec)
    if flags.strategy is Strategy.SIMPLE_ONE_FOR_ONE and len(children) != 1:
        raise InvalidSpec("children", [c.id for c in children],
                          "exactly one template child spec for simple_one_for_one")


def validate_child(flags: SupervisorFlags, spec: ChildSpec) -> None:
    """The checks of one child spec against its supervisor's flags (validate_children's,
    and the dynamic ``start_child``'s)."""
    validate_significant(flags, spec)
    if spec.restart_delay_s and flags.strategy in (Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE):
        # Those strategies stop and start a group in one plan; a delay would hold the group.
        raise InvalidSpec(f"{spec.id}.restart_delay_s", spec.restart_delay_s,
                          "0 under one_for_all and rest_for_one (a delayed restart is "
                          "one_for_one's and simple_one_for_one's)")


def validate_significant(flags: SupervisorFlags, spec: ChildSpec) -> None:
    """OTP rejects a significant child under a supervisor whose auto_shutdown is never."""
    if spec.significant and flags.auto_shutdown is AutoShutdown.NEVER:
        raise InvalidSpec(f"{spec.id}.significant", True,
                          "false when the supervisor's auto_shutdown is never (OTP: "
                          "bad_combination [{auto_shutdown, never}, {significant, true}])")
