"""erlay's generic supervision machinery: OTP supervisors on Ray.  Knows nothing about RL.

The pure parts import nothing from Ray: :mod:`erlay.supervisor.spec`, :mod:`erlay.supervisor.core`,
:mod:`erlay.supervisor.health`, :mod:`erlay.supervisor.events`, :mod:`erlay.supervisor.reason`.  The
shell (:mod:`erlay.supervisor.runtime`, :mod:`erlay.supervisor.tree`) and the child drivers apply
decisions.

May import: nothing outside erlay.supervisor; its modules import neither
:mod:`erlay.supervisor.node` (the node runtime) nor :mod:`erlay.supervisor.cli`.
"""


from erlay.supervisor.errors import (
    ChildDead,
    ChildNotRunning,
    ChildStartError,
    ChildUnavailable,
    ErlayError,
    InvalidSpec,
    SupervisorCallError,
    SupervisorFailed,
    TaskDeadlineExceeded,
    TaskFailed,
)
from erlay.supervisor.progress import Progress
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
    WorkerStart,
)

__all__ = [
    "ActorStart", "ChildDead", "ChildNotRunning", "ChildSpec", "ChildStartError",
    "ChildUnavailable", "ErlayError", "ExitKind", "ExitReason", "InProcessStart", "InvalidSpec",
    "Progress", "SubprocessStart", "SupervisorCallError", "SupervisorFailed", "SupervisorFlags",
    "SupervisorStart", "TaskDeadlineExceeded", "TaskFailed", "WorkerStart",
]
