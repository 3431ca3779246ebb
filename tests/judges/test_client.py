"""The judge domain as the coordinator sees it: each judgement in a worker process of a
judge host, one at a time under its deadline; the judge's own failures cost their samples
only, never retried as the infrastructure's and never counted by a host's breaker.

The hosts are real :class:`~erlay.supervisor.host.NodeHost` objects with real worker
processes; only the Ray hop between the coordinator and a host is replaced by a direct call,
so these run without a cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from erlay.actors.job.hostcalls import HostCalls
from erlay.actors.job.judge_client import JudgeClient
from erlay.actors.job.plugins import PluginFailing, RateRule
from erlay.judges.budget import CircuitBreaker
from erlay.supervisor.host import NodeHost
from erlay.supervisor.spec import ChildSpec, SupervisorFlags, WorkerStart
from erlay.supervisor.worker_process import CallOutcome, WorkerCall
from tests.judges.mixed_judge import MixedFaultJudge

MIXED = "tests.judges.mixed_judge:MixedFaultJudge"


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeRef:
    """A ChildRef of a host without Ray: ``actor.submit.remote`` calls the host directly."""

    def __init__(self, host: NodeHost) -> None:
        self.path = host.path
        self.process = object()
        self.incarnation = 1
        self.actor = self
        self.submit = _Remote(host.submit)


class FakeTree:
    def __init__(self, hosts: list[NodeHost]) -> None:
        self.refs = {h.path: FakeRef(h) for h in hosts}

    def ref(self, path: str) -> FakeRef:
        return self.refs[path]


async def judge_hosts(judge: str, kwargs: dict[str, Any], *, hosts: int = 1,
                      workers: int = 1, timeout_s: float = 0.5) -> list[NodeHost]:
    template = ChildSpec("judge", WorkerStart("erlay.judges.server:JudgeServer",
                                              args=(judge, kwargs), call_timeout_s=timeout_s))
    out = []
    for h in range(hosts):
        host = NodeHost(SupervisorFlags("simple_one_for_one", intensity=3, period=10),
                        (template,), instances=tuple(() for _ in range(workers)),
                        erlay_path=f"erlay/judge/host@node-{h}")
        await host.erlay_ready()
        out.append(host)
    return out


def client(hosts: list[NodeHost], judge: str, *, timeout_s: float = 0.5, retries: int = 2,
           transport: Callable[[HostCalls], Any] | None = None,
           **kw: Any) -> tuple[JudgeClient, HostCalls]:
    calls = HostCalls(FakeTree(hosts), [h.path for h in hosts],  # type: ignore[arg-type]
                      call_timeout_s=timeout_s, breaker=lambda: CircuitBreaker(10, 0.5))
    run = transport(calls) if transport else calls.run
    return JudgeClient(run, judge, retries=retries, timeout_s=timeout_s, **kw), calls


def run(go: Callable[[], Awaitable[Any]], timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(go(), timeout))


KEYS = [f"r{i:04d}/judge" for i in range(120)]
RATE = 0.15
FAILING = {k for k in KEYS if MixedFaultJudge.fault_of(k, RATE)}


def shares(results: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """(judged share of the others, own-cause share of the failing) over ``results``."""
    others = [r for k, r in results.items() if k not in FAILING]
    failing = [r for k, r in results.items() if k in FAILING]
    judged = sum(r["ok"] for r in others) / len(others)
    own = sum(not r["ok"] and r.get("kind") in ("exception", "timeout", "bad_return")
              for r in failing) / len(failing)
    return judged, own


def judge_all(transport: Callable[[HostCalls], Any] | None = None, retries: int = 2
              ) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    async def go() -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        hosts = await judge_hosts(MIXED, {"rate": RATE})
        c, _ = client(hosts, MIXED, transport=transport, retries=retries,
                      rule=RateRule(window=1000, max_rate=1.0, min_calls=1000))
        results = await asyncio.gather(*(c.score(k, "12", "12") for k in KEYS))
        stats = await hosts[0].worker_stats()
        for host in hosts:
            await host.erlay_terminate()
        return dict(zip(KEYS, results, strict=True)), next(iter(stats.values()))["outcomes"]
    return run(go, timeout=300)


def test_a_judge_failing_15_percent_of_inputs_costs_only_those_samples() -> None:
    """One judge worker per node; the judge raises, hangs or returns None on 15% of inputs:
    every other sample is judged, and every failing one carries its own cause."""
    assert 10 <= len(FAILING) <= 30   # the seeded 15% of 120
    results, outcomes = judge_all()
    judged, own = shares(results)
    assert judged >= 0.95 and own >= 0.90, (judged, own)
    assert judged == 1.0 and own == 1.0
    hangs = sum(MixedFaultJudge.fault_of(k, RATE) == "hang" for k in KEYS)
    assert outcomes.get("timeout") == hangs   # each hang tried once, not retried


def test_the_same_judge_with_its_failures_counted_as_the_hosts_falls_below_the_target(
        ) -> None:
    """The planted counterpart: a transport that feeds the judge's own failures to the
    host's breaker and retries them, as erlay did before.  The breaker opens and healthy
    samples fail "unavailable", so the check can fail."""
    def as_infrastructure(calls: HostCalls) -> Any:
        async def transport(call: WorkerCall) -> CallOutcome:
            outcome = await calls.run(call)
            breaker = next(iter(calls.breakers.values()))
            if outcome.kind == "timeout" or (outcome.ok and not outcome.value.ok):
                breaker.record_failure(time.monotonic())
                return CallOutcome("lost", detail=f"judge failed: {outcome.kind}")
            return outcome
        return transport
    results, _ = judge_all(as_infrastructure, retries=1)
    judged, own = shares(results)
    assert judged < 0.95 or own < 0.90, (judged, own)


def test_a_frozen_judgement_fails_timeout_within_its_deadline_and_the_host_goes_on() -> None:
    async def go() -> tuple[dict[str, Any], float, dict[str, Any]]:
        hosts = await judge_hosts(MIXED, {"rate": 1.0, "mode": "freeze"}, workers=2,
                                  timeout_s=1.0)
        frozen_c, _ = client(hosts, MIXED, timeout_s=1.0)
        started = time.monotonic()
        result = await frozen_c.score("k-frozen", "12", "12")
        took = time.monotonic() - started
        stats = await hosts[0].worker_stats()
        for host in hosts:
            await host.erlay_terminate()
        return result, took, stats
    result, took, stats = run(go)
    assert result["ok"] is False and result["kind"] == "timeout"
    assert 1.0 <= took < 1.0 + 5.0
    assert sum(s["replaced"] for s in stats.values()) == 1


def test_an_input_that_kills_its_judge_worker_twice_is_poison() -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any], int]:
        hosts = await judge_hosts(MIXED, {"rate": 0.5, "mode": "die"})
        c, calls = client(hosts, MIXED)
        poison_key = next(k for k in KEYS if MixedFaultJudge.fault_of(k, 0.5, mode="die"))
        fine_key = next(k for k in KEYS if not MixedFaultJudge.fault_of(k, 0.5, mode="die"))
        poisoned = await c.score(poison_key, "12", "12")
        fine = await c.score(fine_key, "12", "12")
        breaker = next(iter(calls.breakers.values()))
        for host in hosts:
            await host.erlay_terminate()
        return poisoned, fine, breaker.consecutive_failures
    poisoned, fine, breaker_failures = run(go)
    assert poisoned["ok"] is False and poisoned["kind"] == "poison"
    assert "twice" in poisoned["reason"]
    assert fine["ok"] is True and breaker_failures == 0


def test_a_judge_that_always_fails_stops_the_job_after_the_min_calls() -> None:
    async def go() -> None:
        hosts = await judge_hosts(MIXED, {"rate": 1.0, "mode": "raise"})
        c, _ = client(hosts, MIXED, rule=RateRule(window=40, max_rate=0.75, min_calls=16))
        try:
            for i in range(40):
                await c.score(f"r{i}/judge", "1", "1")
        finally:
            for host in hosts:
                await host.erlay_terminate()
    with pytest.raises(PluginFailing) as caught:
        run(go)
    assert f"{MIXED}.score keeps failing (16 of its last 16" in str(caught.value)


@pytest.mark.parametrize(("outcomes", "kind"), [
    ([CallOutcome("lost"), CallOutcome("lost"), CallOutcome("lost")], "unavailable"),
    ([CallOutcome("died", detail="exit code 9"), CallOutcome("died", detail="exit code 9")],
     "poison"),
    ([CallOutcome("timeout")], "timeout")])
def test_each_outcome_gives_the_judgement_the_table_says(outcomes: list[CallOutcome],
                                                          kind: str) -> None:
    answers = iter(outcomes)

    async def transport(call: WorkerCall) -> CallOutcome:
        return next(answers)

    async def go() -> dict[str, Any]:
        return await JudgeClient(transport, MIXED, retries=2, timeout_s=1.0,
                                 pause_s=0.0).score("k", "1", "1")
    result = run(go)
    assert result["ok"] is False and result["kind"] == kind
    assert next(answers, None) is None   # every outcome was asked for: no more, no fewer
