"""The goodput controller wired into a job: built from its config, restarting engines
through their supervisor.

:func:`build_controller` makes the job's :class:`~erlay.actors.control.GoodputController`
(None when ``control.enabled`` is false) and hands it the engine pool's routing.

:class:`TreeRestarter` restarts an engine the way its supervisor would after a crash: it kills
the child's current incarnation with an exit reason that says the controller asked, on the
tree's own loop, so the supervisor sees an exit, restarts it and counts the restart against
the generation domain's intensity.  :meth:`headroom` reads that intensity, so the controller
never spends the restarts a real fault would need (``control.engine.intensity_headroom``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from erlay.actors.config import JobConfig
from erlay.actors.control.controller import GoodputController
from erlay.actors.control.policy import Action
from erlay.actors.job.domains import CHILD_GONE, EnginePool
from erlay.sandbox.limits import SandboxLimits
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.tree import SupervisionTree

KILL_DEADLINE_S = 30.0


class TreeRestarter:
    """Restarts the engines of ``pool`` through ``tree``."""

    def __init__(self, tree: SupervisionTree, pool: EnginePool) -> None:
        self.tree = tree
        self.pool = pool

    def _parent(self) -> str:
        return self.pool.refs[0].path.rpartition("/")[0]

    def headroom(self) -> int:
        """Restarts the engines' supervisor may still make before it escalates: its
        intensity less the restarts inside its period.  0 while it is not running."""
        try:
            sup = self.tree.supervisor(self._parent())
        except CHILD_GONE:
            return 0
        state = sup.state
        now = sup.clock.monotonic()
        used = sum(t >= now - state.flags.period for t in state.restarts)
        return max(0, state.flags.intensity - used)

    def load(self, path: str) -> int:
        return self.pool.load(path)

    async def restart(self, path: str, reason: str) -> None:
        ref = next(r for r in self.pool.refs if r.path == path)
        proc = ref.process   # raises ChildNotRunning when it is already restarting
        future = asyncio.run_coroutine_threadsafe(
            proc.kill(ExitReason(ExitKind.KILLED, f"goodput controller: {reason}")),
            self.tree.loop)
        await asyncio.wait_for(asyncio.wrap_future(future), KILL_DEADLINE_S)


def build_controller(cfg: JobConfig, engines: EnginePool, tree: SupervisionTree,
                     emit: Callable[[Action], None]) -> GoodputController | None:
    """The controller for ``cfg``, routing ``engines`` and restarting them through ``tree``.

    The sandbox's adaptive deadline is a run's wall deadline, so its ceiling is the sandbox
    limits' ``wall_timeout_s``; the judge's is ``judge.timeout_s``.  Hedging needs the torch
    engine's seeded resumption (see :mod:`erlay.actors.job.hedge`)."""
    if not cfg.control.enabled:
        return None
    control = GoodputController(
        cfg.control, [ref.path for ref in engines.refs], emit,
        sandbox_deadline_s=SandboxLimits(**cfg.sandbox.limits).wall_timeout_s,
        judge_deadline_s=cfg.judge.timeout_s, hedging=cfg.engine.backend == "torch")
    control.restarter = TreeRestarter(tree, engines)
    engines.router = control.pick
    return control
