"""OTP conformance of the pure decision core: fake clock, no Ray, one behaviour per test.

Grouped by strategy.  Each scenario ends with an assertion about which children are alive,
as OTP's own supervisor tests do.
"""

from __future__ import annotations

import re

import pytest

from erlay.supervisor import core
from erlay.supervisor.core import (
    ChildStatus,
    DeleteChildCall,
    RestartChildCall,
    ShutdownCall,
    StartChildCall,
    TerminateChildCall,
)
from erlay.supervisor.errors import InvalidSpec
from erlay.supervisor.events import EventKind
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    Shutdown,
    ShutdownKind,
    SupervisorFlags,
    SupervisorStart,
)
from tests.supervisor.fakeworld import FakeWorld, worker

ONE_FOR_ONE = SupervisorFlags("one_for_one", intensity=3, period=5)
ONE_FOR_ALL = SupervisorFlags("one_for_all", intensity=3, period=5)
REST_FOR_ONE = SupervisorFlags("rest_for_one", intensity=3, period=5)
SIMPLE = SupervisorFlags("simple_one_for_one", intensity=3, period=5)
SHUTDOWN_TERM = ExitReason(ExitKind.SHUTDOWN, "drained")


def world(flags: SupervisorFlags, *specs: ChildSpec) -> FakeWorld:
    return FakeWorld(flags, specs).boot()


class TestSpecValidation:
    def test_significant_permanent_child_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="significant"):
            worker("a", significant=True)

    def test_significant_child_under_auto_shutdown_never_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="auto_shutdown is never"):
            core.init_state("r", SupervisorFlags(), (worker("a", restart="transient",
                                                            significant=True),))

    def test_duplicate_child_ids_are_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="duplicate"):
            core.init_state("r", SupervisorFlags(), (worker("a"), worker("a")))

    def test_unknown_restart_type_names_the_allowed_values(self) -> None:
        with pytest.raises(InvalidSpec, match=re.escape("permanent | transient | temporary")):
            worker("a", restart="sometimes")

    def test_negative_shutdown_timeout_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="shutdown"):
            worker("a", shutdown=-1)

    def test_unknown_strategy_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="strategy"):
            SupervisorFlags("one_for_some")

    def test_negative_intensity_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="intensity"):
            SupervisorFlags(intensity=-1)

    def test_zero_period_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="period"):
            SupervisorFlags(period=0)

    def test_simple_one_for_one_needs_exactly_one_template(self) -> None:
        with pytest.raises(InvalidSpec, match="exactly one"):
            core.init_state("r", SIMPLE, (worker("a"), worker("b")))

    def test_actor_child_with_ray_restarts_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="max_restarts"):
            ActorStart(object, options={"max_restarts": -1})

    def test_id_with_a_slash_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="id"):
            worker("a/b")

    def test_defaults_follow_otp(self) -> None:
        flags = SupervisorFlags()
        sup = ChildSpec("s", SupervisorStart(flags, (worker("w"),)), type="supervisor")
        assert (flags.intensity, flags.period, flags.strategy.value) == (1, 5, "one_for_one")
        assert worker("w").shutdown_policy == Shutdown(ShutdownKind.TIMEOUT, 5.0)
        assert sup.shutdown_policy.kind is ShutdownKind.INFINITY

    def test_supervisor_start_requires_supervisor_type(self) -> None:
        with pytest.raises(InvalidSpec, match="type"):
            ChildSpec("s", SupervisorStart(SupervisorFlags(), ()))

    def test_bad_factory_path_is_rejected(self) -> None:
        with pytest.raises(InvalidSpec, match="module:attr"):
            InProcessStart("no_colon_here")


class TestBootAndShutdown:
    def test_children_start_in_order(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"), worker("b"), worker("c"))
        assert [c for c, _ in w.started] == ["a", "b", "c"]
        assert set(w.alive) == {"a", "b", "c"}

    def test_shutdown_stops_children_in_reverse_order(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"), worker("b"), worker("c"))
        w.call(lambda ref: ShutdownCall(ref))
        assert w.stopped == ["c", "b", "a"]
        assert w.alive == {} and w.terminated is not None

    def test_failed_start_at_boot_aborts_boot_and_stops_started_children(self) -> None:
        w = FakeWorld(ONE_FOR_ONE, (worker("a"), worker("b"), worker("c")))
        w.fail_starts["b"] = 1
        w.boot()
        assert [c for c, _ in w.started] == ["a"]
        assert w.stopped == ["a"] and w.alive == {}
        assert w.terminated is not None and "failed_to_start_child b" in w.terminated.detail
        assert w.terminated.offender == "root/b"

    def test_failed_start_at_boot_does_not_count_as_restart(self) -> None:
        w = FakeWorld(ONE_FOR_ONE, (worker("a"),))
        w.fail_starts["a"] = 1
        w.boot()
        assert w.state.restarts == () and w.reported(EventKind.RESTART) == []


class TestOneForOne:
    def test_crashed_permanent_child_is_restarted_alone(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"), worker("b"))
        w.crash("a")
        assert w.alive == {"a": 2, "b": 1}

    def test_permanent_child_is_restarted_after_normal_exit(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.exit_normally("a")
        assert w.alive == {"a": 2}

    def test_transient_child_is_not_restarted_after_normal_exit(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", restart="transient"), worker("b"))
        w.exit_normally("a")
        assert w.alive == {"b": 1} and w.status("a") is ChildStatus.UNDEFINED

    def test_transient_child_is_not_restarted_after_shutdown_with_term(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", restart="transient"))
        w.crash("a", SHUTDOWN_TERM)
        assert w.alive == {}

    def test_transient_child_is_restarted_after_abnormal_exit(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", restart="transient"))
        w.crash("a")
        assert w.alive == {"a": 2}

    def test_temporary_child_is_never_restarted_and_is_forgotten(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", restart="temporary"), worker("b"))
        w.crash("a")
        assert w.alive == {"b": 1} and "a" not in w.state.children

    def test_exceeding_intensity_stops_all_children_and_fails(self) -> None:
        w = world(SupervisorFlags(intensity=1, period=5), worker("a"), worker("b"))
        w.crash("a")
        w.clock.advance(1)
        w.crash("a")
        assert w.alive == {} and w.stopped == ["b"]
        assert w.terminated is not None
        assert "reached_max_restart_intensity" in w.terminated.detail
        assert w.terminated.offender == "root/a"
        assert len(w.reported(EventKind.ESCALATION)) == 1

    def test_restarts_older_than_period_do_not_count(self) -> None:
        w = world(SupervisorFlags(intensity=1, period=5), worker("a"))
        w.crash("a")
        w.clock.advance(5.01)
        w.crash("a")
        assert w.alive == {"a": 3} and w.terminated is None

    def test_restart_at_exactly_period_still_counts(self) -> None:
        w = world(SupervisorFlags(intensity=1, period=5), worker("a"))
        w.crash("a")
        w.clock.advance(5)
        w.crash("a")
        assert w.terminated is not None

    def test_zero_intensity_fails_on_first_crash(self) -> None:
        w = world(SupervisorFlags(intensity=0), worker("a"))
        w.crash("a")
        assert w.alive == {} and w.terminated is not None

    def test_failed_restart_is_retried_and_counts_against_intensity(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.fail_starts["a"] = 1
        w.crash("a")
        assert w.alive == {"a": 3}
        assert len(w.state.restarts) == 2
        assert len(w.reported(EventKind.START_ERROR)) == 1

    def test_child_failing_every_restart_exhausts_intensity(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"), worker("b"))
        w.fail_starts["a"] = -1
        w.crash("a")
        assert w.alive == {} and w.terminated is not None
        assert w.terminated.offender == "root/a"
        assert len(w.reported(EventKind.START_ERROR)) == ONE_FOR_ONE.intensity

    def test_exit_of_a_stale_incarnation_is_ignored(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.crash("a")
        w.feed(core.ChildExited("a", 1, ExitReason(ExitKind.ERROR, "late")))
        assert w.alive == {"a": 2} and len(w.state.restarts) == 1


class TestOneForAll:
    def test_crash_restarts_every_child(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("b"), worker("c"))
        w.crash("b")
        assert w.alive == {"a": 2, "b": 2, "c": 2}

    def test_siblings_are_stopped_in_reverse_order_then_started_in_order(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("b"), worker("c"))
        w.started.clear()
        w.crash("a")
        assert w.stopped == ["c", "b"]
        assert [c for c, _ in w.started] == ["a", "b", "c"]

    def test_temporary_sibling_is_terminated_and_not_restarted(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("t", restart="temporary"))
        w.crash("a")
        assert w.alive == {"a": 2} and "t" not in w.state.children

    def test_transient_sibling_is_restarted_though_it_was_shut_down(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("t", restart="transient"))
        w.crash("a")
        assert w.alive == {"a": 2, "t": 2}

    def test_sibling_terminated_by_the_api_is_restarted_too(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("b"))
        w.call(lambda ref: TerminateChildCall(ref, "b"))
        w.crash("a")
        assert w.alive == {"a": 2, "b": 2}

    def test_normal_exit_of_transient_child_restarts_nobody(self) -> None:
        w = world(ONE_FOR_ALL, worker("a", restart="transient"), worker("b"))
        w.exit_normally("a")
        assert w.alive == {"b": 1}

    def test_failed_sibling_start_retries_the_whole_group(self) -> None:
        w = world(ONE_FOR_ALL, worker("a"), worker("b"), worker("c"))
        w.fail_starts["b"] = 1
        w.crash("a")
        assert w.alive == {"a": 3, "b": 3, "c": 2}
        assert len(w.state.restarts) == 2


class TestRestForOne:
    def test_crash_restarts_the_child_and_those_after_it(self) -> None:
        w = world(REST_FOR_ONE, worker("a"), worker("b"), worker("c"))
        w.crash("b")
        assert w.alive == {"a": 1, "b": 2, "c": 2}

    def test_later_children_stop_in_reverse_then_start_in_order(self) -> None:
        w = world(REST_FOR_ONE, worker("a"), worker("b"), worker("c"), worker("d"))
        w.started.clear()
        w.crash("b")
        assert w.stopped == ["d", "c"]
        assert [c for c, _ in w.started] == ["b", "c", "d"]

    def test_crash_of_last_child_restarts_only_it(self) -> None:
        w = world(REST_FOR_ONE, worker("a"), worker("b"))
        w.crash("b")
        assert w.alive == {"a": 1, "b": 2}

    def test_temporary_later_child_is_not_restarted(self) -> None:
        w = world(REST_FOR_ONE, worker("a"), worker("t", restart="temporary"))
        w.crash("a")
        assert w.alive == {"a": 2} and "t" not in w.state.children


class TestSimpleOneForOne:
    def test_no_child_starts_at_boot(self) -> None:
        w = world(SIMPLE, worker("w"))
        assert w.alive == {} and w.state.template is not None

    def test_start_child_creates_instances_with_their_args(self) -> None:
        w = world(SIMPLE, worker("w"))
        r1 = w.call(lambda ref: StartChildCall(ref, args=(1,)))
        r2 = w.call(lambda ref: StartChildCall(ref, args=(2,)))
        assert (r1.ok, r2.ok) == (True, True)
        assert set(w.alive) == {r1.value, r2.value}
        assert w.state.children[r2.value].args == (2,)

    def test_crash_restarts_only_that_instance(self) -> None:
        w = world(SIMPLE, worker("w"))
        a = w.call(lambda ref: StartChildCall(ref, args=())).value
        b = w.call(lambda ref: StartChildCall(ref, args=())).value
        w.crash(a)
        assert w.alive == {a: 2, b: 1}

    def test_temporary_instance_is_removed_after_exit(self) -> None:
        w = world(SIMPLE, worker("w", restart="temporary"))
        a = w.call(lambda ref: StartChildCall(ref, args=())).value
        w.crash(a)
        assert w.alive == {} and w.state.children == {}

    def test_transient_instance_is_removed_after_normal_exit(self) -> None:
        w = world(SIMPLE, worker("w", restart="transient"))
        a = w.call(lambda ref: StartChildCall(ref, args=())).value
        w.exit_normally(a)
        assert w.state.children == {}

    def test_terminate_child_by_template_id_is_refused(self) -> None:
        w = world(SIMPLE, worker("w"))
        assert w.call(lambda ref: TerminateChildCall(ref, "w")).value == "simple_one_for_one"

    def test_terminate_child_by_instance_removes_it(self) -> None:
        w = world(SIMPLE, worker("w"))
        a = w.call(lambda ref: StartChildCall(ref, args=())).value
        assert w.call(lambda ref: TerminateChildCall(ref, a)).ok
        assert w.alive == {} and a not in w.state.children

    def test_restart_and_delete_child_are_refused(self) -> None:
        w = world(SIMPLE, worker("w"))
        a = w.call(lambda ref: StartChildCall(ref, args=())).value
        assert w.call(lambda ref: RestartChildCall(ref, a)).value == "simple_one_for_one"
        assert w.call(lambda ref: DeleteChildCall(ref, a)).value == "simple_one_for_one"

    def test_shutdown_stops_all_instances_at_once(self) -> None:
        w = world(SIMPLE, worker("w"))
        for _ in range(3):
            w.call(lambda ref: StartChildCall(ref, args=()))
        w.call(lambda ref: ShutdownCall(ref))
        assert len(w.stop_batches) == 1 and len(w.stop_batches[0]) == 3 and w.alive == {}

    def test_count_children_counts_instances(self) -> None:
        w = world(SIMPLE, worker("w"))
        for _ in range(3):
            w.call(lambda ref: StartChildCall(ref, args=()))
        assert core.count_children(w.state) == {"specs": 1, "active": 3, "supervisors": 0,
                                                "workers": 3}


class TestDynamicApi:
    def test_start_child_of_a_running_id_is_already_started(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        assert w.call(lambda ref: StartChildCall(ref, worker("a"))).value == "already_started"

    def test_start_child_of_a_terminated_id_is_already_present(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.call(lambda ref: TerminateChildCall(ref, "a"))
        assert w.call(lambda ref: StartChildCall(ref, worker("a"))).value == "already_present"

    def test_start_child_appends_to_the_start_order(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        assert w.call(lambda ref: StartChildCall(ref, worker("b"))).ok
        w.call(lambda ref: ShutdownCall(ref))
        assert w.stopped == ["b", "a"]

    def test_failed_start_child_is_not_kept(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.fail_starts["b"] = 1
        reply = w.call(lambda ref: StartChildCall(ref, worker("b")))
        assert not reply.ok and "b" not in w.state.children

    def test_terminate_child_keeps_the_spec_for_restart_child(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.call(lambda ref: TerminateChildCall(ref, "a"))
        assert w.alive == {} and w.status("a") is ChildStatus.UNDEFINED
        assert w.call(lambda ref: RestartChildCall(ref, "a")).ok
        assert w.alive == {"a": 2}

    def test_terminate_child_of_a_temporary_child_forgets_it(self) -> None:
        w = world(ONE_FOR_ONE, worker("t", restart="temporary"))
        w.call(lambda ref: TerminateChildCall(ref, "t"))
        assert "t" not in w.state.children

    def test_terminated_child_is_not_counted_as_a_restart(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.call(lambda ref: TerminateChildCall(ref, "a"))
        assert w.state.restarts == () and w.terminated is None

    def test_restart_child_of_a_running_child_is_refused(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        assert w.call(lambda ref: RestartChildCall(ref, "a")).value == "running"

    def test_delete_child_of_a_running_child_is_refused(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        assert w.call(lambda ref: DeleteChildCall(ref, "a")).value == "running"

    def test_delete_child_after_terminate_removes_the_spec(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.call(lambda ref: TerminateChildCall(ref, "a"))
        assert w.call(lambda ref: DeleteChildCall(ref, "a")).ok
        assert "a" not in w.state.children

    def test_unknown_child_is_not_found(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        for make in (TerminateChildCall, RestartChildCall, DeleteChildCall):
            assert w.call(lambda ref, m=make: m(ref, "zz")).value == "not_found"

    def test_restart_child_while_restarting_is_refused(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.fail_starts["a"] = 1
        inc = w.alive.pop("a")
        decision = core.decide(w.state, core.ChildExited("a", inc, ExitReason(ExitKind.ERROR)),
                               w.clock.monotonic())
        w.state = decision.state
        start = next(a for a in decision.actions if isinstance(a, core.Start))
        w.state = core.decide(w.state, core.StartFailed("a", start.incarnation, "x",
                                                         core.Context.RESTART), 0).state
        assert w.call(lambda ref: RestartChildCall(ref, "a")).value == "restarting"
        assert w.call(lambda ref: DeleteChildCall(ref, "a")).value == "restarting"

    def test_which_and_count_children(self) -> None:
        sub = ChildSpec("s", SupervisorStart(SupervisorFlags(), ()), type="supervisor")
        w = world(ONE_FOR_ONE, worker("a"), sub)
        w.call(lambda ref: TerminateChildCall(ref, "a"))
        rows = core.which_children(w.state)
        assert [(r.id, r.status) for r in rows] == [("a", ChildStatus.UNDEFINED),
                                                   ("s", ChildStatus.RUNNING)]
        assert core.count_children(w.state) == {"specs": 2, "active": 1, "supervisors": 1,
                                                "workers": 1}

    def test_calls_after_termination_are_refused(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.call(lambda ref: ShutdownCall(ref))
        assert w.call(lambda ref: StartChildCall(ref, worker("b"))).value == "terminated"


class TestAutoShutdown:
    def flags(self, mode: str) -> SupervisorFlags:
        return SupervisorFlags(intensity=3, auto_shutdown=mode)

    def test_any_significant_shuts_down_when_one_ends_normally(self) -> None:
        w = world(self.flags("any_significant"), worker("a"),
                  worker("s", restart="transient", significant=True))
        w.exit_normally("s")
        assert w.alive == {} and w.terminated is not None
        assert w.terminated.detail == "auto_shutdown" and w.terminated.is_normal

    def test_significant_transient_crash_is_restarted_not_shut_down(self) -> None:
        w = world(self.flags("any_significant"),
                  worker("s", restart="transient", significant=True))
        w.crash("s")
        assert w.alive == {"s": 2} and w.terminated is None

    def test_significant_temporary_crash_shuts_down(self) -> None:
        w = world(self.flags("any_significant"),
                  worker("s", restart="temporary", significant=True))
        w.crash("s")
        assert w.terminated is not None

    def test_all_significant_waits_for_the_last_one(self) -> None:
        w = world(self.flags("all_significant"), worker("a"),
                  worker("s1", restart="transient", significant=True),
                  worker("s2", restart="transient", significant=True))
        w.exit_normally("s1")
        assert w.terminated is None and set(w.alive) == {"a", "s2"}
        w.exit_normally("s2")
        assert w.terminated is not None and w.alive == {}

    def test_terminate_child_of_significant_child_does_not_shut_down(self) -> None:
        w = world(self.flags("any_significant"),
                  worker("s", restart="transient", significant=True))
        w.call(lambda ref: TerminateChildCall(ref, "s"))
        assert w.terminated is None

    def test_insignificant_child_ending_does_not_shut_down(self) -> None:
        w = world(self.flags("any_significant"), worker("a", restart="transient"),
                  worker("s", restart="transient", significant=True))
        w.exit_normally("a")
        assert w.terminated is None


class TestShutdownErrors:
    def test_child_killed_after_its_timeout_is_reported(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", shutdown=1.0))
        w.stop_reason["a"] = ExitReason(ExitKind.KILLED)
        w.call(lambda ref: ShutdownCall(ref))
        assert [r.child_id for r in w.reported(EventKind.SHUTDOWN_ERROR)] == ["a"]

    def test_brutally_killed_child_is_not_reported(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", shutdown="brutal_kill"))
        w.call(lambda ref: ShutdownCall(ref))
        assert w.reported(EventKind.SHUTDOWN_ERROR) == []

    def test_permanent_child_ending_normally_on_shutdown_is_reported(self) -> None:
        w = world(ONE_FOR_ONE, worker("a"))
        w.stop_reason["a"] = ExitReason(ExitKind.NORMAL)
        w.call(lambda ref: ShutdownCall(ref))
        assert len(w.reported(EventKind.SHUTDOWN_ERROR)) == 1

    def test_transient_child_ending_normally_on_shutdown_is_fine(self) -> None:
        w = world(ONE_FOR_ONE, worker("a", restart="transient"))
        w.stop_reason["a"] = ExitReason(ExitKind.NORMAL)
        w.call(lambda ref: ShutdownCall(ref))
        assert w.reported(EventKind.SHUTDOWN_ERROR) == []


class TestEscalation:
    def test_escalation_reason_names_the_leaf_through_nested_supervisors(self) -> None:
        inner = world(SupervisorFlags(intensity=0), worker("bad"))
        inner.crash("bad", ExitReason(ExitKind.ERROR, "RuntimeError: boom"))
        assert inner.terminated is not None
        outer = FakeWorld(SupervisorFlags(intensity=0), (worker("inner"),), path="root").boot()
        outer.crash("inner", inner.terminated)
        assert outer.terminated is not None
        assert outer.terminated.chain == ("root/inner", "root/bad")
        assert outer.terminated.root_offender == "root/bad"
        assert "RuntimeError: boom" in str(outer.terminated)

    def test_supervisor_exit_after_escalation_restarts_it_as_a_permanent_child(self) -> None:
        outer = world(SupervisorFlags(intensity=1), worker("inner"))
        escalated = ExitReason(ExitKind.SHUTDOWN, "reached_max_restart_intensity",
                               offender="root/inner/bad")
        outer.crash("inner", escalated)
        assert outer.alive == {"inner": 2} and outer.terminated is None


class TestPurity:
    def test_same_input_gives_same_decision(self) -> None:
        state = core.init_state("r", ONE_FOR_ALL, (worker("a"), worker("b")))
        booted = core.decide(state, core.Boot(), 0.0)
        assert booted == core.decide(state, core.Boot(), 0.0)
        assert state.phase is core.Phase.NEW  # the input state is untouched
