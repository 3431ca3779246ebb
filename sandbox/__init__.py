"""Isolated code execution, pooled per node in sandbox hosts.

Untrusted Python (model-written tool calls, code under test) runs in a subprocess with its own
session, process group, pid/mount/network namespaces where available, an unprivileged uid per
worker slot, rlimits, a wall-clock timeout and a private scratch directory.  Bad code is a
typed result, never a crashed worker.

- :func:`run_in_sandbox` runs one :class:`SandboxRequest` under :class:`SandboxLimits` and
  returns a :class:`SandboxResult` with an :class:`Outcome`.
- :class:`SandboxWorker` is the hosted child that serves ``execute`` calls, once per
  idempotency key.
- :func:`sandbox_host_children` builds the worker specs of one node's sandbox host.
"""

ERLAY_PACKAGE = "sandbox"  # marker checked by `erlay` to detect a shadowing distribution

from sandbox.limits import SandboxLimits  # noqa: E402 - the marker line stays first
from sandbox.pool import sandbox_host_children  # noqa: E402
from sandbox.results import (  # noqa: E402
    MalformedMessage,
    Outcome,
    SandboxRequest,
    SandboxResult,
)
from sandbox.runner import run_in_sandbox  # noqa: E402
from sandbox.worker import SandboxWorker  # noqa: E402

__all__ = [
    "MalformedMessage",
    "Outcome",
    "SandboxLimits",
    "SandboxRequest",
    "SandboxResult",
    "SandboxWorker",
    "run_in_sandbox",
    "sandbox_host_children",
]
