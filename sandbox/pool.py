"""The sandbox domain's pool: one host per node, holding N sandbox workers.

Each worker has its own slot, and so its own uid (see :mod:`erlay.sandbox.isolation`).  Slots are
numbered per host from ``first_slot``: two hosts on one machine (several Ray nodes on one
box, or two jobs) need disjoint slot ranges, or they share uids and RLIMIT_NPROC budgets.
"""

from __future__ import annotations

from typing import Any

from erlay.sandbox.limits import SandboxLimits
from erlay.supervisor.spec import ChildSpec, InProcessStart

# Time a worker gets, beyond the wall timeout, to kill a run, drain its pipes and remove its
# scratch directory before hang detection calls it hung.
DEADLINE_MARGIN_S = 5.0


def sandbox_host_children(workers: int, limits: dict[str, Any], *,
                          margin_s: float = DEADLINE_MARGIN_S,
                          first_slot: int = 0) -> tuple[ChildSpec, ...]:
    """Child specs ``sandbox-0`` .. ``sandbox-{workers-1}`` for a node host
    (:func:`erlay.supervisor.host.host_spec`), worker ``i`` in slot ``first_slot + i``.

    ``limits`` is validated here, so a bad config fails before any host starts.  The
    ``tool_call`` deadline is the wall timeout plus ``margin_s``: raise the margin if
    requests carry a ``timeout_s`` longer than the limits' wall timeout.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
    if isinstance(first_slot, bool) or not isinstance(first_slot, int) or first_slot < 0:
        raise ValueError(f"first_slot: expected an integer >= 0, got {first_slot!r}")
    parsed = SandboxLimits.model_validate(limits)
    deadline = parsed.wall_timeout_s + margin_s
    return tuple(
        ChildSpec(f"sandbox-{i}",
                  InProcessStart("erlay.sandbox.worker:SandboxWorker",
                                 kwargs={"limits": parsed.model_dump(),
                                         "slot": first_slot + i}),
                  deadlines={"tool_call": deadline})
        for i in range(workers))
