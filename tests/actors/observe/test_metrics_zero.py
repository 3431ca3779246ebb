"""Every counter erlay exports exists from the job's start, at 0, for each of its known label
sets, so dashboards show 0 instead of "no data" in the quiet times.  No Ray here: the label
sets against their sources, the Ray path through stand-in instruments that refuse
``inc(0)`` as Ray's Counter does, and the OpenTelemetry path through the real file exporter.
The Prometheus scrape of the zeros is in test_metrics.py (real Ray)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.config import TelemetrySection
from erlay.actors.job.rollout import judge_failure_kind
from erlay.actors.observe import metrics as ray_metrics
from erlay.actors.observe.attribution import DOMAINS
from erlay.actors.observe.metrics import (
    COUNTERS,
    JUDGE_FAILURE_KINDS,
    RESTART_CAUSES,
    SANDBOX_OUTCOME_KINDS,
    RayMetrics,
    zero_series,
)
from erlay.actors.observe.telemetry import JobTelemetry
from erlay.judges.base import USER_ERROR_KINDS
from erlay.sandbox.results import Outcome
from erlay.supervisor.reason import ExitKind


def test_the_label_sets_are_their_sources() -> None:
    assert tuple(o.value for o in Outcome) == SANDBOX_OUTCOME_KINDS
    failures = {k.value for k in ExitKind} - {"normal", "shutdown"}
    assert set(RESTART_CAUSES) == failures | {"start_error"}
    runner_kinds = {judge_failure_kind(r) for r in ("timeout", "circuit open", "error", "?")}
    assert runner_kinds | set(USER_ERROR_KINDS) | {"unavailable"} <= set(JUDGE_FAILURE_KINDS)
    series = zero_series(DOMAINS)
    assert {name for name, _ in series} == set(COUNTERS)
    assert len(series) == 4 + 6 * 5 + 6 + 9 + 8 and len({repr(s) for s in series}) == len(series)


class RayLikeCounter:
    """Refuses ``inc(0)`` like Ray 2.60's Counter; ``_record`` is the unchecked point."""

    def __init__(self, name: str, points: list[tuple[str, float, dict[str, str]]]) -> None:
        self.name, self.points = name, points

    def inc(self, value: float, tags: dict[str, str]) -> None:
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")
        self.points.append((self.name, value, tags))

    def _record(self, value: float, tags: dict[str, str]) -> None:
        self.points.append((self.name, value, tags))


def test_ray_counters_get_a_zero_point_for_every_label_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    points: list[tuple[str, float, dict[str, str]]] = []
    fields = ray_metrics._Instruments.__dataclass_fields__
    instruments = ray_metrics._Instruments(**{f: RayLikeCounter(f, points) for f in fields})
    monkeypatch.setattr(ray_metrics, "_STATE", ray_metrics._ProcessState())
    monkeypatch.setattr(ray_metrics, "_build_instruments", lambda: instruments)
    metrics = RayMetrics("r")
    metrics.export_zeros(DOMAINS)
    assert metrics.enabled  # nothing was refused
    want = [(name, 0.0, {"run": "r", **tags}) for name, tags in zero_series(DOMAINS)]
    assert sorted(points, key=repr) == sorted(want, key=repr)
    assert ("restarts", 0.0, {"run": "r", "domain": "judge", "cause": "hang"}) in points
    metrics.restart("judge", "hang")  # a later event adds to the zero
    assert points[-1] == ("restarts", 1.0, {"run": "r", "domain": "judge", "cause": "hang"})


def exported(path: Path) -> dict[str, list[tuple[dict[str, Any], float]]]:
    """Counter name -> (attributes, value) of every data point in the file exporter's
    output (the last export of each series wins)."""
    out: dict[str, dict[str, tuple[dict[str, Any], float]]] = {}
    for line in path.read_text().splitlines():
        for resource in json.loads(line)["resource_metrics"]:
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    for point in metric["data"].get("data_points", []):
                        attrs = point.get("attributes") or {}
                        out.setdefault(metric["name"], {})[repr(sorted(attrs.items()))] = (
                            attrs, point.get("value"))
    return {name: list(points.values()) for name, points in out.items()}


def test_opentelemetry_counters_are_exported_at_zero_before_any_event(tmp_path: Path) -> None:
    hub = JobTelemetry(TelemetrySection(exporter="file", ray_metrics=False), tmp_path, "t")
    hub.start()
    hub.close()  # flushes: one export with nothing but the start-up zeros
    (path,) = (tmp_path / "telemetry").glob("metrics-*.jsonl")
    got = exported(path)
    restarts = got["erlay.restarts"]
    assert len(restarts) == len(DOMAINS) * len(RESTART_CAUSES)
    assert all(value == 0 for _, value in restarts)
    assert {a["domain"] for a, _ in restarts} == set(DOMAINS)
    assert sorted(a["kind"] for a, _ in got["erlay.sandbox.outcomes"]) == \
        sorted(SANDBOX_OUTCOME_KINDS)
    assert len(got["erlay.judge.failures"]) == len(JUDGE_FAILURE_KINDS)
    assert [v for _, v in got["erlay.time_lost"]] == [0] * len(DOMAINS)
    assert [v for _, v in got["erlay.rollouts"]] == [0]
