"""erlay's generic supervision machinery: OTP supervisors on Ray.  Knows nothing about RL.

The pure parts import nothing from Ray: :mod:`supervisor.spec`, :mod:`supervisor.core`,
:mod:`supervisor.health`, :mod:`supervisor.events`, :mod:`supervisor.reason`.  The shell
(:mod:`supervisor.runtime`, :mod:`supervisor.tree`) and the child drivers apply decisions.
"""

ERLAY_PACKAGE = "supervisor"  # marker checked by `erlay` to detect a shadowing distribution

from supervisor.errors import (  # noqa: E402
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
from supervisor.progress import Progress  # noqa: E402
from supervisor.reason import ExitKind, ExitReason  # noqa: E402
from supervisor.spec import (  # noqa: E402
    ActorStart,
    ChildSpec,
    InProcessStart,
    SubprocessStart,
    SupervisorFlags,
    SupervisorStart,
)

__all__ = [
    "ActorStart", "ChildDead", "ChildNotRunning", "ChildSpec", "ChildStartError",
    "ChildUnavailable", "ErlayError", "ExitKind", "ExitReason", "InProcessStart", "InvalidSpec",
    "Progress", "SubprocessStart", "SupervisorCallError", "SupervisorFailed", "SupervisorFlags",
    "SupervisorStart", "TaskDeadlineExceeded", "TaskFailed",
]
