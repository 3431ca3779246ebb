"""What counts as a gone child (CHILD_GONE) in the coordinator's clients, without Ray.

A gone child (restarting, deleted, its actor dead) fails over to another child; an error of
our own code, such as a KeyError, propagates at once, neither retried nor failed over.  The
lookups run against a real supervision tree with in-process children; the Ray hop of a
sandbox call is replaced by a direct call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from erlay.actors.job.coordinator import RolloutCoordinator
from erlay.actors.job.domains import EnginePool, SandboxClient
from erlay.actors.model.refit import Refit, RefitManifest
from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags
from erlay.supervisor.tree import SupervisionTree


class Idle:
    """An in-process child that only exists."""


@pytest.fixture
def tree() -> Iterator[SupervisionTree]:
    """A running tree ``t`` with the in-process children ``a`` and ``b``."""
    t = SupervisionTree("t", SupervisorFlags(), [ChildSpec("a", InProcessStart(Idle)),
                                                 ChildSpec("b", InProcessStart(Idle))])
    t.start(timeout=30)
    yield t
    t.stop(timeout=30)


def delete(tree: SupervisionTree, child_id: str) -> None:
    tree.terminate_child("t", child_id)
    tree.delete_child("t", child_id)


# ------------------------------------------------------------------------- lookups
def test_a_deleted_child_reads_as_not_running_not_as_a_key_error(
        tree: SupervisionTree) -> None:
    ref = tree.ref("t/a")
    assert ref.incarnation == 1
    delete(tree, "a")
    with pytest.raises(ChildNotRunning):
        ref.incarnation  # noqa: B018
    with pytest.raises(ChildNotRunning):
        ref.process  # noqa: B018


def test_the_learner_ranks_incarnations_skip_a_gone_rank(tree: SupervisionTree) -> None:
    delete(tree, "a")
    assert RolloutCoordinator._incarnations([tree.ref("t/a"), tree.ref("t/b")]) == [None, 1]


def test_a_path_outside_the_tree_is_a_bug_and_raises_key_error(
        tree: SupervisionTree) -> None:
    with pytest.raises(KeyError):
        tree.ref("elsewhere/a").incarnation  # noqa: B018


class FakeTree:
    """Hands out the fake refs it was built with, by path."""

    def __init__(self, *refs: Any) -> None:
        self.refs = {r.path: r for r in refs}

    def ref(self, path: str) -> Any:
        return self.refs[path]


# ------------------------------------------------------------------------ engines
def test_an_engine_pool_passes_over_a_gone_engine(tree: SupervisionTree) -> None:
    pool = EnginePool(tree, ["t/a", "t/b"])
    delete(tree, "a")
    picked = asyncio.run(pool.acquire(timeout_s=5))
    assert picked.path == "t/b"


def test_a_key_error_of_our_own_in_an_engine_lookup_propagates(
        tree: SupervisionTree, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = EnginePool(tree, ["t/a", "t/b"])

    async def buggy_admit(ref: Any) -> bool:
        raise KeyError("a bug in erlay")
    monkeypatch.setattr(pool, "_admit", buggy_admit)
    with pytest.raises(KeyError, match="a bug in erlay"):
        asyncio.run(pool.acquire(timeout_s=5))


class FakeEngine:
    """An engine as a ChildRef shows it; ``gone`` makes its incarnation lookup fail as a
    deleted child's does, after it was seen running."""

    def __init__(self, path: str, gone: bool = False) -> None:
        self.path = path
        self.process = object()
        self.gone = gone
        self.actor = self
        self.update_weights = self
        self.loaded: list[int] = []

    @property
    def incarnation(self) -> int:
        if self.gone:
            raise ChildNotRunning(f"{self.path} is no longer a child")
        return 1

    def remote(self, refit: Refit) -> Any:
        async def load() -> None:
            self.loaded.append(refit.version)
        return load()


def test_publishing_weights_passes_over_an_engine_gone_since_it_was_seen_running() -> None:
    live, gone = FakeEngine("g/e1"), FakeEngine("g/e2", gone=True)
    pool = EnginePool(FakeTree(live, gone), [live.path, gone.path])  # type: ignore[arg-type]
    asyncio.run(pool.publish(Refit(RefitManifest(7, "float32", ()), ())))
    assert live.loaded == [7] and gone.loaded == []
    assert pool._admitted == {"g/e1": 1}


# ------------------------------------------------------------------------ sandbox
class FakeHost:
    """A sandbox host as a ChildRef shows it: ``actor.call.remote(...)`` runs ``answer``."""

    def __init__(self, path: str, answer: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self.process = object()
        self.answer = answer
        self.calls = 0
        self.actor = self
        self.call = self

    def remote(self, *args: Any) -> Any:
        self.calls += 1

        async def result() -> dict[str, Any]:
            return self.answer()
        return result()




def ok() -> dict[str, Any]:
    return {"outcome": "ok", "exit_code": 0, "stdout": "4\n"}


def sandbox(first: Callable[[], dict[str, Any]]) -> tuple[SandboxClient, FakeHost, FakeHost]:
    a, b = FakeHost("s/host@a", first), FakeHost("s/host@b", ok)
    client = SandboxClient(FakeTree(a, b), [a.path, b.path], ["w"],  # type: ignore[arg-type]
                           max_attempts=3, call_timeout_s=5)
    return client, a, b


def test_a_tool_call_fails_over_when_its_sandbox_host_died() -> None:
    def died() -> dict[str, Any]:
        raise ActorDiedError()
    client, a, b = sandbox(died)
    result = asyncio.run(client.execute("r1/t0/tool0", "print(4)"))
    assert result["outcome"] == "ok" and (a.calls, b.calls) == (1, 1)


def test_a_key_error_of_our_own_in_a_tool_call_propagates_without_failover() -> None:
    def buggy() -> dict[str, Any]:
        return {}["outcome"]  # type: ignore[no-any-return]
    client, a, b = sandbox(buggy)
    with pytest.raises(KeyError, match="outcome"):
        asyncio.run(client.execute("r1/t0/tool0", "print(4)"))
    assert (a.calls, b.calls) == (1, 0)
