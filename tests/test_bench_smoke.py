"""Every benchmark script runs at its smallest size in CI, so a change that breaks one fails
here instead of on the next person to measure with it.

A script is a file under ``bench/`` (``bench/gpu/`` included) with a ``__main__`` block.
Each is run as a user would, ``python bench/<script> --smoke``, in a subprocess: it must exit
0 and its last line must be one JSON object.  Scripts whose own test already runs them at
their smallest size are listed in :data:`ELSEWHERE` with that test and the flag it passes; the
listing is checked against the test's text, so a test that stops running its script (or a
script nobody runs) fails here.  A new script gets no pass for being new: it is found by the
glob and run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

BENCH = REPO / "bench"
# script -> (the test that smoke-runs it, the flag that test passes for the smallest size)
ELSEWHERE = {
    "algorithms.py": ("test_bench_algorithms.py", "--smoke"),
    "checkpoint.py": ("test_bench_checkpoint.py", "--smoke"),
    "engine_restart.py": ("test_bench_engine_restart.py", "--smoke"),
    "goodput_control.py": ("test_bench_goodput_control.py", "--smoke"),
    "jit_cache.py": ("test_bench_jit_cache.py", "--smoke"),
    "kv_overhead.py": ("test_bench_replay.py", "--smoke"),
    "learner_scale.py": ("test_bench_learner_scale.py", "--smoke"),
    "loop_lag.py": ("test_bench_loop_lag.py", "--quick"),
    "replay.py": ("test_bench_replay.py", "--smoke"),
    "storage.py": ("test_bench_storage.py", "--smoke"),
    "supervision_frozen.py": ("test_bench_supervision.py", "--frozen-runs"),
    "telemetry.py": ("test_bench_telemetry.py", "--smoke"),
    "verify.py": ("test_bench_verify.py", "--smoke"),
    "gpu/lane.py": ("test_bench_gpu_lane.py", "--size"),
    "gpu/megatron_parity.py": ("test_bench_megatron_parity.py", "--cpu-check"),
}


def scripts(root: Path = BENCH) -> list[str]:
    """Every benchmark script under ``root``, relative to it: a ``.py`` file with a
    ``__main__`` block (helpers such as ``runstats.py`` have none)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if "__main__" in p.read_text(encoding="utf-8"))


def last_json(stdout: str) -> dict[str, object]:
    """The last line of ``stdout`` as a JSON object; raises ValueError otherwise."""
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("printed nothing")
    value = json.loads(lines[-1])
    if not isinstance(value, dict):
        raise ValueError(f"last line is {type(value).__name__}, not a JSON object")
    return value


def test_the_glob_finds_the_scripts_and_not_the_helpers() -> None:
    found = scripts()
    assert {"replay.py", "engine_restart.py", "gpu/lane.py"} <= set(found)
    assert "runstats.py" not in found
    assert set(ELSEWHERE) <= set(found), set(ELSEWHERE) - set(found)


@pytest.mark.parametrize("bad", ["", "| a | table |\n", '{"a": 1}\n| table after |', "[1, 2]"])
def test_last_json_refuses_output_without_a_final_json_object(bad: str) -> None:
    with pytest.raises(ValueError):
        last_json(bad)
    assert last_json('| table |\n{"ok": true}\n') == {"ok": True}


@pytest.mark.parametrize("script", sorted(ELSEWHERE))
def test_scripts_run_elsewhere_are_run_there(script: str) -> None:
    test, flag = ELSEWHERE[script]
    text = (REPO / "tests" / test).read_text(encoding="utf-8")
    assert Path(script).stem in text and flag in text, (script, test, flag)


@pytest.mark.parametrize("script", [s for s in scripts() if s not in ELSEWHERE])
def test_the_smallest_run_exits_0_and_ends_in_a_json_line(script: str) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, f"{script}: exit {done.returncode}\n{done.stderr[-3000:]}"
    last_json(done.stdout)
