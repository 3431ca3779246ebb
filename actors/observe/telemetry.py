"""The driver's telemetry hub: one object the job and its coordinator report to.

It owns the driver's OpenTelemetry providers (:mod:`erlay.supervisor.telemetry`), the metric
instruments, their mirror as Ray application metrics (:mod:`erlay.actors.observe.metrics`, for the
dashboard and Prometheus) and the supervisor event sink that turns failures, restarts and
escalations into spans (:class:`erlay.supervisor.otel.TracingEventSink`).

Metrics (OpenTelemetry names; the Ray mirror uses ``erlay_*`` names):

- ``erlay.rollouts`` and ``erlay.generated_tokens`` (counters), ``erlay.rollouts_per_s`` and
  ``erlay.tokens_per_s`` (gauges, per RL step);
- ``erlay.generation.latency`` (histogram, seconds per generated turn) — and per step the
  p50, p99 and max in ``metrics.jsonl``;
- ``erlay.restarts`` by domain and cause; ``erlay.sandbox.outcomes`` by kind;
  ``erlay.judge.failures`` by kind;
- ``erlay.time_lost`` (seconds, by domain) and ``erlay.time_efficiency`` (gauge, 0..1);
- ``erlay.goodput`` (gauge, tokens/s, per RL step).

Goodput is erlay's one definition (:mod:`erlay.actors.observe.goodput`): the step record's
``trained_tokens`` over its ``step_s``.  Time lost to failures is measured per RL step
(:func:`step_time_lost`): a step during which a child was restarted lost whatever it took
beyond the median of the steps without one.  Time efficiency is the share of the RL wall time
so far not lost that way; it is not goodput.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from erlay.actors.config import TelemetrySection
from erlay.actors.observe.attribution import DOMAINS
from erlay.actors.observe.goodput import goodput as goodput_of
from erlay.actors.observe.metrics import zero_series
from erlay.supervisor import telemetry
from erlay.supervisor.otel import TracingEventSink

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData

log = logging.getLogger("erlay.telemetry")

# A latency histogram that resolves a 5 ms decode step and a 2-minute stuck turn alike.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by nearest rank (a value that was measured, so a
    p99 of few samples is a real turn's latency); None for no values.  numpy's
    ``inverted_cdf`` method, without numpy's per-call cost (a step's few hundred values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered)) - 1
    return float(ordered[min(len(ordered) - 1, max(0, rank))])


def metrics_json(data: MetricsData) -> str:
    """One line of JSON for an OpenTelemetry ``MetricsData``: the object its ``to_json``
    writes, built in one pass.  The SDK's ``to_json`` serialises every level to a string and
    parses it back into its parent (data point, metric, scope, resource), which made the
    driver's periodic metrics export its largest telemetry cost."""
    def points(metric_data: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"data_points": [asdict(p) for p in metric_data.data_points]}
        for f in fields(metric_data):
            if f.name != "data_points":
                out[f.name] = getattr(metric_data, f.name)
        return out
    return json.dumps({"resource_metrics": [{
        "resource": json.loads(rm.resource.to_json(indent=None)),
        "scope_metrics": [{
            "scope": json.loads(sm.scope.to_json(indent=None)),
            "metrics": [{"name": m.name, "description": m.description or "",
                         "unit": m.unit or "", "data": points(m.data)} for m in sm.metrics],
            "schema_url": sm.schema_url} for sm in rm.scope_metrics],
        "schema_url": rm.schema_url} for rm in data.resource_metrics]}) + "\n"


def _rnd(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def step_time_lost(step_s: float, clean_steps_s: Sequence[float], failed: bool) -> float:
    """Seconds a step lost to failures: its excess over the median clean step, if a restart
    happened during it (0 otherwise, and 0 before any clean step was seen)."""
    if not failed or not clean_steps_s:
        return 0.0
    return max(0.0, step_s - statistics.median(clean_steps_s))


_OTEL_KEYS = {"rollouts": "rollouts", "tokens": "tokens", "restarts": "restarts",
              "time_lost": "lost", "sandbox_outcomes": "sandbox", "judge_failures": "judge",
              "poison": "poison", "checkpoint_failures": "checkpoint_failures"}
"""The OpenTelemetry counter of each :func:`~erlay.actors.observe.metrics.zero_series`
name."""


class _LateWritesDropped:
    """A metrics file that drops what is written after it was closed.  The SDK's periodic
    reader makes one last collection as it shuts down, and its thread can outlive
    ``MeterProvider.shutdown``'s wait for it; that export then finds the file closed."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return 0 if self._file.closed else int(self._file.write(text))

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class JobTelemetry:
    """See the module docstring.  ``close()`` flushes everything; safe to call twice."""

    def __init__(self, cfg: TelemetrySection, run_dir: Path, run_name: str) -> None:
        self.cfg = cfg
        self.settings = telemetry.TelemetrySettings(
            exporter=cfg.exporter, dir=str(run_dir / "telemetry"), endpoint=cfg.otlp_endpoint,
            interval_s=cfg.export_interval_s, run=run_name,
            sample_ratio=cfg.rollout_sample_ratio)
        self.run_name = run_name
        self._lock = threading.Lock()
        self._meter_provider: Any = None
        self._files: list[Any] = []
        self._instruments: dict[str, Any] = {}
        self._gauges: dict[str, float] = {}
        self.ray: Any = None
        self._restarts_since_step: Counter[str] = Counter()
        self._clean_steps: list[float] = []
        self.lost_s = 0.0
        self.rl_s = 0.0
        # Running totals for the experiment trackers (:meth:`totals`).
        self._restarts_by_domain: Counter[str] = Counter()
        self._lost_by_domain: Counter[str] = Counter()
        self._sandbox_outcomes: Counter[str] = Counter()
        self._latencies: dict[int, list[float]] = {}   # by the step the rollout is for
        self._pending: Counter[tuple[str, str]] = Counter()   # (counter, kind): not exported yet

    # ------------------------------------------------------------------ lifecycle
    def start(self, extra_exporter: Any = None) -> None:
        """Configure the driver's providers (``extra_exporter``: a test's in-memory span
        exporter) and the Ray metrics mirror."""
        telemetry.configure(self.settings, "erlay-driver", extra=extra_exporter)
        if self.cfg.exporter != "none":
            self._start_metrics()
        if self.cfg.ray_metrics:
            try:
                from erlay.actors.observe.metrics import RayMetrics
                self.ray = RayMetrics(self.run_name)
                self.ray.export_zeros(DOMAINS)  # dashboards show 0, not "no data"
            except Exception:  # the dashboard mirror is optional
                log.warning("Ray metrics are off: they could not be set up", exc_info=True)

    def actor_env(self) -> dict[str, str]:
        """Environment for the job's actors, so their spans join the job's traces."""
        return {} if self.cfg.exporter == "none" else self.settings.env()

    def event_sink(self) -> TracingEventSink:
        return TracingEventSink(telemetry.tracer, on_restart=self._restarted)

    def close(self) -> None:
        self._flush_counts()
        provider, self._meter_provider = self._meter_provider, None
        if provider is not None:
            try:
                provider.shutdown()
            except Exception:  # a collector that is gone must not fail the job
                log.warning("telemetry: flushing metrics failed", exc_info=True)
        for f in self._files:
            f.close()
        self._files = []
        telemetry.shutdown()

    def _start_metrics(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource
        reader = PeriodicExportingMetricReader(
            self._metric_exporter(), export_interval_millis=int(self.cfg.export_interval_s * 1e3))
        view = View(instrument_name="erlay.generation.latency",
                    aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_S))
        self._meter_provider = MeterProvider(
            metric_readers=[reader], views=[view], resource=Resource.create(
                {"service.name": "erlay-driver", "erlay.run": self.run_name}))
        meter = self._meter_provider.get_meter("erlay")
        counters = {"rollouts": ("erlay.rollouts", "1"),
                    "tokens": ("erlay.generated_tokens", "1"),
                    "restarts": ("erlay.restarts", "1"),
                    "sandbox": ("erlay.sandbox.outcomes", "1"),
                    "judge": ("erlay.judge.failures", "1"),
                    "lost": ("erlay.time_lost", "s"),
                    "poison": ("erlay.poison_inputs", "1"),
                    "checkpoint_failures": ("erlay.checkpoint.failures", "1")}
        for key, (name, unit) in counters.items():
            self._instruments[key] = meter.create_counter(name, unit=unit)
        for series, tags in zero_series(DOMAINS):  # every series exported from the start
            self._add(_OTEL_KEYS[series], 0, **tags)
        self._instruments["latency"] = meter.create_histogram("erlay.generation.latency",
                                                              unit="s")
        gauges = {"rollouts_per_s": "", "tokens_per_s": "", "goodput": "tokens/s",
                  "time_efficiency": "1"}
        for name, unit in gauges.items():
            meter.create_observable_gauge(f"erlay.{name}", callbacks=[self._observe(name)],
                                          unit=unit)

    def _metric_exporter(self) -> Any:
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        if self.cfg.exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            return OTLPMetricExporter(endpoint=telemetry.otlp_url(self.cfg.otlp_endpoint,
                                                                  "metrics"))

        if self.cfg.exporter == "file":
            out = _LateWritesDropped(telemetry.open_telemetry_file(
                Path(self.settings.dir or "."), f"metrics-{os.getpid()}"))
            self._files.append(out)
            return ConsoleMetricExporter(out=out, formatter=metrics_json)
        return ConsoleMetricExporter(formatter=metrics_json)

    def _observe(self, name: str) -> Any:
        from opentelemetry.metrics import Observation

        def callback(_options: Any) -> list[Observation]:
            value = self._gauges.get(name)
            return [] if value is None else [Observation(value)]
        return callback

    # ------------------------------------------------------------------ recording
    def _add(self, key: str, amount: float, **attrs: str) -> None:
        instrument = self._instruments.get(key)
        if instrument is not None:
            instrument.add(amount, attributes=attrs or None)

    def _ray(self, method: str, *args: Any) -> None:
        if self.ray is not None:
            try:
                getattr(self.ray, method)(*args)
            except Exception:  # never into the job; logged once per kind
                log.debug("ray metric %s failed", method, exc_info=True)

    def _restarted(self, domain: str, cause: str) -> None:
        with self._lock:
            self._restarts_since_step[domain] += 1
            self._restarts_by_domain[domain] += 1
        self._add("restarts", 1, domain=domain, cause=cause)
        self._ray("restart", domain, cause)

    def generation_latency(self, seconds: float, step: int) -> None:
        """One generated turn of a rollout for RL step ``step``; recorded into the
        histograms with the step (:meth:`step`), so a rollout costs a list append here."""
        with self._lock:
            self._latencies.setdefault(step, []).append(seconds)

    def totals(self) -> dict[str, dict[str, float]]:
        """The run's totals so far, by key: ``restarts`` and ``lost_s`` (seconds lost to
        failures, as :meth:`step` splits them) by fault domain, ``sandbox`` runs by outcome.
        Copies; thread-safe."""
        with self._lock:
            return {"restarts": dict(self._restarts_by_domain),
                    "lost_s": dict(self._lost_by_domain),
                    "sandbox": dict(self._sandbox_outcomes)}

    def sandbox_outcome(self, kind: str) -> None:
        """One sandbox run that ended in ``kind``: counted now, exported with the step
        (:meth:`step`, :meth:`close`), so a tool call costs a dict update here."""
        with self._lock:
            self._sandbox_outcomes[kind] += 1
            self._pending[("sandbox", kind)] += 1

    def checkpoint_failed(self) -> None:
        """One checkpoint save given up by the learner."""
        self._add("checkpoint_failures", 1)
        self._ray("checkpoint_failure")

    def judge_failure(self, kind: str) -> None:
        """One failed judge call of ``kind``; exported with the step, as sandbox outcomes."""
        with self._lock:
            self._pending[("judge", kind)] += 1

    def _flush_counts(self) -> None:
        """Export the per-event counts gathered since the last step (one add per kind)."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
        for (key, kind), n in pending.items():
            self._add(key, n, kind=kind)
            self._ray("sandbox_outcome" if key == "sandbox" else "judge_failure", kind, n)

    def step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Account one RL step's metrics record; returns the fields to add to it: generation
        latency p50/p99/max, rollouts/s, tokens/s, seconds lost to failures
        (``lost_s``), ``time_efficiency`` and ``goodput`` (trained tokens/s of this step;
        0 for a record without ``trained_tokens``)."""
        step_s = float(record.get("step_s") or 0.0)
        with self._lock:
            latencies = self._latencies.pop(int(record.get("step", -1)), [])
            for old in [s for s in self._latencies if s < int(record.get("step", -1))]:
                del self._latencies[old]  # steps fed again after a rewind
            failed = dict(self._restarts_since_step)
            self._restarts_since_step.clear()
        lost = step_time_lost(step_s, self._clean_steps, bool(failed))
        if not failed:
            self._clean_steps.append(step_s)
            del self._clean_steps[:-50]  # a moving baseline: the job's speed drifts
        self.lost_s += lost
        self.rl_s += step_s
        efficiency = 1.0 - self.lost_s / self.rl_s if self.rl_s > 0 else 1.0
        goodput = goodput_of(float(record.get("trained_tokens") or 0), step_s)
        rollouts_s = record.get("samples", 0) / step_s if step_s > 0 else 0.0
        tokens_s = record.get("gen_tokens", 0) / step_s if step_s > 0 else 0.0
        self._gauges.update(rollouts_per_s=rollouts_s, tokens_per_s=tokens_s, goodput=goodput,
                            time_efficiency=efficiency)
        # Counters and histograms per step, not per rollout: the driver plays hundreds of
        # rollouts a second, and each metric call costs microseconds it would otherwise lose.
        samples, tokens = int(record.get("samples", 0)), int(record.get("gen_tokens", 0))
        poison = int(record.get("poison", 0))
        self._add("rollouts", samples)
        self._add("tokens", tokens)
        self._add("poison", poison)
        self._ray("rollouts", samples)
        self._ray("tokens", tokens)
        self._ray("poison", poison)
        self._flush_counts()
        histogram = self._instruments.get("latency")
        if histogram is not None:
            for seconds in latencies:
                histogram.record(seconds)
        self._ray("generation_latencies", latencies)
        total = sum(failed.values())
        for domain, count in failed.items():
            share = lost * count / total
            self._lost_by_domain[domain] += share
            self._add("lost", share, domain=domain)
            self._ray("time_lost", share, domain)
        self._ray("goodput", goodput)
        self._ray("time_efficiency", efficiency)
        self._ray("rollouts_per_s", rollouts_s)
        self._ray("tokens_per_s", tokens_s)
        return {"gen_latency_p50_s": _rnd(percentile(latencies, 50)),
                "gen_latency_p99_s": _rnd(percentile(latencies, 99)),
                "gen_latency_max_s": _rnd(max(latencies, default=None)),
                "rollouts_per_s": round(rollouts_s, 3), "tokens_per_s": round(tokens_s, 1),
                "lost_s": round(lost, 4), "time_efficiency": round(efficiency, 4),
                "goodput": round(goodput, 1)}
