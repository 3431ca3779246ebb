"""One rooted, flat exception hierarchy for erlay.

Every error erlay raises on purpose derives from :class:`ErlayError`, so a top-level loop can
catch erlay's failures without swallowing programming errors.  The hierarchy stays flat: a
caller matches on the leaf it cares about.

"Dead" and "unavailable" are kept apart on purpose (see DESIGN.md): a dead child is gone and
will be restarted by its supervisor; an unavailable child may still be alive and is probed
before anyone acts on it.
"""

from __future__ import annotations

from typing import Any


class ErlayError(Exception):
    """Root of every error erlay raises deliberately."""


class InvalidSpec(ErlayError):
    """A child spec or supervisor flags are malformed; raised at construction, before any start.

    ``field`` names the offending field and ``value`` what was given, so the message can say
    what was expected and what arrived.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}: expected {expected}, got {value!r}")


class ChildStartError(ErlayError):
    """Starting a child failed.  ``child`` is the child's tree path."""

    def __init__(self, child: str, reason: str) -> None:
        self.child = child
        self.reason = reason
        super().__init__(f"failed to start child {child}: {reason}")


class SupervisorCallError(ErlayError):
    """A dynamic-API call was refused, with OTP's error atom in ``reason``.

    ``reason`` is one of: ``not_found``, ``running``, ``restarting``, ``already_present``,
    ``already_started``, ``simple_one_for_one``, ``not_simple_one_for_one``, ``terminated``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SupervisorFailed(ErlayError):
    """A supervisor (usually the root) terminated because a subtree could not be kept alive.

    ``offender`` is the tree path of the leaf child whose failures started the escalation and
    ``chain`` the supervisors the failure climbed through, innermost first.
    """

    def __init__(self, supervisor: str, message: str, offender: str | None,
                 chain: tuple[str, ...] = ()) -> None:
        self.supervisor = supervisor
        self.offender = offender
        self.chain = chain
        super().__init__(message)


class ChildDead(ErlayError):
    """The child incarnation a call was addressed to has died (it may be restarting)."""


class ChildUnavailable(ErlayError):
    """The child could not be reached but is not known to be dead; it is being probed."""


class ChildNotRunning(ErlayError):
    """A call addressed a child that currently has no running incarnation."""


class TaskDeadlineExceeded(ErlayError):
    """Task work did not finish within its deadline on any of its attempts."""


class TaskFailed(ErlayError):
    """Task work failed and its retry budget is spent; ``attempts`` says how many ran."""

    def __init__(self, name: str, attempts: int, cause: str) -> None:
        self.name = name
        self.attempts = attempts
        self.cause = cause
        super().__init__(f"task {name} failed after {attempts} attempt(s): {cause}")


class CallDeadlineExceeded(ErlayError):
    """A call across fault domains got no answer within its deadline.  The callee may be
    hung: its supervisor's heartbeat and progress deadlines decide that; the caller treats
    the call as failed (retry elsewhere, or mark the sample)."""


class NumaBindError(ErlayError):
    """A process could not be bound to the CPUs of its GPU: the GPU is missing from the
    affinity map, or none of its CPUs is available here.  The message names both sets."""


class VersionMismatch(ErlayError):
    """The nodes of a job run different versions of the stack.  ``rows`` lists what differs
    (one row per package, node -> version, None where missing) and the message holds them as
    a node x package table."""

    def __init__(self, rows: list[Any], table: str) -> None:
        self.rows = rows
        self.table = table
        super().__init__(f"package versions differ across nodes:\n{table}")
