"""``ActorStart.boot_ahead``: at the tree's boot, actors are created at once, so their
constructors overlap, while the starts are still reported in the tree's order; a boot that
fails kills the actors it created ahead and never reached.

The overlap is read from the constructors' own wall-clock records, not from a timing bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.supervisor.errors import ChildStartError
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    SupervisorFlags,
    SupervisorStart,
    boot_ahead_children,
)
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import Echo, SlowBoot

FLAGS = SupervisorFlags("one_for_one", intensity=5, period=10)


def _slow(cid: str, log: Path, *, ahead: bool, delay_s: float = 0.0,
          fail_ready: bool = False, until: str | None = None) -> ChildSpec:
    return ChildSpec(cid, ActorStart(SlowBoot, args=(str(log), cid, delay_s, fail_ready,
                                                     until), boot_ahead=ahead))


def _constructors(log: Path) -> dict[str, dict[str, float]]:
    """name -> {"enter": t, "exit": t} of each constructor that ran."""
    seen: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        what, name, when = line.split()
        seen.setdefault(name, {})[what] = float(when)
    return seen


def test_boot_ahead_children_walks_nested_supervisors_but_not_simple_templates() -> None:
    pool = SupervisorFlags("simple_one_for_one")
    a = ChildSpec("a", ActorStart(Echo, boot_ahead=True))
    b = ChildSpec("b", ActorStart(Echo))  # not flagged
    nested = ChildSpec("dom", SupervisorStart(FLAGS, (a, b)), type="supervisor")
    simple = ChildSpec("pool", SupervisorStart(pool, (a,)), type="supervisor")
    hosted = ChildSpec("h", InProcessStart(Echo))
    found = boot_ahead_children("root", [a, nested, simple, hosted])
    assert [path for path, _ in found] == ["root/a", "root/dom/a"]
    assert all(start.boot_ahead for _, start in found)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-turn"])
def test_ahead_constructors_overlap_and_starts_stay_in_order(tmp_path: Path,
                                                             ahead: bool) -> None:
    """The elder's constructor works until the younger's ``erlay_ready`` has begun, or 5 s.
    With ``boot_ahead`` the younger's constructor and ready hook run during it; without (the
    planted violation of the overlap), only after it."""
    import ray
    log, sink = tmp_path / "ctors.log", MemorySink()
    dom = ChildSpec("dom", SupervisorStart(FLAGS, (_slow("b", log, ahead=ahead),)),
                    type="supervisor")
    tree = SupervisionTree("ba1", FLAGS, [_slow("a", log, ahead=ahead, delay_s=5.0,
                                                until="ready b"), dom], sink=sink).start()
    try:
        ctors = _constructors(log)
        overlapped = ctors["b"]["ready"] < ctors["a"]["exit"]
        assert overlapped is ahead, ctors
        started = [e.supervisor + "/" + e.child for e in sink.events
                   if e.context is EventKind.START and e.reason == "started"]
        assert started.index("ba1/a") < started.index("ba1/dom/b") < started.index("ba1/dom")
        assert ray.get(tree.ref("ba1/dom/b").ping.remote()) == "pong"  # the adopted actor
    finally:
        tree.stop()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_failed_boot_kills_the_actors_it_created_ahead(tmp_path: Path) -> None:
    import ray
    log = tmp_path / "ctors.log"
    # a's ready fails only once b's constructor has entered: b was created ahead.
    children = [_slow("a", log, ahead=True, fail_ready=True, until="enter b"),
                _slow("b", log, ahead=True)]
    with pytest.raises(ChildStartError, match="planted: not ready"):
        SupervisionTree("ba2", FLAGS, children).start()
    assert "enter" in _constructors(log)["b"]  # b was created ahead: its constructor ran

    def gone(name: str) -> bool:
        try:
            ray.get_actor(name)
        except ValueError:
            return True
        return False

    wait_for(lambda: gone("ba2/b") and gone("ba2/a"), timeout=10.0,
             what="the actors created ahead to be killed")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_an_actor_that_cannot_be_created_ahead_fails_its_start_by_name(tmp_path: Path
                                                                       ) -> None:
    """Bad options make Ray refuse the actor at once: the boot still ends in the named start
    failure a user sees for any child, never in Ray's raw error out of the boot."""
    bad = ChildSpec("bad", ActorStart(SlowBoot, args=(str(tmp_path / "log"), "bad"),
                                      options={"num_cpus": -1}, boot_ahead=True))
    with pytest.raises(ChildStartError, match="ba3/bad"):
        SupervisionTree("ba3", FLAGS, [bad]).start()
