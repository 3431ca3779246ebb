"""Exit reasons: why a child (or a supervisor) stopped.

OTP distinguishes ``normal``, ``shutdown`` and ``{shutdown, Term}`` (all "normal" for a
transient child) from every other reason.  erlay keeps that split and names the abnormal
reasons it can observe on Ray: a crash (``error``), a kill (``killed``), a missed progress
deadline (``hang``) and a lost actor or node (``lost``).

A supervisor that gives up carries the child that tipped it over (``offender``) and that
child's own reason (``cause``), so an escalation that reaches the root still names the leaf
that started it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ExitKind(enum.Enum):
    NORMAL = "normal"
    SHUTDOWN = "shutdown"
    KILLED = "killed"
    ERROR = "error"
    HANG = "hang"
    LOST = "lost"


@dataclass(frozen=True)
class ExitReason:
    """Why an incarnation ended.  ``detail`` is free text (an exception, an exit code)."""

    kind: ExitKind
    detail: str = ""
    offender: str | None = None
    cause: ExitReason | None = None

    @property
    def is_normal(self) -> bool:
        """True for OTP's normal reasons: ``normal``, ``shutdown`` and ``{shutdown, Term}``."""
        return self.kind in (ExitKind.NORMAL, ExitKind.SHUTDOWN)

    @property
    def root_offender(self) -> str | None:
        """The deepest offender in the escalation chain: the leaf that started it."""
        reason: ExitReason | None = self
        found = None
        while reason is not None:
            if reason.offender is not None:
                found = reason.offender
            reason = reason.cause
        return found

    @property
    def chain(self) -> tuple[str, ...]:
        """Offenders from the outermost supervisor down to the leaf."""
        out: list[str] = []
        reason: ExitReason | None = self
        while reason is not None:
            if reason.offender is not None:
                out.append(reason.offender)
            reason = reason.cause
        return tuple(out)

    def __str__(self) -> str:
        text = self.kind.value if not self.detail else f"{self.kind.value}: {self.detail}"
        if self.offender:
            text += f" (offender {self.offender}"
            if self.cause is not None:
                text += f" <- {self.cause}"
            text += ")"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Plain data, so a reason can cross a Ray boundary or land in a JSON file."""
        return {"kind": self.kind.value, "detail": self.detail, "offender": self.offender,
                "cause": self.cause.to_dict() if self.cause else None}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ExitReason:
        cause = data.get("cause")
        return ExitReason(ExitKind(data["kind"]), data.get("detail", ""), data.get("offender"),
                          ExitReason.from_dict(cause) if cause else None)


NORMAL = ExitReason(ExitKind.NORMAL)
SHUTDOWN = ExitReason(ExitKind.SHUTDOWN)
KILLED = ExitReason(ExitKind.KILLED)


def error(detail: str) -> ExitReason:
    return ExitReason(ExitKind.ERROR, detail)


def from_exception(exc: BaseException) -> ExitReason:
    return ExitReason(ExitKind.ERROR, f"{type(exc).__name__}: {exc}")
