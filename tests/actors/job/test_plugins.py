"""User code is a fault domain of its own: a failing environment fails the sample, a broken
one stops the job, and bad plug-ins are refused before anything starts."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.plugins import (
    FailureWindow,
    PluginReply,
    RateRule,
    UserError,
    run_checked,
)
from erlay.actors.job.preflight import preflight
from erlay.environments.arithmetic import ArithmeticEnv
from tests.paths import REPO

PATH = "tests.environments.faulty_env:FaultyEnv"


def checked(env: object, method: str, *args: object) -> PluginReply:
    return run_checked(env, PATH, method, args)


# -- one call, as a worker process runs it (the processes: test_env_domain.py) ------------------
def test_a_raise_in_step_fails_the_call_with_the_class_method_and_exception() -> None:
    from tests.environments.faulty_env import FaultyEnv
    env = FaultyEnv(step="raise")
    error = checked(env, "step", env.reset(0, 0), "1").error
    assert error is not None
    assert (error.plugin, error.method, error.kind) == (PATH, "step", "exception")
    assert error.detail == "ValueError: the user's step failed"
    assert "faulty_env.py" in error.traceback
    assert error.reason.startswith(f"user_error: {PATH}.step: exception: ValueError")


def test_a_bad_return_names_the_type_that_came_back() -> None:
    from tests.environments.faulty_env import FaultyEnv
    env = FaultyEnv(step="none")
    error = checked(env, "step", env.reset(0, 0), "1").error
    assert error is not None and error.kind == "bad_return"
    assert "returned NoneType, expected a (Episode, StepResult) pair" in error.detail


def test_a_value_that_cannot_be_sent_back_is_a_bad_return() -> None:
    import threading

    from erlay.environments.base import Episode
    env = ArithmeticEnv()
    episode = env.reset(0, 0)
    bad = Episode(episode.episode_id, episode.prompt, episode.answer,
                  metadata={"lock": threading.Lock()})
    reply = run_checked(type("Env", (), {"reset": lambda self, i, s: bad})(), PATH, "reset",
                        (0, 0))
    assert reply.error is not None and reply.error.kind == "bad_return"
    assert "cannot be sent back" in reply.error.detail


def test_a_well_behaved_environment_goes_through_unchanged() -> None:
    env = ArithmeticEnv()
    episode = checked(env, "reset", 3, 7).value
    after = checked(env, "step", episode, "12").value
    plain = ArithmeticEnv()
    assert episode == plain.reset(3, 7) and after == plain.step(plain.reset(3, 7), "12")


# -- the failure rate ------------------------------------------------------------------------
def fail(n: int = 0) -> UserError:
    return UserError(PATH, "step", "exception", f"ValueError: {n}", f"Traceback {n}")


def test_a_plugin_failing_every_call_trips_after_min_calls() -> None:
    window = FailureWindow(RateRule(window=40, max_rate=0.75, min_calls=16))
    trips = [window.record(fail(i)) for i in range(16)]
    assert trips == [False] * 15 + [True]
    assert window.first_failure == fail(0)


def test_a_plugin_failing_a_fifth_of_calls_at_random_never_trips() -> None:
    rng = random.Random(7)
    for rate in (0.15, 0.2):
        window = FailureWindow()
        assert not any(window.record(fail() if rng.random() < rate else None)
                       for _ in range(20_000))


# -- before anything starts -------------------------------------------------------------------
def cfg(*overrides: str) -> object:
    return load_config(REPO / "configs" / "cpu.yaml", list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["environment.class=tests.environments.custom_env:OnlyReset"],
     "does not implement the Environment protocol: missing step, observe, demonstration"),
    (["environment.kwargs={nope: 1}"], "rejects its kwargs ['nope']"),
    (["judge.class=tests.environments.custom_env:OnlyReset"],
     "does not implement the Judge protocol: missing score"),
    (["judge.kwargs={nope: 1}"], "judge.kwargs: erlay.judges.math:MathJudge rejects its kwargs"),
    (["model.max_seq_len=10"], "prompt is 7 tokens"),
    (["environment.class=tests.environments.faulty_env:FaultyEnv",
      "environment.kwargs={reset: raise}"], ".reset(0, 0) failed: ValueError"),
])
def test_preflight_refuses_bad_plugins_and_prompts_in_one_line(overrides: list[str],
                                                               message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        preflight(cfg(*overrides))  # type: ignore[arg-type]
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_preflight_passes_the_shipped_configs() -> None:
    for name in ("cpu.yaml", "tool_use.yaml"):
        preflight(load_config(REPO / "configs" / name))


def test_erlay_run_with_a_bad_plugin_exits_2_with_one_line_and_starts_nothing(
        tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "erlay.supervisor.cli", "run", "configs/cpu.yaml",
         "environment.class=tests.environments.custom_env:OnlyReset",
         f"run.storage={tmp_path}", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "missing step, observe, demonstration" in result.stderr
    assert list(tmp_path.iterdir()) == [], "no run directory before the checks pass"


def test_a_batch_size_of_zero_is_refused_before_start() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step"):
        cfg("rollout.prompts_per_step=0")
