"""``ChildSpec.restart_delay_s`` in the pure decision core (an erlay addition to OTP).

A child with a restart delay is restarted that many seconds after its exit.  The restart is
counted and reported at the exit; meanwhile the child is ``restarting`` and the supervisor
serves other events.  Fake clock: timers fire only when the test advances it.
"""

from __future__ import annotations

import math

import pytest

from erlay.supervisor import core
from erlay.supervisor.core import (
    ChildStatus,
    RestartChildCall,
    ShutdownCall,
    StartChildCall,
    TerminateChildCall,
)
from erlay.supervisor.errors import InvalidSpec
from erlay.supervisor.events import EventKind
from erlay.supervisor.spec import SupervisorFlags
from tests.supervisor.fakeworld import FakeWorld, worker

ONE_FOR_ONE = SupervisorFlags("one_for_one", intensity=3, period=5)


def world(flags: SupervisorFlags, *specs) -> FakeWorld:
    return FakeWorld(flags, specs).boot()


def test_the_restart_starts_after_its_delay_and_is_counted_at_the_exit() -> None:
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0), worker("b"))
    w.crash("a")
    assert w.alive == {"b": 1} and w.status("a") is ChildStatus.RESTARTING
    assert len(w.state.restarts) == 1 and len(w.reported(EventKind.RESTART)) == 1
    w.advance(1.99)
    assert "a" not in w.alive
    w.advance(0.01)
    assert w.alive == {"a": 2, "b": 1} and w.status("a") is ChildStatus.RUNNING


def test_a_child_without_a_delay_is_restarted_at_once() -> None:
    w = world(ONE_FOR_ONE, worker("a"))
    w.crash("a")
    assert w.alive == {"a": 2} and w.timers == []


def test_other_children_are_served_during_the_delay() -> None:
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0), worker("b"))
    w.crash("a")
    w.advance(0.5)
    w.crash("b")
    assert w.alive == {"b": 2}
    assert w.call(lambda ref: RestartChildCall(ref, "a")).value == "restarting"
    w.advance(1.5)
    assert w.alive == {"a": 2, "b": 2}


def test_the_intensity_counts_each_exit_without_waiting_for_the_delay() -> None:
    w = world(SupervisorFlags(intensity=1, period=5), worker("a", restart_delay_s=2.0))
    w.crash("a")
    w.advance(2.0)
    w.crash("a")
    assert w.terminated is not None and "reached_max_restart_intensity" in w.terminated.detail
    w.advance(10)
    assert w.alive == {}


def test_a_failed_delayed_restart_is_retried_after_the_delay_again() -> None:
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0))
    w.fail_starts["a"] = 1
    w.crash("a")
    w.advance(2.0)
    assert w.alive == {} and len(w.reported(EventKind.START_ERROR)) == 1
    assert w.status("a") is ChildStatus.RESTARTING
    w.advance(1.99)
    assert w.alive == {}
    w.advance(0.01)
    assert w.alive == {"a": 3} and len(w.state.restarts) == 2


def test_terminate_child_cancels_a_pending_restart() -> None:
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0))
    w.crash("a")
    assert w.call(lambda ref: TerminateChildCall(ref, "a")).value is None
    w.advance(5)
    assert w.alive == {} and w.status("a") is ChildStatus.UNDEFINED


def test_a_stale_timer_does_not_start_a_later_restart_early() -> None:
    # The first restart is cancelled and the child started by hand; it crashes again, and
    # the first restart's timer fires before the second one's delay has run.
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0))
    w.crash("a")
    w.call(lambda ref: TerminateChildCall(ref, "a"))
    assert w.call(lambda ref: RestartChildCall(ref, "a")).ok
    w.advance(0.5)
    w.crash("a")
    w.advance(1.5)          # the first timer is due now: it must not start "a"
    assert w.alive == {}
    w.advance(0.5)
    assert w.alive == {"a": 3}


def test_a_shutdown_drops_pending_restarts() -> None:
    w = world(ONE_FOR_ONE, worker("a", restart_delay_s=2.0), worker("b"))
    w.crash("a")
    assert w.call(lambda ref: ShutdownCall(ref)).ok
    w.advance(5)
    assert w.alive == {} and w.terminated is not None and w.started == [("a", 1), ("b", 1)]


def test_simple_one_for_one_instances_take_the_templates_delay() -> None:
    w = world(SupervisorFlags("simple_one_for_one", intensity=3, period=5),
              worker("s", restart_delay_s=1.0))
    cid = w.call(lambda ref: StartChildCall(ref, args=(1,))).value
    w.crash(cid)
    assert cid not in w.alive
    w.advance(1.0)
    assert w.alive == {cid: 2}


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "2"])
def test_a_bad_delay_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidSpec, match="restart_delay_s"):
        worker("a", restart_delay_s=bad)


@pytest.mark.parametrize("strategy", ["one_for_all", "rest_for_one"])
def test_a_delay_under_a_group_strategy_is_rejected(strategy: str) -> None:
    with pytest.raises(InvalidSpec, match="one_for_one"):
        core.init_state("r", SupervisorFlags(strategy), (worker("a", restart_delay_s=1.0),))
    w = world(SupervisorFlags(strategy), worker("a"))
    reply = w.call(lambda ref: StartChildCall(ref, worker("b", restart_delay_s=1.0)))
    assert not reply.ok and "restart_delay_s" in str(reply.value)
