"""What keeps telemetry cheap, checked for what it must still do: the one-pass metrics line
says what the SDK's ``to_json`` says, the percentile is numpy's nearest rank, a stalled
exporter drops and counts spans instead of blocking, and a span that records nothing is a
shared no-op."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from erlay.actors.observe.telemetry import LATENCY_BUCKETS_S, metrics_json, percentile
from erlay.supervisor import telemetry


def test_the_metrics_line_is_the_sdks_json_in_one_pass() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({"service.name": "t", "erlay.run": "r"}),
        views=[View(instrument_name="lat",
                    aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_S))])
    meter = provider.get_meter("erlay")
    counter = meter.create_counter("c", unit="1")
    counter.add(0, attributes={"domain": "sandbox", "cause": "hang"})
    counter.add(3)
    hist = meter.create_histogram("lat", unit="s")
    for v in (0.003, 0.2, 7.0, 200.0):
        hist.record(v)
    meter.create_observable_gauge("g", callbacks=[lambda _o: []])
    data = reader.get_metrics_data()
    provider.shutdown()
    line = metrics_json(data)
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert json.loads(line) == json.loads(data.to_json(indent=None))
    assert json.loads(line)["resource_metrics"][0]["scope_metrics"][0]["metrics"]


def test_the_percentile_is_numpys_nearest_rank() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 256, 999):
        values = [rng.expovariate(3.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            want = float(np.percentile(values, q, method="inverted_cdf"))
            assert percentile(values, q) == want, (n, q)
    assert percentile([], 50) is None


class _Stalled(SpanExporter):
    """An exporter stuck until released (a disk or collector that stopped answering)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.release.wait(30)
        self.exported += list(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_a_stalled_exporter_drops_and_counts_spans_and_never_blocks_the_caller() -> None:
    stalled = _Stalled()
    queue = telemetry.BoundedSpanQueue(stalled, max_queue=10, batch=4, delay_s=0.05)
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("t")
    tracer.start_span("first").end()
    deadline = time.monotonic() + 5
    while queue._queue and time.monotonic() < deadline:   # the worker took it and is stuck
        time.sleep(0.01)
    started = time.monotonic()
    for i in range(25):
        tracer.start_span(f"s{i}").end()
    assert time.monotonic() - started < 1.0       # ending a span never waits on the exporter
    assert queue.dropped == 15                    # 10 queued behind the stuck export
    stalled.release.set()
    provider.shutdown()
    assert len(stalled.exported) == 11            # the first and the 10 queued, none lost
    assert queue.dropped == 15


def test_shutdown_behind_an_exporter_that_never_returns_ends_within_its_timeout() -> None:
    stalled = _Stalled()
    queue = telemetry.BoundedSpanQueue(stalled, max_queue=10, batch=4, delay_s=0.05)
    provider = TracerProvider()
    provider.add_span_processor(queue)
    tracer = provider.get_tracer("t")
    tracer.start_span("first").end()
    deadline = time.monotonic() + 5
    while queue._queue and time.monotonic() < deadline:   # the worker took it and is stuck
        time.sleep(0.01)
    for i in range(3):
        tracer.start_span(f"s{i}").end()
    started = time.monotonic()
    queue.shutdown(timeout_s=0.5)
    assert time.monotonic() - started < 2.0
    assert queue.dropped == 3                     # the queued spans, counted, not waited for
    stalled.release.set()


def test_an_exporter_that_raises_loses_its_batch_not_the_process(
        caplog: pytest.LogCaptureFixture) -> None:
    class FailsOnce(SpanExporter):
        def __init__(self) -> None:
            self.calls, self.exported = 0, []

        def export(self, spans: Any) -> SpanExportResult:
            self.calls += 1
            if self.calls == 1:
                raise OSError("disk full")
            self.exported += [s.name for s in spans]
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass
    exporter = FailsOnce()
    provider = TracerProvider()
    provider.add_span_processor(telemetry.BoundedSpanQueue(exporter, delay_s=0.01))
    provider.get_tracer("t").start_span("lost").end()
    deadline = time.monotonic() + 5
    while exporter.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    provider.get_tracer("t").start_span("kept").end()
    provider.shutdown()
    assert exporter.exported == ["kept"]
    assert "exporting 1 spans failed" in caplog.text


def test_a_span_that_records_nothing_is_a_shared_no_op() -> None:
    telemetry.configure(telemetry.TelemetrySettings(exporter="none"), "test")
    try:
        assert telemetry.span("generate") is telemetry.span("dispatch")   # tracing off
        assert telemetry.carrier() is None
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_spans_dropped_is_zero_without_pressure(ratio: float, tmp_path: Any) -> None:
    telemetry.configure(telemetry.TelemetrySettings(exporter="file", dir=str(tmp_path),
                                                    sample_ratio=ratio), "test")
    try:
        with telemetry.span("rollout", root=True, sample_key="r00000-g000-0"):
            pass
        assert telemetry.spans_dropped() == 0
    finally:
        telemetry.shutdown()
    lines = [json.loads(x) for f in tmp_path.glob("spans-*.jsonl") for x in f.open()]
    assert [x["name"] for x in lines] == (["rollout"] if ratio else [])


def _exported(tmp_path: Any, name: str) -> dict[str, float]:
    """The last value per ``kind`` of counter ``name`` in the hub's metrics file."""
    out: dict[str, float] = {}
    for f in (tmp_path / "telemetry").glob("metrics-*.jsonl"):
        for text in f.open():
            for rm in json.loads(text)["resource_metrics"]:
                for sm in rm["scope_metrics"]:
                    for m in sm["metrics"]:
                        if m["name"] == name:
                            for p in m["data"]["data_points"]:
                                out[p["attributes"].get("kind", "")] = p["value"]
    return out


def test_per_event_counts_are_exported_with_the_step_and_at_close(tmp_path: Any) -> None:
    from erlay.actors.config import TelemetrySection
    from erlay.actors.observe.telemetry import JobTelemetry
    hub = JobTelemetry(TelemetrySection(exporter="file", ray_metrics=False,
                                        export_interval_s=60), tmp_path, "t")
    hub.start()
    try:
        for kind in ("ok", "ok", "timeout"):
            hub.sandbox_outcome(kind)
        hub.judge_failure("exception")
        hub._meter_provider.force_flush()
        assert _exported(tmp_path, "erlay.sandbox.outcomes")["ok"] == 0   # not yet: per step
        hub.step({"step": 0, "step_s": 1.0, "samples": 4, "gen_tokens": 8})
        hub.sandbox_outcome("ok")        # after the last step: exported at close
    finally:
        hub.close()
    assert _exported(tmp_path, "erlay.sandbox.outcomes")["ok"] == 3
    assert _exported(tmp_path, "erlay.sandbox.outcomes")["timeout"] == 1
    assert _exported(tmp_path, "erlay.judge.failures")["exception"] == 1
    assert hub.totals()["sandbox"] == {"ok": 3, "timeout": 1}
