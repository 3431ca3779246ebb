"""ChildRef's per-incarnation method cache: a call always reaches the current incarnation,
and one incarnation's bound methods are built once.  No Ray: fake supervisor and handles."""

from __future__ import annotations

from typing import Any

import pytest

from erlay.supervisor.actor_child import ActorProcess
from erlay.supervisor.errors import ChildNotRunning
from erlay.supervisor.tree import ChildRef


class Handle:
    """Like Ray's actor handle: every attribute read builds a new bound method."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reads = 0

    def __getattr__(self, method: str) -> tuple[str, str, int]:
        if method.startswith("_"):
            raise AttributeError(method)
        self.reads += 1
        return (self.name, method, self.reads)


class FakeSupervisor:
    exited = False

    def __init__(self) -> None:
        self.procs: dict[str, Any] = {}

    def child(self, cid: str) -> Any:
        return self.procs.get(cid)


class FakeTree:
    def __init__(self, sup: FakeSupervisor) -> None:
        self.sup = sup

    def supervisor(self, path: str) -> FakeSupervisor:
        return self.sup


def actor_process(handle: Handle) -> ActorProcess:
    proc = object.__new__(ActorProcess)  # only .handle is read by ChildRef
    proc.handle = handle
    return proc


def test_method_is_bound_once_per_incarnation() -> None:
    sup = FakeSupervisor()
    first = Handle("inc1")
    sup.procs["engine"] = actor_process(first)
    ref = ChildRef(FakeTree(sup), "t/engine")  # type: ignore[arg-type]
    assert ref.generate is ref.generate and ref.generate[0] == "inc1"
    assert ref.abort[1] == "abort" and first.reads == 2  # one build per method name


def test_restarted_child_is_called_on_its_new_incarnation() -> None:
    sup = FakeSupervisor()
    sup.procs["engine"] = actor_process(Handle("inc1"))
    ref = ChildRef(FakeTree(sup), "t/engine")  # type: ignore[arg-type]
    assert ref.generate[0] == "inc1"
    sup.procs["engine"] = actor_process(Handle("inc2"))
    assert ref.generate[0] == "inc2"
    del sup.procs["engine"]
    with pytest.raises(ChildNotRunning):
        ref.generate  # noqa: B018 - the read is the call under test


def test_non_actor_child_and_private_names_are_refused() -> None:
    sup = FakeSupervisor()
    sup.procs["worker"] = object()
    ref = ChildRef(FakeTree(sup), "t/worker")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an actor child"):
        ref.call  # noqa: B018
    with pytest.raises(AttributeError):
        ref._private  # noqa: B018
