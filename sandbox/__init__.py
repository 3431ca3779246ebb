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

May import: erlay.supervisor.
"""


from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.pool import sandbox_host_children
from erlay.sandbox.results import (
    MalformedMessage,
    Outcome,
    SandboxRequest,
    SandboxResult,
)
from erlay.sandbox.runner import run_in_sandbox
from erlay.sandbox.worker import SandboxWorker

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
