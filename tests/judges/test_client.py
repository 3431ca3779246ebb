"""The judge domain as the coordinator sees it: concurrent batches, one breaker per worker,
retries on another worker, and a rate rule for judges that are broken.

The workers are real :class:`JudgeWorker` objects; only the Ray hop is replaced by a direct
call, so these run without a cluster.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from erlay.actors.job.domains import JudgeClient
from erlay.actors.job.plugins import PluginFailing, RateRule
from erlay.judges.worker import JudgeWorker


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeHost:
    """A judge host's ``call`` without Ray: routes to in-process workers."""

    def __init__(self, path: str, workers: dict[str, JudgeWorker]) -> None:
        self.path = path
        self.workers = workers
        self.process = object()
        self.actor = self
        self.call = _Remote(self._call)

    async def _call(self, worker: str, method: str, args: tuple[Any, ...],
                    kwargs: Any = None) -> Any:
        return await getattr(self.workers[worker], method)(*args)


class FakeTree:
    def __init__(self, hosts: dict[str, FakeHost]) -> None:
        self.hosts = hosts

    def ref(self, path: str) -> FakeHost:
        return self.hosts[path]


def client(judge: str, hosts: int = 2, workers: int = 2,
           judge_kwargs: dict[str, Any] | None = None, retries: int = 2,
           **kw: Any) -> JudgeClient:
    path = f"tests.judges.flaky_judge:{judge}"
    names = [f"judge-{i + 1}" for i in range(workers)]
    paths = [f"j/host@n{h}" for h in range(hosts)]
    tree = FakeTree({p: FakeHost(p, {w: JudgeWorker(path, dict(judge_kwargs or {}),
                                                    timeout_s=0.5) for w in names})
                     for p in paths})
    return JudgeClient(tree, paths, names, retries, judge_path=path, **kw)  # type: ignore[arg-type]


def judged_share(c: JudgeClient, samples: int = 2000) -> float:
    async def go() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(c.score(f"r{i}/judge", "12", "12")
                                           for i in range(samples))))
    results = asyncio.run(go())
    return sum(r["ok"] for r in results) / samples


def test_fifteen_percent_failing_judge_calls_leave_over_95_percent_judged() -> None:
    share = judged_share(client("FlakyJudge", judge_kwargs={"rate": 0.15}))
    assert share >= 0.95, share


def test_the_same_judge_without_retries_falls_below_the_target() -> None:
    """The planted counterpart: the check can fail.  Without retries on another worker,
    about 15% of samples stay unjudged."""
    share = judged_share(client("FlakyJudge", judge_kwargs={"rate": 0.15}, retries=0),
                         samples=400)
    assert share < 0.95, share


def test_a_failed_judgement_carries_its_kind_and_reason() -> None:
    c = client("BrokenJudge", rule=RateRule(window=1000, max_rate=1.0, min_calls=1000))

    async def go() -> dict[str, Any]:
        return await c.score("r0/judge", "1", "1")
    result = asyncio.run(go())
    assert result["ok"] is False and result["kind"] == "exception"
    assert "BrokenJudge.score raised RuntimeError: the judge is broken" in result["reason"]


def test_a_judge_that_always_fails_stops_the_job_after_the_min_calls() -> None:
    c = client("BrokenJudge", retries=0, rule=RateRule(window=40, max_rate=0.75, min_calls=16))

    async def go() -> int:
        done = 0
        for i in range(40):
            await c.score(f"r{i}/judge", "1", "1")
            done += 1
        return done
    with pytest.raises(PluginFailing) as caught:
        asyncio.run(go())
    assert "tests.judges.flaky_judge:BrokenJudge.score keeps failing (16 of its last 16" \
        in str(caught.value)


def test_one_hanging_item_of_a_batch_times_out_alone() -> None:
    worker = JudgeWorker("tests.judges.flaky_judge:HangingJudge", None, timeout_s=0.5)
    items = [("1", "hang" if i % 3 == 0 else "ok", f"k{i}") for i in range(9)]

    async def go() -> list[dict[str, Any]]:
        return await worker.score_many(items)
    started = time.monotonic()
    results = asyncio.run(go())
    elapsed = time.monotonic() - started
    assert [r["ok"] for r in results] == [i % 3 != 0 for i in range(9)]
    assert {r.get("kind") for r in results if not r["ok"]} == {"timeout"}
    assert elapsed < 1.4, f"3 hanging items judged one after another would take 1.5 s: {elapsed}"
