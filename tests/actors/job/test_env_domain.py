"""The environment as a fault domain of its own: its calls run in worker processes of an
environment host, never in the driver.  Real processes, a real node host (its worker pool
and supervisor, without Ray), the real server and client."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.job.env_client import EnvironmentClient
from erlay.actors.job.env_worker import EnvironmentSpec
from erlay.actors.job.plugins import PluginFailing, RateRule, UserCodeFailed, UserError
from erlay.environments.arithmetic import ArithmeticEnv
from erlay.supervisor.host import NodeHost
from erlay.supervisor.spec import ChildSpec, SupervisorFlags, WorkerStart
from erlay.supervisor.worker_process import CallOutcome, WorkerCall

PATH = "tests.environments.faulty_env:FaultyEnv"


async def environment_host(workers: int = 2, timeout_s: float = 1.0,
                           **modes: Any) -> NodeHost:
    spec = EnvironmentSpec(PATH, dict(modes))
    template = ChildSpec("environment", WorkerStart(
        "erlay.actors.job.env_worker:EnvironmentServer", args=(spec,), call_timeout_s=timeout_s,
        ready_timeout_s=30.0))
    host = NodeHost(SupervisorFlags("simple_one_for_one", intensity=3, period=10),
                    (template,), instances=tuple(() for _ in range(workers)),
                    erlay_path="erlay/environment/host@node-0")
    await host.erlay_ready()
    return host


async def client(host: NodeHost, timeout_s: float = 1.0, **kw: Any) -> EnvironmentClient:
    async def transport(call: WorkerCall) -> CallOutcome:
        [outcome] = await host.submit([call], 30.0)
        return outcome
    infos = await EnvironmentClient.describe(transport)
    return EnvironmentClient(transport, PATH, infos["train"], timeout_s=timeout_s, **kw)


def run(go: Callable[[], Awaitable[Any]], timeout: float = 90) -> Any:
    return asyncio.run(asyncio.wait_for(go(), timeout))


async def failure(awaitable: Awaitable[Any]) -> UserError:
    with pytest.raises(UserCodeFailed) as caught:
        await awaitable
    return caught.value.error


def test_calls_run_in_worker_processes_and_give_what_the_environment_gives() -> None:
    async def go() -> tuple[Any, Any, Any]:
        host = await environment_host()
        env = await client(host)
        episode = await env.reset(3, 7)
        stepped = await env.step(episode, "12")
        pids = {w.pid for w in host._worker_processes()}
        await host.erlay_terminate()
        return episode, stepped, pids
    episode, stepped, pids = run(go)
    plain = ArithmeticEnv()
    assert episode == plain.reset(3, 7) and stepped == plain.step(plain.reset(3, 7), "12")
    assert os.getpid() not in pids and len(pids) == 2


@pytest.mark.parametrize("mode", ["freeze", "hang"])
def test_a_frozen_call_fails_its_sample_timeout_and_the_other_worker_serves_meanwhile(
        mode: str) -> None:
    """A step that holds the GIL in C code for minutes (or sleeps) costs that sample its
    deadline and that worker's process; the driver's loop and the other worker go on."""
    ticks: list[float] = []

    async def go() -> tuple[UserError, float, list[Any], Any]:
        host = await environment_host(step=f"{mode}@3")
        env = await client(host, timeout_s=1.0)
        loop = asyncio.get_running_loop()

        async def tick() -> None:   # this loop's timer: never held up by the freeze
            while True:
                ticks.append(loop.time())
                await asyncio.sleep(0.01)
        ticker = asyncio.ensure_future(tick())
        started = loop.time()
        frozen = asyncio.ensure_future(failure(env.step(await env.reset(3, 0), "1")))
        await asyncio.sleep(0.1)
        others = [await env.step(await env.reset(i, 0), "1") for i in range(10, 20)]
        error = await frozen
        took = loop.time() - started
        again = await env.step(await env.reset(21, 0), "1")   # its worker was replaced
        ticker.cancel()
        await host.erlay_terminate()
        return error, took, others, again
    error, took, others, again = run(go)
    assert (error.method, error.kind) == ("step", "timeout")
    assert 1.0 <= took < 1.0 + 5.0
    assert len(others) == 10 and again is not None
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 0.9, "the caller's loop was held up (the deadline is 1 s)"


def test_an_input_that_kills_its_worker_twice_is_poison_and_not_tried_again() -> None:
    async def go() -> tuple[UserError, int, int, Any]:
        host = await environment_host(reset="die@5")
        env = await client(host)
        error = await failure(env.reset(5, 0))
        fine = await env.reset(6, 0)
        replaced = sum(w.replaced for w in host._worker_processes())
        await host.erlay_terminate()
        return error, env.poisoned, replaced, fine
    error, poisoned, replaced, fine = run(go)
    assert error.kind == "poison" and "twice" in error.detail and "exit code 7" in error.detail
    assert poisoned == 1 and replaced == 2 and fine is not None


def test_a_death_the_retry_does_not_meet_costs_nothing(tmp_path: Path) -> None:
    """The first death may be the machine's (the OOM killer): the call is tried once more,
    and a retry that works is the answer."""
    async def go() -> tuple[Any, int, int]:
        host = await environment_host(reset=f"die_once:{tmp_path / 'died'}@2")
        env = await client(host)
        episode = await env.reset(2, 0)
        await host.erlay_terminate()
        return episode, env.poisoned, env.retried_deaths
    episode, poisoned, retried = run(go)
    assert episode == ArithmeticEnv().reset(2, 0) and (poisoned, retried) == (0, 1)


@pytest.mark.parametrize(("mode", "kind", "detail"), [
    ("raise", "exception", "ValueError: the user's step failed"),
    ("none", "bad_return", "returned NoneType, expected a (Episode, StepResult) pair")])
def test_a_raise_or_a_bad_return_fails_the_sample_with_its_own_cause_untried_again(
        mode: str, kind: str, detail: str) -> None:
    async def go() -> tuple[UserError, int]:
        host = await environment_host(step=mode)
        env = await client(host)
        error = await failure(env.step(await env.reset(0, 0), "1"))
        calls = sum(w.calls for w in host._worker_processes())
        await host.erlay_terminate()
        return error, calls
    error, calls = run(go)
    assert (error.plugin, error.method, error.kind) == (PATH, "step", kind)
    assert detail in error.detail
    assert calls == 3   # describe, reset, one step: not retried


def test_a_plugin_failing_every_call_stops_the_job_with_its_traceback() -> None:
    async def go() -> None:
        host = await environment_host(step="raise")
        env = await client(host, rule=RateRule(window=8, max_rate=0.5, min_calls=4))
        episode = await env.reset(0, 0)
        try:
            for _ in range(10):
                try:
                    await env.step(episode, "1")
                except UserCodeFailed:
                    continue
        finally:
            await host.erlay_terminate()
    with pytest.raises(PluginFailing) as caught:
        run(go)
    text = str(caught.value)
    assert text.startswith(f"{PATH}.step keeps failing (4 of its last 4 calls)")
    assert "Traceback (most recent call last)" in text and "the user's step failed" in text


def test_lost_calls_are_retried_until_a_worker_answers() -> None:
    """The infrastructure's failures (a host restarting) are retried, not the sample's."""
    answers = iter([CallOutcome("lost", detail="restarting"), CallOutcome("lost"),
                    CallOutcome("ok", {"train": None})])

    async def go() -> Any:
        async def transport(call: WorkerCall) -> CallOutcome:
            return next(answers)
        return await EnvironmentClient.describe(transport)
    assert run(go) == {"train": None}


def test_a_domain_that_stays_down_is_the_coordinator_s_error_not_the_sample_s() -> None:
    from erlay.actors.job.env_client import EnvironmentUnavailable
    from erlay.actors.job.env_worker import EnvironmentInfo

    async def go() -> None:
        async def transport(call: WorkerCall) -> CallOutcome:
            return CallOutcome("lost", detail="no host")
        env = EnvironmentClient(transport, PATH, EnvironmentInfo("x", 1), unavailable_s=0.3)
        await env.reset(0, 0)
    with pytest.raises(EnvironmentUnavailable, match="no host"):
        run(go)
