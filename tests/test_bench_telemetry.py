"""bench/telemetry.py: its CPU accounting on planted sampler records, and its smallest run.

Each pure function is shown a case it must refuse or count differently: a sampler that saw
no engine, a job without RL steps, Ray's own processes, a process born inside the window, a
planted 5% of extra CPU per sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import telemetry as bench
from tests.paths import REPO

DRIVER = 100


def line(t: float, **cpu: tuple[str, float]) -> dict[str, object]:
    return {"t": t, "cpu": {pid.lstrip("p"): [role, c] for pid, (role, c) in cpu.items()}}


def job(extra: float = 0.0) -> list[dict[str, object]]:
    """Sampler lines of a job whose RL window is [10, 20]: driver, engine, learner, Ray."""
    return [line(t, p100=("driver", 1 + t * (0.5 + extra)), p7=("TorchEngine", t * 0.3),
                 p8=("Learner", t * 0.2), p9=("ray", t * 5.0))
            for t in (8.0, 10.0, 12.0, 16.0, 20.0, 22.0)]


STEPS = [{"started_at": 0.0, "time": 12.0, "step_s": 2.0, "samples": 50},
         {"started_at": 0.0, "time": 20.0, "step_s": 8.0, "samples": 50}]


@pytest.mark.parametrize(("title", "pid", "ancestors", "role"), [
    ("python bench/telemetry.py", DRIVER, set(), "driver"),
    ("/venv/bin/raylet --node", 5, set(), "ray"),
    ("ray::IDLE", 5, set(), "ray"),
    ("ray::DashboardAgent", 5, set(), "ray"),
    ("ray::TorchEngine.generate_batch()", 5, set(), "TorchEngine"),
    ("ray::erlay/generation/spare-1:TorchEngine", 5, set(), "TorchEngine (spare)"),
    ("ray::Learner", 5, set(), "Learner"),
    ("python -m erlay.sandbox.worker", 5, {4}, "children"),
    ("vim notes.md", 5, set(), None),
])
def test_roles_from_process_titles(title: str, pid: int, ancestors: set[int],
                                   role: str | None) -> None:
    assert bench.role_of(title, pid, DRIVER, ancestors) == role


def test_cpu_is_interpolated_to_the_window_edges() -> None:
    series = [(0.0, 0.0), (2.0, 1.0), (4.0, 3.0)]
    assert bench.cpu_at(series, 1.0) == pytest.approx(0.5)
    assert bench.cpu_at(series, 3.0) == pytest.approx(2.0)
    assert bench.cpu_at(series, 9.0) == 3.0     # after its last sample: its last value
    assert bench.cpu_at(series, -1.0) == 0.0    # before it was seen
    assert bench.cpu_at([], 1.0) == 0.0


def test_the_window_holds_each_roles_cpu_and_ray_is_apart() -> None:
    by_role = bench.cpu_by_role(job(), 10.0, 20.0)
    assert by_role["driver"] == pytest.approx(5.0)
    assert by_role["TorchEngine"] == pytest.approx(3.0)
    assert by_role["Learner"] == pytest.approx(2.0)
    assert by_role["ray"] == pytest.approx(50.0)
    assert bench.job_cpu(by_role) == pytest.approx(10.0)   # Ray's 50 s left out


def test_a_process_born_inside_the_window_counts_from_zero() -> None:
    lines = [line(10.0), line(14.0, p5=("children", 1.0)), line(20.0, p5=("children", 3.0)),
             line(22.0, p5=("children", 4.0), p6=("children", 9.0))]
    # p5 born inside counts from 0; p6, born after the window's end, counts nothing.
    assert bench.cpu_by_role(lines, 10.0, 20.0)["children"] == pytest.approx(3.0)


def test_the_rl_window_is_wall_clock_from_the_jobs_start() -> None:
    steps = [{**s, "started_at": 1000.0} for s in STEPS]
    assert bench.rl_window(steps) == (1010.0, 1020.0, 100)
    with pytest.raises(bench.Unmeasured):
        bench.rl_window([])


@pytest.mark.parametrize("lines", [
    [],                                                                 # an empty file
    [line(t, p100=("driver", t)) for t in (8.0, 12.0, 22.0)],          # only the driver
    [line(t, p100=("driver", t), p7=("TorchEngine", t), p9=("ray", t))
     for t in (8.0, 22.0)],                                             # no learner
    [line(t, p100=("driver", 1.0), p7=("TorchEngine", 1.0), p8=("Learner", 1.0))
     for t in (8.0, 22.0)],                                             # nothing spent
])
def test_a_sampler_that_missed_a_needed_role_is_refused(lines: list[dict[str, object]]) -> None:
    with pytest.raises(bench.Unmeasured):
        bench.measure(lines, STEPS, telemetry=True)


def test_a_planted_five_percent_shows_as_1_05() -> None:
    off = bench.measure(job(), STEPS, telemetry=False)
    # 0.05 more driver CPU per second, over 10 s = 0.5 s on the 10 s the job spent: 5%.
    on = bench.measure(job(extra=0.05), STEPS, telemetry=True)
    figures = bench.pair_ratios([(off, on), (off, on), (off, off)])
    assert figures["telemetry_cpu_overhead"]["median"] == pytest.approx(1.05)
    assert figures["telemetry_cpu_overhead"]["min"] == pytest.approx(1.0)
    assert figures["extra_cpu_us_per_sample_by_role"]["driver"]["median"] == pytest.approx(5000)
    assert figures["telemetry_overhead"]["median"] == pytest.approx(1.0)
    with pytest.raises(bench.Unmeasured):
        bench.pair_ratios([])


def test_the_smallest_run_measures_every_process_of_the_job() -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "telemetry.py"), "--smoke"],
                          cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    roles = out["extra_cpu_us_per_sample_by_role"]
    assert {"driver", "Learner", "TorchEngine", "NodeHost", "ray"} <= set(roles), roles
    assert out["cpu_ms_per_sample_off"]["median"] > 0
    assert out["cpu_ms_per_sample_on"]["median"] > 0
    assert out["telemetry_spans_per_job"] > 0     # the on-job traced; the off-job did not
    assert out["telemetry_cpu_overhead"]["runs"] == 1


def test_the_profile_names_telemetrys_entry_points_and_skips_imports_and_waits() -> None:
    raw = "\n".join([
        "main (a.py:1);step (erlay/actors/observe/telemetry.py:300);"
        "record (opentelemetry/metrics/_internal/instrument.py:321) 30",
        "main (a.py:1);decode (engine.py:5) 60",
        "<module> (x.py:1);<module> (erlay/supervisor/telemetry.py:30) 500",     # an import
        "_run (erlay/supervisor/telemetry.py:146);Event.wait (threading.py:629) 900",
        "main (a.py:1);span (erlay/supervisor/telemetry.py:280) 10",
    ])
    costs = bench.profile_costs({"driver": [raw]})["driver"]
    assert costs["samples"] == 100
    assert costs["telemetry_share"] == 0.4
    assert costs["top"] == {"step (observe/telemetry.py)": 30, "span (supervisor/telemetry.py)": 10}
