"""The signal injector's phase wait, on a real process and a tree snapshot without Ray."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from erlay.chaos.injectors import Injector


class _Tree:
    """The two calls the injector makes of a job's tree: a snapshot, and a child's pid."""

    def __init__(self, pid: int, phase: str | None) -> None:
        self.info = {"pid": pid, "node_id": None}
        self.phase = phase

    def snapshot(self, timeout: float | None = None) -> dict[str, Any]:
        row = {"id": "learner", "info": self.info, "phase": self.phase, "children": []}
        return {"path": "erlay", "children": [row]}

    def ref(self, path: str) -> Any:
        return SimpleNamespace(process=SimpleNamespace(info=self.info))


def _no_ray() -> None:
    raise AssertionError("the injector consulted Ray for a child that named no node")


@pytest.mark.parametrize("phase", ["train_step", None])
def test_a_signal_records_whether_it_landed_in_the_phase_it_waited_for(
        phase: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A child that names no node is taken as this node's: asking Ray would start (or, with
    # a stale address left by an earlier test, hang connecting to) a cluster.
    monkeypatch.setattr(ray, "get_runtime_context", _no_ray)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        injector = Injector(SimpleNamespace(tree=_Tree(proc.pid, phase)))  # type: ignore[arg-type]
        record = injector.signal("sigkill", "erlay/learner", during="train_step")
        assert proc.wait(timeout=10) == -9
        assert record.target == "erlay/learner"
        # A fault that never saw its phase says so in the record the chaos report shows.
        assert ("outside train_step" in record.detail) is (phase is None), record.detail
    finally:
        proc.kill()
        proc.wait()


def test_a_sandbox_attack_goes_through_the_jobs_named_hook() -> None:
    """The attack is a tool call the job makes through its running coordinator's sandbox
    client (``Job.tool_call``); with no coordinator running nothing is injected."""
    import concurrent.futures

    calls: list[tuple[str, str]] = []

    def tool_call(key: str, code: str) -> concurrent.futures.Future[dict[str, Any]]:
        calls.append((key, code))
        done: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        done.set_result({"outcome": "killed"})
        return done

    injector = Injector(SimpleNamespace(tool_call=tool_call))  # type: ignore[arg-type]
    record = injector.sandbox_attack("fork_bomb", "while True: os.fork()")
    assert calls == [(f"chaos-{record.id}/fork_bomb", "while True: os.fork()")]
    assert injector.attack_results == [{"attack": "fork_bomb", "outcome": "killed"}]

    def not_running(key: str, code: str) -> Any:
        raise LookupError("the rollout coordinator is not running")
    idle = Injector(SimpleNamespace(tool_call=not_running))  # type: ignore[arg-type]
    with pytest.raises(LookupError):
        idle.sandbox_attack("fork_bomb", "pass")
    assert idle.records == []


def test_an_actor_child_is_asked_its_phase_not_read_from_a_stale_snapshot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot shows the phase the supervisor last heard, up to a heartbeat old: a
    decode step shorter than that never shows there (the engine-kill-replay smoke scenario
    then killed nothing before its fast job ended).  The child itself says it is in it."""
    monkeypatch.setattr(ray, "get_runtime_context", _no_ray)
    asked: list[str] = []

    class _Progress:
        def remote(self) -> str:
            asked.append("progress")
            return "ref"

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: {"counter": 3,
                                                               "phase": "train_step"})
    proc = subprocess.Popen(["sleep", "60"])
    try:
        tree = _Tree(proc.pid, None)   # the snapshot: no work seen
        actor = SimpleNamespace(_erlay_progress=_Progress())
        tree.ref = lambda path: SimpleNamespace(  # type: ignore[method-assign]
            process=SimpleNamespace(info=tree.info), actor=actor)
        injector = Injector(SimpleNamespace(tree=tree))  # type: ignore[arg-type]
        record = injector.signal("sigkill", "erlay/learner", during="train_step")
        assert proc.wait(timeout=10) == -9
        assert asked and "outside" not in record.detail, record.detail
    finally:
        proc.kill()
        proc.wait()
