"""An environment client whose calls run in this process: for tests of the coordinator's
and the rollout's logic without Ray.  The calls go through the real
:class:`~erlay.actors.job.env_worker.EnvironmentServer` (the user-code checks) and the real
:class:`~erlay.actors.job.env_client.EnvironmentClient` (outcomes, failure windows); only the
worker process and its host are skipped, which ``test_env_domain.py`` covers."""

from __future__ import annotations

from typing import Any

from erlay.actors.job.env_client import EnvironmentClient
from erlay.actors.job.env_worker import EnvironmentServer
from erlay.supervisor.worker_process import CallOutcome, WorkerCall


def inline_transport(server: Any) -> Any:
    async def transport(call: WorkerCall) -> CallOutcome:
        return CallOutcome("ok", getattr(server, call.method)(*call.args, **call.kwargs))
    return transport


def inline_environment(env: Any, plugin: str, **kwargs: Any) -> EnvironmentClient:
    server = EnvironmentServer.of(env, plugin)
    return EnvironmentClient(inline_transport(server), plugin, server.describe()["train"],
                             **kwargs)
