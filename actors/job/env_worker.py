"""The environment's side of its worker processes: the object an environment host's workers
serve (:class:`EnvironmentServer`), and what it is built from (:class:`EnvironmentSpec`).

Each worker process of an environment host (:mod:`erlay.supervisor.worker_process`) builds
the job's environment once, from its import path and kwargs (the dataset's rows included),
and the validation environment too when the job validates.  Every call then runs the user's
method through :func:`~erlay.actors.job.plugins.run_checked`, so what the user's code raises
or returns wrongly comes back as a value (a :class:`~erlay.actors.job.plugins.PluginReply`),
and only a hang or a crash is left for the host to find.

This module is imported inside worker processes: it must stay light (no Ray, no torch).

May import: erlay.supervisor, erlay.environments, erlay.actors.job.plugins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from erlay.actors.job.plugins import PluginReply, run_checked
from erlay.environments.base import Environment, load_environment

Which = Literal["train", "validation"]


@dataclass(frozen=True)
class EnvironmentSpec:
    """How to build the job's environments in a worker process: the class path, the
    training environment's kwargs and, when the job validates, the validation
    environment's (each with its dataset rows, when there is a dataset)."""

    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    validation_kwargs: dict[str, Any] | None = None
    validation_rows: int = 0


@dataclass(frozen=True)
class EnvironmentInfo:
    """What the coordinator reads of a built environment once: its ``name``, ``max_turns``
    and tool schemas (``tools``, for the chat template; None when it has none)."""

    name: str
    max_turns: int
    tools: Any = None


def describe(env: Environment, plugin: str) -> EnvironmentInfo:
    return EnvironmentInfo(str(getattr(env, "name", plugin)), int(env.max_turns),
                           getattr(env, "tools", None))


class EnvironmentServer:
    """The served object of an environment worker process.  Construction builds the
    environments (a constructor that raises fails the worker's start)."""

    def __init__(self, spec: EnvironmentSpec) -> None:
        self.plugin = spec.cls
        self.envs: dict[str, Environment] = {"train": load_environment(spec.cls, **spec.kwargs)}
        if spec.validation_kwargs is not None:
            self.envs["validation"] = load_environment(spec.cls, **spec.validation_kwargs)

    @classmethod
    def of(cls, train: Environment, plugin: str,
           validation: Environment | None = None) -> EnvironmentServer:
        """A server over environments already built (tests; a notebook)."""
        server = cls.__new__(cls)
        server.plugin = plugin
        server.envs = {"train": train}
        if validation is not None:
            server.envs["validation"] = validation
        return server

    def describe(self) -> dict[str, EnvironmentInfo]:
        """Each environment's :class:`EnvironmentInfo`, by ``train`` / ``validation``."""
        return {which: describe(env, self.plugin) for which, env in self.envs.items()}

    def call(self, which: Which, method: str, args: tuple[Any, ...]) -> PluginReply:
        """``<environment>.<method>(*args)``, checked (see the module docstring)."""
        return run_checked(self.envs[which], self.plugin, method, args)
