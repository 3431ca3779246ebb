"""The goodput controller: keeps trained tokens per second up while the fleet degrades.

- :mod:`.policy`: the decisions, pure functions of (state, observations) -> actions;
- :mod:`.controller`: :class:`GoodputController`, which observes the rollouts, decides and
  acts (routing, restarts, hedges), each action an event with its reason;
- :mod:`.limits`: adaptive deadlines and per-host concurrency for the sandbox and the judge.

The job wires it in (:mod:`erlay.actors.job.control_wiring`: the engine pool's routing,
restarts through the engines' supervisor within its intensity).

Bounded by the ``control`` section of the job config (:mod:`erlay.actors.config.control`);
``control.enabled: false`` turns it off.  docs/control.md says what it does and what it
costs.

May import: erlay.supervisor, erlay.actors.config.
"""

from erlay.actors.control.controller import GoodputController
from erlay.actors.control.policy import Action

__all__ = ["Action", "GoodputController"]
