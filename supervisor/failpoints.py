"""Named failpoints: faults the chaos suite injects at fixed places in erlay's own code.

A failpoint is a one-line call, ``failpoint("sandbox.exec")`` in sync code or
``await afailpoint("generation.decode_step")`` in coroutines, at a place where a real fault
would strike.  Nothing happens there until the name is *armed* in that process with a
:class:`FailpointSpec`; then, each time the rules say so, it performs its action:

- ``raise``: raises :class:`FailpointError` naming the failpoint (a crash of the caller);
- ``hang``: blocks until the name is disarmed, or forever (a wedged component);
- ``delay``: sleeps ``delay_s`` and continues (a slow component);
- ``freeze``: holds the GIL for ``delay_s`` in C code that never yields, as a catastrophic
  regex or a C extension's loop does: every thread of the process stops, the event loop and
  a watchdog thread included, and no signal handler runs (the process is still alive and
  "running" to the OS); the same in sync and async code;
- ``exit``: ``os._exit(exit_code)``, the process dies at once, as in a crash.

Rules, all optional and combinable: ``nth=N`` fires on the N-th hit only (1-based);
``count=K`` fires at most K times; ``probability=p`` fires with probability p, drawn from a
``random.Random(seed)`` of its own, so a seeded run fires on the same hits every time.  They
are checked in that order, and the random draw is made only for hits that pass ``nth`` and
``count``, so the draws do not depend on hits that could not fire anyway.

Contracts:

- **Disarmed costs nothing measurable.**  ``failpoint`` returns after one falsy check of the
  module-level ``_ARMED`` dict (``bench/failpoints.py`` measures it), and nothing is read
  lazily on that path: the environment is parsed once, at import.
- **Per process.**  Arming acts in the calling process only.  Everything in one process shares
  it: a node host and all of its in-process children.  Other processes are armed through
  ``ERLAY_FAILPOINTS`` at their start or remotely through a supervised actor's
  ``_erlay_failpoints`` method (see :func:`control`).
- **Start-up arming.**  ``ERLAY_FAILPOINTS`` holds JSON ``{name: spec_dict}`` (build it with
  :func:`env_value`) and is applied when this module is imported, so a process started with it
  is armed before it runs any failpoint: that is how a child that fails at every start is made.
  A malformed value raises ``ValueError`` at import: a chaos run must not silently run without
  its faults.
- **Hits** are counted only while a name is armed, from its latest :func:`arm`; the counts
  stay readable after :func:`disarm` until the name is armed again.
- **Async hang** (:func:`afailpoint`) sleeps in the calling task, so the work that task does
  stops making progress while the rest of the event loop (progress polls, the monitor, other
  requests) keeps running: exactly a wedged engine whose health endpoint still answers, which
  hang detection must catch by progress.  A sync hang blocks the calling thread.
- Names must be in :data:`KNOWN` unless ``allow_unknown=True`` (tests of user code), so a
  typo in a chaos scenario fails when it is armed instead of never firing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, cast

from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.failpoints")

ENV_VAR = "ERLAY_FAILPOINTS"
KNOWN = ("generation.decode_step", "generation.weight_update", "sandbox.exec", "judge.score",
         "judge.verdict", "learner.train_step", "learner.checkpoint", "rollout.dispatch",
         "rollout.after_train",
         "host.spawn",
         # The stages of a checkpoint (actors/learner/checkpoint/): the snapshot
         # (snapshot.py), the worker's write and fsync (format.py), the commit (commit.py)
         # and retention (__init__.py).
         "learner.checkpoint_snapshot", "learner.checkpoint_write", "learner.checkpoint_fsync",
         "learner.checkpoint_before_swap", "learner.checkpoint_mid_swap",
         "learner.checkpoint_after_swap", "learner.checkpoint_before_cleanup",
         "learner.checkpoint_retire",
         # A sharded checkpoint (actors/learner/checkpoint/sharded.py): every rank's shard
         # is written, rank 0 has not written the manifest yet.
         "learner.checkpoint_manifest",
         # Faults of user code, fired where erlay calls it, inside its guard: raise is the
         # user's exception, hang the user's hang, corrupt a bad return.
         "environment.call", "judge.user_code",
         # The LLM judge's engine, after each token it decodes (judges/llm.py).
         "judge.llm_generate",
         # The tool code itself hangs (corrupt: the sandbox runs a sleep in its place, until
         # the run's wall deadline); a prompt whose completion runs long (keyed by the
         # rollout's seed: the engine ignores its stop tokens to the end of its budget).
         "sandbox.user_code", "generation.long_tail")
# How often an async hang looks whether it was released.  Disarm may come from any thread
# (a threaded actor's control group), so the hang polls a threading.Event instead of
# awaiting a future bound to one loop.
_HANG_POLL_S = 0.01


class FailpointError(ErlayError):
    """Raised by an armed ``raise`` failpoint; ``name`` is the failpoint.

    Built as ``FailpointError(name)`` with no custom ``__init__``, so it pickles through
    Ray's error transport like any exception with plain args.
    """

    @property
    def name(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return f"failpoint {self.name} fired"


class Action(StrEnum):
    """What an armed failpoint does when it fires."""

    RAISE = "raise"
    HANG = "hang"
    DELAY = "delay"
    EXIT = "exit"
    CORRUPT = "corrupt"  # the call returns True; the call site corrupts its own result
    FREEZE = "freeze"    # holds the GIL for delay_s: the whole process stops


def _field_error(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class FailpointSpec:
    """How an armed failpoint behaves: its action and the rules that say when it fires.

    Validated at construction; a bad field raises ``ValueError`` naming it.
    """

    action: Action
    probability: float | None = None
    count: int | None = None
    nth: int | None = None
    delay_s: float = 0.0
    exit_code: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "action", Action(self.action))
        except ValueError:
            raise _field_error("action", f"one of {', '.join(a.value for a in Action)}",
                               self.action) from None
        p = self.probability
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float)
                              or not 0.0 <= p <= 1.0):
            raise _field_error("probability", "a number in [0, 1]", p)
        for name in ("count", "nth"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise _field_error(name, "an integer >= 1", value)
        d = self.delay_s
        if isinstance(d, bool) or not isinstance(d, int | float) or d < 0:
            raise _field_error("delay_s", "a number >= 0", d)
        if not _is_int(self.exit_code) or not 0 <= self.exit_code <= 255:
            raise _field_error("exit_code", "an integer in [0, 255]", self.exit_code)
        if self.seed is not None and not _is_int(self.seed):
            raise _field_error("seed", "an integer", self.seed)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["action"] = self.action.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailpointSpec:
        if not isinstance(data, Mapping):
            raise _field_error("spec", "a mapping", data)
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise _field_error("spec", f"only the fields {sorted(cls.__dataclass_fields__)}",
                               unknown)
        if "action" not in data:
            raise ValueError("action: missing")
        return cls(**data)


@dataclass
class _Armed:
    """One arming of one name: its spec, rng, counters and the event a hang waits on."""

    spec: FailpointSpec
    rng: random.Random
    hits: int = 0
    fired: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def decide(self) -> bool:
        """Count a hit and say whether it fires (called under ``_LOCK``)."""
        self.hits += 1
        spec = self.spec
        if spec.nth is not None and self.hits != spec.nth:
            return False
        if spec.count is not None and self.fired >= spec.count:
            return False
        if spec.probability is not None and self.rng.random() >= spec.probability:
            return False
        self.fired += 1
        return True


# The hot path reads only this dict; it is replaced, never mutated, so a reader in another
# thread sees either the old or the new arming, never a half-updated one.
_ARMED: dict[str, _Armed] = {}
_LAST: dict[str, _Armed] = {}  # the latest arming of every name, kept after disarm
_LOCK = threading.Lock()


# ---------------------------------------------------------------------------- hot path
def failpoint(name: str) -> bool:
    """The failpoint ``name`` in sync code: nothing unless armed in this process.

    When it fires: ``raise`` raises :class:`FailpointError`, ``hang`` blocks this thread until
    disarmed, ``delay`` sleeps, ``exit`` ends the process, and ``corrupt`` returns True (a
    call site that can produce garbage, such as a judge's verdict, then does).  Returns
    False otherwise.
    """
    if not _ARMED:
        return False
    armed = _ARMED.get(name)
    if armed is None or not _fires(name, armed):
        return False
    match armed.spec.action:
        case Action.CORRUPT:
            return True
        case Action.RAISE:
            raise FailpointError(name)
        case Action.HANG:
            armed.released.wait()
        case Action.DELAY:
            time.sleep(armed.spec.delay_s)
        case Action.FREEZE:
            hold_gil(armed.spec.delay_s)
        case Action.EXIT:
            os._exit(armed.spec.exit_code)
    return False


def keyed(name: str, key: str) -> bool:
    """A ``corrupt`` failpoint decided by ``key`` instead of a draw: armed with
    ``probability=p`` (and ``seed``), a share ``p`` of the keys fire, the same keys on every
    hit and in every process, so a request retried or re-dispatched elsewhere meets the same
    fault (a prompt whose completion is long stays long).  Always fires without a
    probability; ``nth`` and ``count`` do not apply; other actions never fire here."""
    if not _ARMED:
        return False
    armed = _ARMED.get(name)
    if armed is None or armed.spec.action is not Action.CORRUPT:
        return False
    p = armed.spec.probability
    digest = hashlib.blake2b(f"{armed.spec.seed}:{key}".encode(), digest_size=8).digest()
    fire = p is None or int.from_bytes(digest, "big") / 2.0 ** 64 < p
    with _LOCK:
        armed.hits += 1
        armed.fired += fire
    return fire


# One chunk of hold_gil: a C loop of about a second here, during which no other thread of
# the process runs.  Between chunks the GIL may change hands for a few milliseconds.
_FREEZE_CHUNK = 30_000_000


def hold_gil(seconds: float) -> None:
    """Hold the GIL for ``seconds``, in C calls that never yield (``sum`` over a ``range``:
    no bytecode runs, so the interpreter never offers the GIL to another thread), one chunk
    of about a second after another."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(_FREEZE_CHUNK))


async def afailpoint(name: str) -> bool:
    """The failpoint ``name`` in a coroutine: as :func:`failpoint`, but ``hang`` and ``delay``
    sleep in the calling task only (see the module docstring), never blocking the loop."""
    if not _ARMED:
        return False
    armed = _ARMED.get(name)
    if armed is None or not _fires(name, armed):
        return False
    match armed.spec.action:
        case Action.CORRUPT:
            return True
        case Action.RAISE:
            raise FailpointError(name)
        case Action.HANG:
            while not armed.released.is_set():
                await asyncio.sleep(_HANG_POLL_S)
        case Action.DELAY:
            await asyncio.sleep(armed.spec.delay_s)
        case Action.FREEZE:
            hold_gil(armed.spec.delay_s)
        case Action.EXIT:
            os._exit(armed.spec.exit_code)
    return False


def _fires(name: str, armed: _Armed) -> bool:
    with _LOCK:
        fire = armed.decide()
        hit = armed.hits
    if fire:
        # Logged before acting: after an exit, this line is all that says why.
        log.warning("failpoint %s fired: %s (hit %d, pid %d)", name, armed.spec.action.value,
                    hit, os.getpid())
    return fire


# ------------------------------------------------------------------------- control
def _check_name(name: object, allow_unknown: bool = False) -> None:
    if not isinstance(name, str) or not name:
        raise _field_error("name", "a non-empty string", name)
    if name not in KNOWN and not allow_unknown:
        raise ValueError(f"name: unknown failpoint {name!r}; known: {', '.join(KNOWN)}")


def arm(name: str, action: Action | str, *, probability: float | None = None,
        count: int | None = None, nth: int | None = None, delay_s: float = 0.0,
        exit_code: int = 1, seed: int | None = None,
        allow_unknown: bool = False) -> FailpointSpec:
    """Arm ``name`` in this process (replacing an earlier arming, whose hangs are released);
    returns the validated spec.  Raises ``ValueError`` for a bad field or an unknown name."""
    # __post_init__ turns a str action into an Action, or raises naming the field.
    spec = FailpointSpec(cast(Action, action), probability=probability, count=count, nth=nth,
                         delay_s=delay_s, exit_code=exit_code, seed=seed)
    return arm_spec(name, spec, allow_unknown=allow_unknown)


def arm_spec(name: str, spec: FailpointSpec, *, allow_unknown: bool = False) -> FailpointSpec:
    """Arm ``name`` with a ready spec; see :func:`arm`."""
    global _ARMED
    _check_name(name, allow_unknown)
    armed = _Armed(spec, random.Random(spec.seed))
    with _LOCK:
        previous = _ARMED.get(name)
        _ARMED = {**_ARMED, name: armed}
        _LAST[name] = armed
    if previous is not None:
        previous.released.set()
    return spec


def disarm(name: str) -> bool:
    """Disarm ``name`` and release whatever hangs in it; False if it was not armed."""
    global _ARMED
    with _LOCK:
        armed = _ARMED.get(name)
        if armed is not None:
            _ARMED = {k: v for k, v in _ARMED.items() if k != name}
    if armed is None:
        return False
    armed.released.set()
    return True


def disarm_all() -> None:
    """Disarm every failpoint in this process and release every hang."""
    global _ARMED
    with _LOCK:
        previous, _ARMED = _ARMED, {}
    for armed in previous.values():
        armed.released.set()


def armed() -> dict[str, FailpointSpec]:
    """The failpoints armed in this process, by name."""
    return {name: a.spec for name, a in _ARMED.items()}


def hits(name: str) -> int:
    """Calls of ``name`` while armed, since its latest :func:`arm` (0 if never armed)."""
    last = _LAST.get(name)
    return last.hits if last is not None else 0


def fired(name: str) -> int:
    """How many of those calls fired."""
    last = _LAST.get(name)
    return last.fired if last is not None else 0


def report() -> dict[str, Any]:
    """What :func:`control` answers: ``armed`` (name -> spec dict), ``hits`` and ``fired``
    (name -> count, for every name armed since this process started) and ``pid``."""
    return {"armed": {name: spec.to_dict() for name, spec in armed().items()},
            "hits": {name: a.hits for name, a in _LAST.items()},
            "fired": {name: a.fired for name, a in _LAST.items()},
            "pid": os.getpid()}


def control(op: str, name: str | None = None, spec: Mapping[str, Any] | None = None
            ) -> dict[str, Any]:
    """Apply one remote-control operation in this process and return :func:`report`.

    ``op`` is ``arm`` (needs ``name`` and ``spec``, a :meth:`FailpointSpec.to_dict`),
    ``disarm`` (needs ``name``), ``disarm_all`` or ``list``.  This is what a supervised
    actor's ``_erlay_failpoints`` runs; it never blocks.
    """
    match op:
        case "arm":
            if name is None or spec is None:
                raise ValueError("arm: expected a name and a spec")
            arm_spec(name, FailpointSpec.from_dict(spec))
        case "disarm":
            if name is None:
                raise ValueError("disarm: expected a name")
            disarm(name)
        case "disarm_all":
            disarm_all()
        case "list":
            pass
        case _:
            raise _field_error("op", "one of arm, disarm, disarm_all, list", op)
    return report()


# ---------------------------------------------------------------------- environment
def env_value(specs: Mapping[str, FailpointSpec | Mapping[str, Any]]) -> str:
    """The ``ERLAY_FAILPOINTS`` value that arms ``specs`` (name -> spec) at process start.

    Every spec is validated here, so a bad one fails where the scenario is written."""
    out = {}
    for name, spec in specs.items():
        _check_name(name)
        parsed = spec if isinstance(spec, FailpointSpec) else FailpointSpec.from_dict(spec)
        out[name] = parsed.to_dict()
    return json.dumps(out, sort_keys=True)


def load_env(value: str | None = None) -> dict[str, FailpointSpec]:
    """Arm what ``value`` (default: ``$ERLAY_FAILPOINTS``) names; returns what it armed.

    Runs once at import; call it again only to re-read the variable.  Raises ``ValueError``
    naming ``ERLAY_FAILPOINTS`` for a value that is not a JSON object of valid specs.
    """
    text = os.environ.get(ENV_VAR, "") if value is None else value
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise _field_error(ENV_VAR, "a JSON object {name: spec}", data)
        specs = {name: FailpointSpec.from_dict(spec) for name, spec in data.items()}
        for name in specs:  # all checked before any is armed
            _check_name(name)
        for name, spec in specs.items():
            arm_spec(name, spec)
    except ValueError as exc:  # json.JSONDecodeError is one too
        raise ValueError(f"{ENV_VAR}: {exc}") from None
    return specs


load_env()
