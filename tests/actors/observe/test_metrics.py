"""RayMetrics: recorded from the driver, scraped from the node's Prometheus endpoint."""

from __future__ import annotations

import logging
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from erlay.actors.observe import metrics as ray_metrics
from erlay.actors.observe.metrics import EXPORT_PREFIX, RayMetrics

# Ray exports every metrics_report_interval_ms; 1 s (its floor) keeps the test short.
REPORT_INTERVAL_MS = 1000


@pytest.fixture(scope="module")
def ray_fast_metrics() -> Iterator[int]:
    """A local Ray (no dashboard UI; its metrics agent still runs) exporting every second.

    Yields the node's metrics export port."""
    import ray

    from erlay.supervisor.raylocal import ensure_ray, shutdown_ray
    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=2, include_dashboard=False,
               system_config={"metrics_report_interval_ms": REPORT_INTERVAL_MS})
    port = int(ray.nodes()[0]["MetricsExportPort"])
    assert port == ray._private.worker.global_worker.node.metrics_export_port
    yield port
    shutdown_ray()


Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, run: str) -> Series:
    """The erlay samples of ``run`` on the endpoint: (name, sorted erlay tags) -> value.

    Ray's own labels (SessionName, WorkerId, ...) are dropped; ``run`` is kept."""
    from prometheus_client.parser import text_string_to_metric_families
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    ours = {"run", "domain", "cause", "kind", "le"}
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(EXPORT_PREFIX + "erlay_"):
                continue
            if sample.labels.get("run") != run:
                continue
            tags = tuple(sorted((k, v) for k, v in sample.labels.items() if k in ours))
            series[(sample.name, tags)] = sample.value
    return series


def key(name: str, run: str, **tags: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (EXPORT_PREFIX + name, tuple(sorted({"run": run, **tags}.items())))


def wait_for_series(port: int, run: str, expected: Series, timeout: float = 60.0) -> Series:
    """Scrape until every expected series has its expected value (exports are periodic)."""
    deadline = time.monotonic() + timeout
    seen: Series = {}
    while time.monotonic() < deadline:
        seen = scrape(port, run)
        if all(seen.get(k) == pytest.approx(v) for k, v in expected.items()):
            return seen
        time.sleep(0.5)
    missing = {k: (v, seen.get(k)) for k, v in expected.items()
               if seen.get(k) != pytest.approx(v)}
    raise AssertionError(f"series not exported as expected (want, got): {missing}")


@pytest.mark.ray
def test_every_metric_recorded_by_the_driver_reaches_prometheus(ray_fast_metrics: int) -> None:
    run = f"metrics-{uuid.uuid4().hex[:8]}"
    other = f"{run}-other"
    metrics, other_metrics = RayMetrics(run), RayMetrics(other)
    metrics.rollouts(5)
    metrics.rollouts(3)
    other_metrics.rollouts(2)
    metrics.tokens(120)
    metrics.generation_latency(0.003)
    # A step's latencies in one call (the driver's path); the non-finite and negative dropped.
    metrics.generation_latencies([0.2, 7.0, float("nan"), -1.0, 200.0])
    metrics.restart("generation", "crash")
    metrics.restart("generation", "crash")
    metrics.restart("sandbox", "hang")
    metrics.sandbox_outcome("ok", 2)       # a step's worth at once, as the hub exports them
    metrics.sandbox_outcome("timeout")
    metrics.judge_failure("timeout")
    metrics.time_lost(1.5, "generation")
    metrics.time_lost(2.0, "generation")
    metrics.goodput(42.5)
    metrics.time_efficiency(0.75)
    metrics.rollouts_per_s(12.5)
    metrics.tokens_per_s(300.0)
    assert metrics.enabled

    lat = "erlay_generation_latency_seconds"
    expected: Series = {
        key("erlay_rollouts_total", run): 8,
        key("erlay_generated_tokens_total", run): 120,
        key(f"{lat}_count", run): 4,
        key(f"{lat}_bucket", run, le="0.005"): 1,   # 0.003
        key(f"{lat}_bucket", run, le="0.25"): 2,    # + 0.2
        key(f"{lat}_bucket", run, le="10.0"): 3,    # + 7.0
        key(f"{lat}_bucket", run, le="120.0"): 3,   # 200 s is above the last boundary
        key(f"{lat}_bucket", run, le="+Inf"): 4,
        key("erlay_restarts_total", run, domain="generation", cause="crash"): 2,
        key("erlay_restarts_total", run, domain="sandbox", cause="hang"): 1,
        key("erlay_sandbox_outcomes_total", run, kind="ok"): 2,
        key("erlay_sandbox_outcomes_total", run, kind="timeout"): 1,
        key("erlay_judge_failures_total", run, kind="timeout"): 1,
        key("erlay_time_lost_seconds_total", run, domain="generation"): 3.5,
        key("erlay_goodput_tokens_per_second", run): 42.5,
        key("erlay_time_efficiency_ratio", run): 0.75,
        key("erlay_rollouts_per_second", run): 12.5,
        key("erlay_tokens_per_second", run): 300.0,
    }
    # Gauges are set once here, and Ray stops exporting a gauge that is not set again for
    # ~20 s, so they are checked in the same scrape as the counters.  ``_sum`` is not
    # checked: Ray 2.60 rebuilds it from bucket midpoints, so it is not 207.203.
    seen = wait_for_series(ray_fast_metrics, run, expected)
    assert key(f"{lat}_sum", run) in seen
    # The other run's counter is its own series, not added into this run's.
    wait_for_series(ray_fast_metrics, other, {key("erlay_rollouts_total", other): 2})


@pytest.mark.ray
def test_every_counter_is_at_zero_in_prometheus_before_its_first_event(
        ray_fast_metrics: int) -> None:
    from erlay.actors.observe.attribution import DOMAINS
    from erlay.actors.observe.metrics import COUNTERS, zero_series
    run = f"zeros-{uuid.uuid4().hex[:8]}"
    metrics = RayMetrics(run)
    metrics.export_zeros(DOMAINS)
    zeros: Series = {key(COUNTERS[name], run, **tags): 0.0
                     for name, tags in zero_series(DOMAINS)}
    wait_for_series(ray_fast_metrics, run, zeros)
    metrics.restart("judge", "hang")  # an event adds to its series' zero
    wait_for_series(ray_fast_metrics, run, {
        key("erlay_restarts_total", run, domain="judge", cause="hang"): 1.0,
        key("erlay_restarts_total", run, domain="judge", cause="lost"): 0.0})


class FakeInstrument:
    """Stands in for a Ray instrument; records (method, value, tags)."""

    def __init__(self, calls: list[tuple[str, float, dict[str, str]]]) -> None:
        self.calls = calls

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("observe", value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))


@pytest.fixture
def fake_instruments(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    """Fresh process state whose instruments record into the returned list."""
    calls: list[tuple[str, float, dict[str, str]]] = []
    fields = ray_metrics._Instruments.__dataclass_fields__
    instruments = ray_metrics._Instruments(**{f: FakeInstrument(calls) for f in fields})
    monkeypatch.setattr(ray_metrics, "_STATE", ray_metrics._ProcessState())
    monkeypatch.setattr(ray_metrics, "_build_instruments", lambda: instruments)
    return calls


def test_values_ray_would_reject_are_dropped_not_raised(
        fake_instruments: list[tuple[str, float, dict[str, Any]]]) -> None:
    metrics = RayMetrics("r")
    metrics.rollouts(0)                      # Ray's Counter.inc rejects 0
    metrics.tokens(-3)
    metrics.time_lost(float("nan"), "generation")
    metrics.generation_latency(float("inf"))
    metrics.rollouts_per_s(float("nan"))
    metrics.time_efficiency(1.7)             # clamped, not dropped
    metrics.time_efficiency(-0.2)            # clamped, not dropped
    metrics.goodput(-5.0)                    # no rate is negative
    metrics.goodput(float("inf"))
    metrics.judge_failure(404)               # type: ignore[arg-type]  # tag made a str
    assert fake_instruments == [
        ("set", 1.0, {"run": "r"}),
        ("set", 0.0, {"run": "r"}),
        ("inc", 1.0, {"run": "r", "kind": "404"}),
    ]
    assert metrics.enabled


def test_goodput_is_a_token_rate_and_time_efficiency_a_clamped_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list[tuple[str, float, dict[str, str]]]] = {}
    fields = ray_metrics._Instruments.__dataclass_fields__
    instruments = ray_metrics._Instruments(
        **{f: FakeInstrument(calls.setdefault(f, [])) for f in fields})
    monkeypatch.setattr(ray_metrics, "_STATE", ray_metrics._ProcessState())
    monkeypatch.setattr(ray_metrics, "_build_instruments", lambda: instruments)
    metrics = RayMetrics("r")
    metrics.goodput(1500.0)                  # tokens/s: far above 1 and kept as it is
    metrics.time_efficiency(0.8)
    assert calls["goodput"] == [("set", 1500.0, {"run": "r"})]
    assert calls["time_efficiency"] == [("set", 0.8, {"run": "r"})]


def test_unusable_ray_metrics_log_once_and_turn_into_no_ops(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> ray_metrics._Instruments:
        raise RuntimeError("no metrics agent")

    monkeypatch.setattr(ray_metrics, "_STATE", ray_metrics._ProcessState())
    monkeypatch.setattr(ray_metrics, "_build_instruments", broken)
    metrics = RayMetrics("r")
    with caplog.at_level(logging.WARNING, logger="erlay.ray_metrics"):
        for _ in range(3):
            metrics.rollouts(1)
            metrics.restart("generation", "crash")
            metrics.goodput(120.0)
    warnings = [r for r in caplog.records if r.name == "erlay.ray_metrics"]
    assert len(warnings) == 1 and "no metrics agent" in warnings[0].getMessage()
    assert not metrics.enabled
    assert not RayMetrics("another-run").enabled


def test_an_instrument_that_fails_when_recording_disables_metrics_quietly(
        fake_instruments: list[tuple[str, float, dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(value: float, tags: dict[str, str]) -> None:
        raise TypeError("boom")

    metrics = RayMetrics("r")
    metrics.tokens(4)
    instruments = ray_metrics._STATE.get()
    assert instruments is not None
    monkeypatch.setattr(instruments.rollouts, "inc", explode)
    metrics.rollouts(1)                      # must not raise
    metrics.tokens(4)                        # now a no-op
    assert fake_instruments == [("inc", 4.0, {"run": "r"})]
    assert not metrics.enabled
