"""Chaos scenarios load whole or fail naming the key; their schedule is pure and bounded."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from erlay.chaos.scenario import (
    ATTACKS,
    INVARIANTS,
    ROOT,
    SCENARIO_DIR,
    Attack,
    FaultSpec,
    Scenario,
    ScenarioError,
    list_scenarios,
    load_scenario,
    schedule,
)

REQUIRED = ("engine-kill", "learner-kill", "sandbox-worker-kill", "judge-fault",
            "coordinator-crash", "sandbox-attacks", "mixed-soak", "kill-during-weight-update",
            "engine-hang", "sandbox-host-lost", "node-loss", "driver-kill-resume",
            "crash-loop", "engine-kill-replay")
# The generation domain's smoke scenario is engine-kill-replay (synchronous, with its
# fault-free baseline, so replay_identical PASSes in CI); engine-kill runs with --all.
SMOKE = {"engine-kill-replay", "learner-kill", "judge-user-freeze", "env-user-freeze",
         "coordinator-crash", "crash-loop", "host-sigstop"}
LEARNER_KILL = {"inject": "sigkill", "target": "erlay/learner/learner-0", "at": 1}


def write(tmp_path: Path, **fields: Any) -> Path:
    """A scenario file: a valid minimal one, with ``fields`` replacing its keys."""
    data: dict[str, Any] = {"description": "test", "config": "configs/cpu.yaml",
                            "duration_s": 60, "faults": [LEARNER_KILL]}
    data.update(fields)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fault(**fields: Any) -> FaultSpec:
    return FaultSpec.model_validate({"inject": "sigkill", "target": "erlay/learner/learner-0",
                                     **fields})


# ------------------------------------------------------------------- shipped files
@pytest.mark.parametrize("path", sorted(SCENARIO_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert scenario.description.strip()
    assert scenario.schedule() or scenario.step_schedule(), "a shipped scenario must inject"


def test_every_required_scenario_is_shipped() -> None:
    assert set(REQUIRED) <= {p.stem for p in SCENARIO_DIR.glob("*.yaml")}


def test_list_scenarios_gives_name_description_and_smoke_flag() -> None:
    listed = list_scenarios()
    assert [name for name, _, _ in listed] == sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
    assert all(description for _, description, _ in listed)
    assert {name for name, _, smoke in listed if smoke} == SMOKE


def test_smoke_scenarios_are_short() -> None:
    for name in SMOKE:
        scenario = load_scenario(name)
        assert scenario.duration_s <= 90
        # 30 steps of the CPU job take ~15 s: long enough that a fault at step 2 is
        # detected (a heartbeat deadline of 3 s) before the job ends, short enough for CI.
        assert scenario.job_config().run.steps <= 30


def test_smoke_faults_that_need_a_running_step_are_timed_by_steps() -> None:
    # A fast machine finishes 8 RL steps in a few seconds: a fault timed in seconds can
    # arrive after the job ended, so the smoke faults into running work use at_step.
    for name in SMOKE:
        scenario = load_scenario(name)
        for spec in scenario.faults:
            if spec.params.get("during") is not None:
                assert spec.at_step is not None, (name, spec)


def test_mixed_soak_fires_about_every_20_s_rotating_over_the_domains() -> None:
    scenario = load_scenario("mixed-soak")
    firings = scenario.schedule()
    gaps = {round(b[0] - a[0], 6) for a, b in itertools.pairwise(firings)}
    assert gaps == {20.0}
    domains = [scenario.faults[i].domain for _, i in firings[:5]]
    assert sorted(domains) == ["generation", "judge", "learner", "rollout", "sandbox"]
    assert set(scenario.baselines) == {"fault_free", "job_restart"}


def test_crash_loop_expects_an_escalation_with_an_engine_offender() -> None:
    scenario = load_scenario("crash-loop")
    assert scenario.expect == "escalation" and scenario.offender == "erlay/generation*"
    assert [f.expect for f in scenario.faults] == ["escalation"]


def test_a_bare_name_is_looked_up_in_the_scenario_dir() -> None:
    assert load_scenario("engine-kill") == load_scenario(SCENARIO_DIR / "engine-kill.yaml")


def test_an_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(ScenarioError, match=r"unknown chaos scenario 'engine-kil'.*"
                                            r"did you mean 'engine-kill'"):
        load_scenario("engine-kil")


def test_attack_payloads_cover_every_attack_kind_and_compile() -> None:
    assert set(ATTACKS) == set(get_args(Attack))
    for name, source in ATTACKS.items():
        compile(source, name, "exec")


def test_invariant_names_match_the_invariant_checks() -> None:
    from erlay.chaos.invariants import INVARIANTS as CHECKED
    assert set(INVARIANTS) == set(CHECKED)


def test_root_matches_the_job_tree() -> None:
    from erlay.actors.job.driver import ROOT as JOB_ROOT
    assert ROOT == JOB_ROOT


# -------------------------------------------------------------------- bad scenarios
@pytest.mark.parametrize(("fields", "message"), [
    ({"faluts": []}, r"faluts: unknown key .*did you mean 'faults'"),
    ({"faults": [{**LEARNER_KILL, "inject": "sigkil"}]},
     r"faults\.0\.inject: expected .*'sigkill'.* \(given 'sigkil'\); did you mean 'sigkill'"),
    ({"faults": [{**LEARNER_KILL, "every": 5, "count": {"max": 2}}]},
     r"faults\.0\.every: expected exactly one timing of at, at_step, every, random; given "
     r"at and every"),
    ({"faults": [{**LEARNER_KILL, "at": None, "at_step": 8}], "overrides": ["run.steps=8"]},
     r"faults\.0\.at_step: expected fewer than run\.steps \(8\).*given 8"),
    ({"faults": [{**LEARNER_KILL, "at": None, "at_step": 2, "start": 1}]},
     r"faults\.0\.start: expected no start with at_step"),
    ({"faults": [{**LEARNER_KILL, "at": None, "at_step": 0}]},
     r"faults\.0\.at_step: .*greater than or equal to 1"),
    ({"faults": [{"inject": "sandbox_attack", "target": "erlay/sandbox/host@node-0", "at": 1}]},
     r"faults\.0\.params\.attack: required key is missing \(expected one of 'endless_loop'"),
    ({"faults": [{"inject": "sandbox_attack", "target": "erlay/sandbox/host@node-0", "at": 1,
                  "params": {"attack": "fork_bom"}}]},
     r"faults\.0\.params\.attack: expected .*\(given 'fork_bom'\); did you mean 'fork_bomb'"),
    ({"faults": [{"inject": "failpoint", "target": "judge.scor", "at": 1,
                  "params": {"spec": {"action": "raise"}}}]},
     r"faults\.0\.target: expected a failpoint name.*given 'judge\.scor'.*'judge\.score'"),
    ({"faults": [{"inject": "failpoint", "target": "judge.score", "at": 1,
                  "params": {"spec": {"action": "explode"}}}]},
     r"faults\.0\.params\.spec: expected a failpoint spec \(action: .*'explode'"),
    ({"overrides": ["run.stpes=3"]},
     r"overrides: expected overrides the job config accepts: run\.stpes: unknown key"),
    ({"config": "configs/nope.yaml"},
     r"config: expected an existing job config file.*given 'configs/nope\.yaml'"),
    ({"faults": [{**LEARNER_KILL, "at": None, "every": 20, "count": {"min": 5, "max": 9}}]},
     r"faults\.0\.count\.min: count\.min 5 cannot fit in duration 60 s: every 20 s"),
    ({"faults": [{**LEARNER_KILL, "at": None, "every": 20}]},
     r"faults\.0\.count\.max: required with every and random"),
    ({"faults": [{**LEARNER_KILL, "at": 60}]}, r"faults\.0\.at: .*it never fires"),
    ({"faults": [{**LEARNER_KILL, "target": "erlay/generation/engine-3"}]},
     r"faults\.0\.target: expected a child of the job's tree.*given 'erlay/generation/engine-3'"),
    ({"faults": [{**LEARNER_KILL, "target": "erlay/rollout/coordinator"}]},
     r"faults\.0\.target: expected a child of erlay/learner or"),
    ({"faults": [{"inject": "sigstop", "target": "erlay/generation/engine-0", "at": 1}]},
     r"faults\.0\.params\.stop_s: required key is missing \(expected a number or null\)"),
    ({"faults": [{"inject": "sigstop", "target": "erlay/generation/engine-0", "at": 1,
                  "params": {"stop_s": None, "process": "checkpoint_writer"}}]},
     r"faults\.0\.params\.process: expected a learner rank as the target"),
    ({"faults": [{"inject": "node_loss", "target": "worker-1", "at": 1}]},
     r"faults\.0\.inject: expected multinode"),
    ({"faults": [{"inject": "failpoint", "target": "judge.score", "at": 1,
                  "params": {"spec": {"action": "raise"}, "in": "erlay/learner/learner-0"}}]},
     r"faults\.0\.params\.in: expected a child of erlay/judge"),
    ({"faults": [{"inject": "failpoint", "target": "judge.score", "at": 2,
                  "params": {"spec": {"action": "raise"}, "scope": "env"}}]},
     r"faults\.0\.at: expected 0: scope env"),
    ({"faults": [{**LEARNER_KILL, "params": {"during": "tool_call"}}]},
     r"faults\.0\.params\.during: expected a phase of that domain, one of train_step"),
    ({"expect": "escalation"}, r"expect: expected a fault with expect: escalation"),
    ({"offender": "erlay/*"}, r"offender: expected only with expect: escalation"),
    ({"invariants": ["no_orphan"]}, r"invariants\.0: .*did you mean 'no_orphans'"),
    ({"smoke": True, "duration_s": 120}, r"duration_s: expected at most 90 s"),
    ({"faults": []}, r"faults: expected at least one fault"),
])
def test_a_bad_scenario_names_the_file_and_the_key(tmp_path: Path, fields: dict[str, Any],
                                                    message: str) -> None:
    path = write(tmp_path, **fields)
    with pytest.raises(ScenarioError, match=message) as caught:
        load_scenario(path)
    assert str(caught.value).startswith(f"{path}: invalid chaos scenario")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, duration_s=-1, faults=[{**LEARNER_KILL, "count": {"min": 3,
                                                                            "max": 2}}])
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert [p.split(":")[0] for p in caught.value.problems] == ["duration_s",
                                                                "faults.0.count.max"]


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"scenario file not found: .*nope\.yaml"):
        load_scenario(tmp_path / "nope.yaml")


def test_a_scenario_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ScenarioError, match="expected a mapping"):
        load_scenario(path)


# ------------------------------------------------------------------------ defaults
@pytest.mark.parametrize(("spec", "expect"), [
    ({"inject": "sigkill"}, "restart"),
    ({"inject": "ray_kill"}, "restart"),
    ({"inject": "sigstop", "params": {"stop_s": None}}, "restart"),
    ({"inject": "sigstop", "params": {"stop_s": 1.0}}, "absorbed"),
    ({"inject": "sigstop", "params": {"stop_s": None, "process": "checkpoint_writer"}},
     "absorbed"),
    ({"inject": "failpoint", "target": "learner.train_step",
      "params": {"spec": {"action": "exit"}}}, "restart"),
    ({"inject": "failpoint", "target": "learner.checkpoint",
      "params": {"spec": {"action": "delay", "delay_s": 2}}}, "absorbed"),
    ({"inject": "sandbox_attack", "target": "erlay/sandbox/host@node-0",
      "params": {"attack": "fork_bomb"}}, "absorbed"),
    ({"inject": "judge_fault", "target": "erlay/judge/host@node-0",
      "params": {"mode": "garbage"}}, "absorbed"),
    ({"inject": "judge_fault", "target": "erlay/judge/host@node-0",
      "params": {"mode": "raise"}}, "restart"),
    ({"inject": "slow_checkpoint", "params": {"delay_s": 3}}, "absorbed"),
])
def test_expect_defaults_by_inject(spec: dict[str, Any], expect: str) -> None:
    assert fault(at=1, **spec).expect == expect


def test_driver_kill_targets_the_driver_by_default() -> None:
    spec = FaultSpec.model_validate({"inject": "driver_kill", "at": 5})
    assert spec.target == "driver" and spec.domain == "driver"


def test_a_failpoint_fault_gives_its_spec_and_domain() -> None:
    spec = fault(inject="failpoint", target="generation.weight_update", at=0,
                 params={"spec": {"action": "exit", "nth": 2}})
    assert spec.failpoint_spec().nth == 2
    assert spec.domain == "generation" and spec.params["scope"] == "remote"


def test_a_scenario_is_frozen() -> None:
    scenario = load_scenario("engine-kill")
    with pytest.raises(Exception, match="frozen"):
        scenario.duration_s = 1  # type: ignore[misc]
    assert isinstance(scenario, Scenario)


# ------------------------------------------------------------------------ schedule
def test_at_fires_once_and_is_skipped_past_the_duration() -> None:
    assert schedule([fault(at=5), fault(at=70)], 60) == [(5.0, 0)]


def test_at_step_is_not_on_the_clock_but_in_the_step_schedule(tmp_path: Path) -> None:
    assert schedule([fault(at_step=3), fault(at=5)], 60) == [(5.0, 1)]
    scenario = load_scenario(write(tmp_path, faults=[
        {**LEARNER_KILL, "at": None, "at_step": 5}, {**LEARNER_KILL, "at": None, "at_step": 2},
        LEARNER_KILL]))
    assert scenario.step_schedule() == [(2, 1), (5, 0)]
    assert scenario.schedule() == [(1.0, 2)]


def test_every_fires_from_its_period_up_to_count_max() -> None:
    assert schedule([fault(every=10, count={"max": 3})], 60) == [(10.0, 0), (20.0, 0),
                                                                 (30.0, 0)]


def test_every_stops_before_the_duration() -> None:
    times = [t for t, _ in schedule([fault(every=10, count={"max": 100})], 60)]
    assert times == [10.0, 20.0, 30.0, 40.0, 50.0]


def test_every_with_start_is_phase_shifted() -> None:
    times = [t for t, _ in schedule([fault(every=100, start=20, count={"max": 9})], 300)]
    assert times == [20.0, 120.0, 220.0]


def test_random_is_reproducible_for_a_seed_and_bounded() -> None:
    spec = fault(random={"rate_per_s": 0.5, "seed": 7}, count={"max": 20})
    first = schedule([spec], 30)
    assert first == schedule([spec], 30)
    assert 0 < len(first) <= 20
    assert all(0 < t < 30 for t, _ in first)
    other = fault(random={"rate_per_s": 0.5, "seed": 8}, count={"max": 20})
    assert schedule([other], 30) != first


def test_random_stops_at_count_max() -> None:
    spec = fault(random={"rate_per_s": 10.0, "seed": 1}, count={"max": 4})
    assert len(schedule([spec], 60)) == 4


def test_firings_of_several_faults_are_sorted_by_time_then_index() -> None:
    faults = [fault(every=10, count={"max": 3}), fault(at=10), fault(at=5)]
    assert schedule(faults, 60) == [(5.0, 2), (10.0, 0), (10.0, 1), (20.0, 0), (30.0, 0)]


def test_an_unsatisfiable_count_min_names_the_fault() -> None:
    faults = [fault(at=1), fault(every=20, count={"min": 5, "max": 9})]
    with pytest.raises(ScenarioError, match=r"faults\.1\.count\.min: count\.min 5 cannot fit "
                                            r"in duration 60 s"):
        schedule(faults, 60)


# ------------------------------------------------------------- faults nobody scripted
def test_user_error_targets_a_plugin_and_defaults_to_absorbed() -> None:
    spec = FaultSpec.model_validate({"inject": "user_error", "target": "judge", "at": 1,
                                     "params": {"mode": "hang", "count": 2}})
    assert spec.expect == "absorbed" and spec.domain == "judge"
    assert FaultSpec.model_validate({"inject": "user_error", "target": "environment", "at": 1,
                                     "params": {"mode": "raise"}}).domain == "environment"
    freeze = FaultSpec.model_validate({"inject": "user_error", "target": "environment",
                                       "at": 1, "params": {"mode": "freeze", "count": 1}})
    assert freeze.expect == "absorbed" and freeze.params["freeze_s"] == 300.0
    with pytest.raises(ValueError, match="environment, judge"):
        FaultSpec.model_validate({"inject": "user_error", "target": "sandbox", "at": 1,
                                  "params": {"mode": "raise"}})


def test_delay_and_partial_validate_their_params() -> None:
    delay = FaultSpec.model_validate({"inject": "delay", "target": "erlay/generation/engine-0",
                                      "at": 1, "params": {"delay_s": 0.1}})
    assert delay.expect == "absorbed" and delay.params["site"] is None
    with pytest.raises(ValueError, match="failpoint name"):
        FaultSpec.model_validate({"inject": "delay", "target": "erlay/learner/learner-0",
                                  "at": 1, "params": {"delay_s": 0.1, "site": "nope"}})
    with pytest.raises(ValueError, match="fraction"):
        FaultSpec.model_validate({"inject": "partial", "target": "erlay/judge/host@*", "at": 1,
                                  "params": {"fraction": 1.5}})


def test_a_repeating_fault_owes_its_count_min_firings_and_no_more() -> None:
    from erlay.chaos.runner import unfired
    soak = load_scenario("mixed-soak")        # every fault: count.min 1, up to 3 firings
    engine = 0
    # The job ended after the first firing of fault 0: the other two were extras.
    assert unfired(soak, [engine, engine], []) == []
    # It ended before the first: the one owed firing never came.
    missed = unfired(soak, [engine, engine, engine], [])
    assert len(missed) == 3 and all(m.startswith("faults.0 ") for m in missed)
    kill = load_scenario("learner-kill")       # at_step: always owed
    assert unfired(kill, [], [0]) == [
        "faults.0 (sigkill erlay/learner/learner-0): never fired, the job ended first"]
