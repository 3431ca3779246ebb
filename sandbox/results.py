"""What goes into a sandbox run and what comes out: plain, serialisable values.

A :class:`SandboxRequest` crosses Ray as ``to_dict()`` and is rebuilt, validated, with
``from_dict``; a malformed one raises :class:`MalformedMessage` naming the field.  A
:class:`SandboxResult` always describes the run, whatever the code did: bad code is a result
with an :class:`Outcome`, never an exception.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from erlay.supervisor.errors import ErlayError

MAX_KEY_CHARS = 1024


class MalformedMessage(ErlayError, ValueError):
    """A request or result dict is malformed.  ``field`` names the offending field.

    It is a ValueError too, so callers that validate input generically catch it.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field}: expected {expected}, got {shown}")


class Outcome(enum.StrEnum):
    """How a run ended; exactly one applies (see :mod:`erlay.sandbox.classify`).  A StrEnum, so
    ``Outcome.OK == "ok"`` and it formats as its value."""

    OK = "ok"                      # exit code 0
    ERROR = "error"                # non-zero exit code (exception, sys.exit(n))
    TIMEOUT = "timeout"            # wall-clock timeout or CPU-seconds limit
    MEMORY = "memory"              # address-space limit hit (MemoryError / killed)
    FILE_SIZE = "file_size"        # RLIMIT_FSIZE (SIGXFSZ, or EFBIG when it is ignored)
    OUTPUT_LIMIT = "output_limit"  # output past the hard cap; the run was killed
    KILLED = "killed"              # died of another signal
    SPAWN_FAILED = "spawn_failed"  # the sandbox could not start the code (not the code's fault)
    POISON = "poison"              # the run's host died under it twice; not run again (the
                                   # caller's verdict, erlay.actors.job.domains.SandboxClient)


_MISSING = object()


def _field(data: Mapping[str, Any], name: str, kinds: tuple[type, ...], expected: str,
           default: Any = _MISSING) -> Any:
    value = data.get(name, default)
    if value is _MISSING:
        raise MalformedMessage(name, None, f"{expected} (required)")
    # bool is an int subclass, but a flag is never a count and a count never a flag.
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise MalformedMessage(name, value, expected)
    return value


def _reject_unknown(data: Mapping[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise MalformedMessage(f"{what}.{unknown[0]}", data[unknown[0]],
                               f"no such field (known: {', '.join(sorted(known))})")


@dataclass(frozen=True)
class SandboxRequest:
    """One run of ``code`` under an idempotency key.

    ``key`` identifies the run across retries (``"r-000042/tool-0"``): a worker that already
    ran it returns the stored result.  ``code`` runs as a file in a private scratch directory
    with ``python -I -S -B -u``.  ``timeout_s``, if given, replaces the limits' wall timeout
    for this run.
    """

    key: str
    code: str
    stdin: str = ""
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or len(self.key) > MAX_KEY_CHARS:
            raise MalformedMessage("key", self.key,
                                   f"a non-empty string of at most {MAX_KEY_CHARS} characters")
        if not isinstance(self.code, str):
            raise MalformedMessage("code", self.code, "a string of Python source")
        if not isinstance(self.stdin, str):
            raise MalformedMessage("stdin", self.stdin, "a string")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or t <= 0):
            raise MalformedMessage("timeout_s", t, "null or a finite number of seconds > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> SandboxRequest:
        """Rebuild a request; raises MalformedMessage naming the first bad field."""
        if not isinstance(data, Mapping):
            raise MalformedMessage("request", data, "a mapping with key and code")
        _reject_unknown(data, {"key", "code", "stdin", "timeout_s"}, "request")
        return SandboxRequest(key=_field(data, "key", (str,), "a non-empty string"),
                              code=_field(data, "code", (str,), "a string of Python source"),
                              stdin=_field(data, "stdin", (str,), "a string", ""),
                              timeout_s=data.get("timeout_s"))


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended and what it printed.

    ``stdout``/``stderr`` keep the head of each stream, up to the limits' output cap;
    ``*_truncated`` says whether more was written.  ``isolation`` names the isolation that
    was used (``"unshare(net,pid)+uid60000"``, ``"bwrap(net,pid)+uid60000"``,
    ``"rlimits-only"``).  ``detail`` is a human-readable reason (``"wall timeout 2 s"``).
    """

    key: str
    outcome: Outcome
    exit_code: int | None
    signal: str | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    isolation: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit code 0."""
        return self.outcome is Outcome.OK

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> SandboxResult:
        """Rebuild a result; raises MalformedMessage naming the first bad field."""
        if not isinstance(data, Mapping):
            raise MalformedMessage("result", data, "a mapping")
        try:
            outcome = Outcome(str(data.get("outcome")))
        except ValueError:
            raise MalformedMessage("outcome", data.get("outcome"),
                                   " | ".join(o.value for o in Outcome)) from None
        return SandboxResult(
            key=_field(data, "key", (str,), "a string"),
            outcome=outcome,
            exit_code=_field(data, "exit_code", (int, type(None)), "an integer or null"),
            signal=_field(data, "signal", (str, type(None)), "a signal name or null"),
            stdout=_field(data, "stdout", (str,), "a string"),
            stderr=_field(data, "stderr", (str,), "a string"),
            stdout_truncated=_field(data, "stdout_truncated", (bool,), "true or false"),
            stderr_truncated=_field(data, "stderr_truncated", (bool,), "true or false"),
            wall_s=float(_field(data, "wall_s", (int, float), "seconds")),
            isolation=_field(data, "isolation", (str,), "a string"),
            detail=_field(data, "detail", (str,), "a string", ""),
        )
