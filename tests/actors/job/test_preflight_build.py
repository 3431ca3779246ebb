"""Preflight builds the plug-ins once, in a build process under plugins.build_timeout_s: a
constructor that raises, hangs or ends its process is one line and exit code 2, with nothing
started (``erlay.actors.job.preflight_build``).

The plug-ins are ``tests.environments.unbuildable_env:UnbuildableEnv`` and
``tests.judges.unbuildable_judge:UnbuildableJudge``; the config is the defaults (the built-in
character model, so no HF tokenizer load), which keeps each case near half a second in-process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.job.preflight import preflight
from tests.paths import REPO

ENV = "tests.environments.unbuildable_env:UnbuildableEnv"
JUDGE = "tests.judges.unbuildable_judge:UnbuildableJudge"

# `erlay run` in-process, then whether Ray was started in it, on stdout.
RUN_AND_SAY_IF_RAY = ("import sys; from erlay.supervisor.cli import main; rc = main(sys.argv[1:]); "
                      "ray = sys.modules.get('ray'); "
                      "print('ray started:', ray is not None and ray.is_initialized()); "
                      "sys.exit(rc)")


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        preflight(load_config(None, list(overrides)))
    line = str(caught.value)
    assert "\n" not in line, line
    return line


def erlay_run(tmp_path: Path, *overrides: str, timeout: float) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "job.yaml"
    config.write_text("{}\n", encoding="utf-8")   # the defaults
    return subprocess.run(
        [sys.executable, "-c", RUN_AND_SAY_IF_RAY, "run", str(config), *overrides,
         f"run.storage={tmp_path / 'runs'}", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_erlay_run_with_a_judge_whose_constructor_raises_exits_2_with_one_line_and_starts_nothing(
        tmp_path: Path) -> None:
    result = erlay_run(tmp_path, f"judge.class={JUDGE}", "judge.kwargs={fault: raise}",
                       timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"erlay: judge: {JUDGE}(**{{'fault': 'raise'}}) raised ValueError: the user's "
        "constructor failed"]
    assert result.stdout.strip() == "ray started: False"
    assert not (tmp_path / "runs").exists(), "no run directory before the checks pass"


def test_erlay_run_with_a_hanging_judge_constructor_exits_2_and_kills_its_build_group(
        tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # The build would sleep an hour; the subprocess timeout is the deadline plus start-up.
    result = erlay_run(tmp_path, f"judge.class={JUDGE}",
                       f"judge.kwargs={{fault: hang, pid_file: {pids}}}",
                       "plugins.build_timeout_s=2", timeout=60)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"erlay: judge: {JUDGE}(**{{'fault': 'hang'")
    assert line.endswith("did not finish within 2 s (plugins.build_timeout_s); its build "
                         "process group was killed")
    assert result.stdout.strip() == "ray started: False"
    assert not (tmp_path / "runs").exists()
    constructor, sleeper = map(int, pids.read_text().split())
    assert not alive(constructor) and not alive(sleeper), "the whole group is killed"


def test_an_environment_constructor_that_raises_is_refused_naming_class_kwargs_and_error(
        ) -> None:
    assert refusal(f"environment.class={ENV}", "environment.kwargs={fault: raise}") == (
        f"environment: {ENV}(**{{'fault': 'raise'}}) raised ValueError: the user's constructor "
        "failed")


@pytest.mark.parametrize("fault, how", [("exit", "(exit code 3)"),
                                        ("kill", "(killed by SIGKILL)")])
def test_an_environment_constructor_that_ends_its_process_is_refused_with_how(
        fault: str, how: str) -> None:
    assert refusal(f"environment.class={ENV}", f"environment.kwargs={{fault: {fault}}}") == (
        f"environment: {ENV}(**{{'fault': '{fault}'}}) ended its build process {how}")


def test_what_a_constructor_prints_cannot_pass_for_the_build_finishing() -> None:
    # It prints the build's own "done" record to stdout, then raises.
    assert refusal(f"environment.class={ENV}", "environment.kwargs={fault: print}").endswith(
        "raised ValueError: the user's constructor failed after printing")


def test_the_default_config_builds_its_plugins_and_passes() -> None:
    preflight(load_config(None, []))
