"""Failpoints: each action, each trigger rule, start-up arming through the environment, and
remote arming of an actor child and of a host with an in-process child.

Everything but the last scenario runs without Ray.  ``exit`` and start-up arming run in a
subprocess, so the test process itself never dies.  Delays are checked by recording what the
failpoint asked to sleep, not by the clock.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from erlay.supervisor import failpoints
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import (
    KNOWN,
    FailpointError,
    FailpointSpec,
    afailpoint,
    arm,
    armed,
    disarm,
    disarm_all,
    failpoint,
    fired,
    hits,
)
from tests.paths import REPO

ROOT = REPO
POINT = "sandbox.exec"


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    disarm_all()
    failpoints._LAST.clear()
    yield
    disarm_all()
    failpoints._LAST.clear()


def pattern(n: int) -> list[bool]:
    """Which of ``n`` calls of POINT raised."""
    out = []
    for _ in range(n):
        try:
            failpoint(POINT)
            out.append(False)
        except FailpointError:
            out.append(True)
    return out


def run_python(code: str, env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(failpoints.ENV_VAR, None)
    if env_value is not None:
        env[failpoints.ENV_VAR] = env_value
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


# -------------------------------------------------------------------------- actions
def test_disarmed_failpoint_does_nothing_and_counts_nothing() -> None:
    for name in KNOWN:
        failpoint(name)
    assert armed() == {} and hits(POINT) == 0


def test_raise_action_raises_a_failpoint_error_naming_the_point() -> None:
    arm(POINT, "raise")
    with pytest.raises(FailpointError, match=r"failpoint sandbox\.exec fired") as err:
        failpoint(POINT)
    assert err.value.name == POINT and isinstance(err.value, ErlayError)
    failpoint("judge.score")  # other points stay quiet


def test_failpoint_error_survives_pickling_with_its_name() -> None:
    copy = pickle.loads(pickle.dumps(FailpointError(POINT)))
    assert type(copy) is FailpointError and copy.name == POINT and str(copy).endswith("fired")


def test_delay_action_sleeps_its_delay_then_continues(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    arm(POINT, "delay", delay_s=0.25)
    failpoint(POINT)
    assert slept == [0.25]


def test_hang_blocks_the_caller_until_disarmed_from_another_thread() -> None:
    arm(POINT, "hang")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (failpoint(POINT), done.set()), daemon=True)
    worker.start()
    assert not done.wait(0.2), "a hung failpoint returned while still armed"
    assert disarm(POINT) is True
    assert done.wait(10), "disarm did not release the hang"


def test_rearming_releases_a_hang_of_the_earlier_arming() -> None:
    arm(POINT, "hang")
    done = threading.Event()
    threading.Thread(target=lambda: (failpoint(POINT), done.set()), daemon=True).start()
    assert not done.wait(0.1)
    arm(POINT, "raise", count=1)
    assert done.wait(10)


def test_exit_action_ends_the_process_with_its_exit_code() -> None:
    code = ("from supervisor import failpoints as f\n"
            "f.arm('host.spawn', 'exit', exit_code=7)\n"
            "f.failpoint('host.spawn')\n"
            "print('survived')\n")
    result = run_python(code, None)
    assert result.returncode == 7 and "survived" not in result.stdout


# ---------------------------------------------------------------------------- rules
def test_nth_fires_on_that_hit_only() -> None:
    arm(POINT, "raise", nth=3)
    assert pattern(6) == [False, False, True, False, False, False]
    assert hits(POINT) == 6 and fired(POINT) == 1


def test_count_fires_at_most_that_many_times() -> None:
    arm(POINT, "raise", count=2)
    assert pattern(5) == [True, True, False, False, False]
    assert fired(POINT) == 2


def test_probability_with_a_seed_fires_on_the_draws_of_that_seed() -> None:
    rng = random.Random(11)
    expected = [rng.random() < 0.3 for _ in range(200)]
    arm(POINT, "raise", probability=0.3, seed=11)
    first = pattern(200)
    arm(POINT, "raise", probability=0.3, seed=11)
    assert first == expected == pattern(200)
    assert 0 < sum(first) < 200


def test_probability_zero_never_fires_and_one_always_fires() -> None:
    arm(POINT, "raise", probability=0.0)
    assert not any(pattern(50))
    arm(POINT, "raise", probability=1.0)
    assert all(pattern(50))


def test_probability_with_count_fires_on_the_first_lucky_draws_then_stops() -> None:
    rng = random.Random(5)
    lucky = [i for i in range(100) if rng.random() < 0.5][:3]
    arm(POINT, "raise", probability=0.5, count=3, seed=5)
    assert [i for i, f in enumerate(pattern(100)) if f] == lucky


def test_nth_with_probability_one_fires_on_the_nth_hit() -> None:
    arm(POINT, "raise", nth=2, probability=1.0)
    assert pattern(4) == [False, True, False, False]


# ------------------------------------------------------------------ arming and state
def test_disarm_stops_firing_and_keeps_the_hit_count_until_rearmed() -> None:
    arm(POINT, "raise")
    pattern(3)
    assert disarm(POINT) is True and disarm(POINT) is False
    assert pattern(2) == [False, False]
    assert hits(POINT) == 3 and armed() == {}
    arm(POINT, "delay")
    assert hits(POINT) == 0


def test_disarm_all_disarms_every_point() -> None:
    arm(POINT, "raise")
    arm("judge.score", "raise")
    disarm_all()
    failpoint(POINT)
    failpoint("judge.score")
    assert armed() == {}


def test_armed_lists_the_specs_by_name() -> None:
    spec = arm("judge.score", "delay", delay_s=0.5, count=2)
    assert armed() == {"judge.score": spec}
    assert spec == FailpointSpec(failpoints.Action.DELAY, count=2, delay_s=0.5)


def test_unknown_name_is_refused_with_the_known_ones_unless_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown failpoint 'sandbox\.exce'.*sandbox\.exec"):
        arm("sandbox.exce", "raise")
    arm("user.point", "raise", allow_unknown=True)
    with pytest.raises(FailpointError):
        failpoint("user.point")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"action": "explode"}, "action"),
    ({"action": "raise", "probability": 1.5}, "probability"),
    ({"action": "raise", "probability": -0.1}, "probability"),
    ({"action": "raise", "nth": 0}, "nth"),
    ({"action": "raise", "count": 0}, "count"),
    ({"action": "delay", "delay_s": -1}, "delay_s"),
    ({"action": "exit", "exit_code": 300}, "exit_code"),
    ({"action": "raise", "seed": "x"}, "seed"),
])
def test_invalid_spec_raises_a_value_error_naming_the_field(kwargs: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        FailpointSpec.from_dict(kwargs)


def test_spec_dict_with_an_unknown_field_or_no_action_is_refused() -> None:
    with pytest.raises(ValueError, match=r"spec: expected only the fields.*'probabilty'"):
        FailpointSpec.from_dict({"action": "raise", "probabilty": 0.5})
    with pytest.raises(ValueError, match="action: missing"):
        FailpointSpec.from_dict({"count": 1})


def test_spec_round_trips_through_its_dict() -> None:
    spec = FailpointSpec.from_dict({"action": "exit", "probability": 0.25, "count": 3, "nth": 2,
                                    "exit_code": 9, "seed": 4})
    assert FailpointSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["action"] == "exit"


def test_control_arms_lists_and_disarms_and_reports_hits() -> None:
    report = failpoints.control("arm", POINT, {"action": "raise", "count": 1})
    assert report["armed"] == {POINT: FailpointSpec.from_dict({"action": "raise",
                                                              "count": 1}).to_dict()}
    assert pattern(2) == [True, False]
    report = failpoints.control("list")
    assert report["hits"][POINT] == 2 and report["fired"][POINT] == 1
    assert report["pid"] == os.getpid()
    assert failpoints.control("disarm", POINT)["armed"] == {}
    with pytest.raises(ValueError, match="op: expected"):
        failpoints.control("explode")


# ------------------------------------------------------------------------ environment
def test_env_arms_a_new_process_before_its_first_failpoint() -> None:
    value = failpoints.env_value({"sandbox.exec": {"action": "exit", "exit_code": 5}})
    result = run_python("from erlay.supervisor.failpoints import failpoint\n"
                        "failpoint('sandbox.exec')\nprint('survived')\n", value)
    assert result.returncode == 5 and "survived" not in result.stdout


def test_env_raise_with_nth_fires_on_that_hit_in_the_new_process() -> None:
    value = failpoints.env_value({"judge.score": FailpointSpec(failpoints.Action.RAISE, nth=2)})
    result = run_python("from erlay.supervisor.failpoints import failpoint\n"
                        "failpoint('judge.score')\nprint('first ok', flush=True)\n"
                        "failpoint('judge.score')\nprint('second ok')\n", value)
    assert result.returncode == 1 and "first ok" in result.stdout
    assert "second ok" not in result.stdout
    assert "FailpointError: failpoint judge.score fired" in result.stderr


def test_malformed_env_fails_at_import_naming_the_variable() -> None:
    result = run_python("import erlay.supervisor.failpoints\n",
                        '{"sandbox.exec": {"action": "raise", "nth": 0}}')
    assert result.returncode == 1
    assert "ValueError: ERLAY_FAILPOINTS: nth: expected an integer >= 1" in result.stderr


def test_env_value_refuses_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.env_value({"no.such": {"action": "raise"}})


# ------------------------------------------------------------------------------ async
def test_async_raise_raises_in_the_awaiting_task() -> None:
    arm("generation.decode_step", "raise")
    with pytest.raises(FailpointError, match=r"generation\.decode_step"):
        asyncio.run(afailpoint("generation.decode_step"))


def test_async_delay_sleeps_its_delay_in_the_task(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def record(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(failpoints.asyncio, "sleep", record)
    arm("judge.score", "delay", delay_s=1.5)
    asyncio.run(afailpoint("judge.score"))
    assert slept == [1.5]


def test_async_hang_stalls_only_its_task_until_disarmed_from_another_task() -> None:
    async def scenario() -> int:
        arm("generation.decode_step", "hang")
        hung = asyncio.create_task(afailpoint("generation.decode_step"))
        ticks = 0
        for _ in range(10):  # the loop keeps serving other coroutines meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not hung.done()
        disarm("generation.decode_step")
        await asyncio.wait_for(hung, 10)
        return ticks

    assert asyncio.run(scenario()) == 10


def test_async_hang_is_released_by_a_disarm_from_another_thread() -> None:
    async def scenario() -> None:
        arm("generation.decode_step", "hang")
        hung = asyncio.create_task(afailpoint("generation.decode_step"))
        await asyncio.sleep(0.05)
        assert not hung.done()
        await asyncio.to_thread(disarm, "generation.decode_step")
        await asyncio.wait_for(hung, 10)

    asyncio.run(scenario())


# ------------------------------------------------------------------------ call sites
def test_host_spawn_failpoint_fails_the_start_of_a_hosted_child() -> None:
    from erlay.supervisor.errors import ChildStartError
    from erlay.supervisor.host import NodeHost
    from erlay.supervisor.spec import ChildSpec, InProcessStart, SupervisorFlags
    from tests.supervisor.children import Echo

    def host(path: str) -> NodeHost:
        return NodeHost(SupervisorFlags(), (ChildSpec("echo", InProcessStart(Echo)),),
                        erlay_path=path)

    async def scenario() -> int:
        arm("host.spawn", "raise", count=1)
        with pytest.raises(ChildStartError, match=r"failpoint host\.spawn fired"):
            await host("h1").erlay_ready()  # a start failure at boot aborts the boot
        healthy = host("h2")  # count=1 is spent: the next host boots
        await healthy.erlay_ready()
        try:
            return int(await healthy.call("echo", "ping", (3,)))
        finally:
            await healthy.erlay_terminate()

    assert asyncio.run(scenario()) == 3
    assert fired("host.spawn") == 1


# -------------------------------------------------------------------------------- Ray
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_remote_arming_fails_an_actor_child_and_a_hosted_child_until_disarmed() -> None:
    import ray

    from erlay.supervisor.host import host_spec
    from erlay.supervisor.raylocal import local_node_id
    from erlay.supervisor.spec import (
        ActorStart,
        ChildSpec,
        InProcessStart,
        SupervisorFlags,
        SupervisorStart,
    )
    from erlay.supervisor.tree import SupervisionTree
    from tests.conftest import wait_for
    from tests.supervisor.children import FaultPoint

    flags = SupervisorFlags("one_for_one", intensity=5, period=10)
    hosted = (ChildSpec("worker", InProcessStart(FaultPoint, args=(POINT,))),)
    tree = SupervisionTree("tf", flags, [
        ChildSpec("engine", ActorStart(FaultPoint, args=("generation.decode_step",))),
        ChildSpec("pool", SupervisorStart(flags, (host_spec("n0", flags, hosted,
                                                            node_id=local_node_id()),)),
                  type="supervisor"),
    ]).start()
    try:
        engine, host = tree.ref("tf/engine"), tree.ref("tf/pool/host@n0")
        spec = {"action": "raise"}
        # An actor child: arming acts in its own process only.
        report = ray.get(engine.actor._erlay_failpoints.remote("arm", "generation.decode_step",
                                                              spec))
        assert set(report["armed"]) == {"generation.decode_step"}
        with pytest.raises(FailpointError, match=r"generation\.decode_step"):
            ray.get(engine.hit.remote(1))
        assert ray.get(host.call.remote("worker", "hit", (2,))) == 2  # another process
        ray.get(engine.actor._erlay_failpoints.remote("disarm", "generation.decode_step"))
        assert ray.get(engine.hit.remote(3)) == 3

        # A host: arming it arms the in-process children that share its process.
        report = ray.get(host.actor._erlay_failpoints.remote("arm", POINT, spec))
        assert report["pid"] == ray.get(host.ping.remote())
        with pytest.raises(FailpointError, match=re.escape(POINT)):
            ray.get(host.call.remote("worker", "hit", (4,)))
        report = ray.get(host.actor._erlay_failpoints.remote("disarm_all"))
        assert report["armed"] == {} and report["fired"][POINT] >= 1
        # The failure crashed the hosted child; once restarted it serves normally again.
        assert wait_for(lambda: ray.get(host.call.remote("worker", "hit", (5,))) == 5, 20,
                        what="the hosted child serving again")
    finally:
        tree.stop()
