"""The job's headline numbers as Ray application metrics, for the Ray dashboard and Prometheus.

:class:`RayMetrics` is what the job's telemetry hub calls: counters for rollouts, tokens,
restarts, sandbox outcomes, judge failures and time lost; a histogram of generation latency;
gauges for goodput (trained tokens per second, :mod:`erlay.actors.observe.goodput`), time
efficiency (the share of RL wall time not lost to failures) and throughput.  Every series
carries the tag ``run`` (the run name) so runs sharing a cluster stay apart.

Where the numbers go.  ``ray.util.metrics`` in Ray 2.60 records from any process with a
Ray core worker, the driver included (checked by ``tests/actors/observe/test_metrics.py``, which
records from the test's driver): the core worker exports to the node's metrics agent every
``metrics_report_interval_ms`` (10 s by default), and the agent serves Prometheus text at
``http://<node>:<MetricsExportPort>/metrics``.  Ray prefixes every application metric with
``ray_``, so ``erlay_rollouts_total`` is scraped as ``ray_erlay_rollouts_total``.  The
dashboard agent is enough; the dashboard web UI is not needed.  The dashboard's Metrics tab
only draws these if Prometheus and Grafana are set up against that endpoint.

Two Ray 2.60 behaviours callers should know (measured here): a gauge that is not set
again stops being exported about 20 s plus one export interval after its last ``set``, so the
hub should set the gauges every step (or every few seconds); and a histogram's ``_sum`` is
rebuilt by Ray from bucket midpoints (values above the last boundary count as twice it), so
``_sum / _count`` is only an approximate mean.  Bucket counts and ``_count`` are exact.

Contract: no method ever raises into the job.  Instruments are created lazily, once per
process, on first use (creating them before ``ray.init`` is allowed: points recorded before
Ray is up are dropped by Ray, later ones are exported).  If ``ray.util.metrics`` cannot be
used here, the first failure is logged once as a warning and every ``RayMetrics`` in the
process becomes a no-op.  A value that is not a finite number is dropped, as is a counter
increment that is not positive (Ray's counters only go up and reject 0) and a negative
goodput; a time efficiency outside 0..1 is clamped.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("erlay.ray_metrics")

# 5 ms (a cached short completion) up to 120 s (a long generation stuck behind a restart).
LATENCY_BOUNDARIES_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# The Prometheus names, without the ``ray_`` prefix Ray adds on export.
ROLLOUTS = "erlay_rollouts_total"
TOKENS = "erlay_generated_tokens_total"
GENERATION_LATENCY = "erlay_generation_latency_seconds"
RESTARTS = "erlay_restarts_total"
SANDBOX_OUTCOMES = "erlay_sandbox_outcomes_total"
JUDGE_FAILURES = "erlay_judge_failures_total"
TIME_LOST = "erlay_time_lost_seconds_total"
POISON = "erlay_poison_inputs_total"
CHECKPOINT_FAILURES = "erlay_checkpoint_failures_total"
GOODPUT = "erlay_goodput_tokens_per_second"
TIME_EFFICIENCY = "erlay_time_efficiency_ratio"
ROLLOUTS_PER_S = "erlay_rollouts_per_second"
TOKENS_PER_S = "erlay_tokens_per_second"

EXPORT_PREFIX = "ray_"
"""What Ray 2.60 puts in front of an application metric's name in the Prometheus output."""

COUNTERS = {"rollouts": ROLLOUTS, "tokens": TOKENS, "restarts": RESTARTS,
            "sandbox_outcomes": SANDBOX_OUTCOMES, "judge_failures": JUDGE_FAILURES,
            "time_lost": TIME_LOST, "poison": POISON,
            "checkpoint_failures": CHECKPOINT_FAILURES}
"""Each counter instrument's Prometheus name (without the prefix)."""

# The closed label sets each counter is exported with at 0 from the job's start, so that a
# dashboard shows 0, not "no data", before the first event.  Domains: the tree's five
# (:data:`erlay.actors.observe.attribution.DOMAINS`); causes: a failure's kind
# (:func:`erlay.supervisor.otel.cause_of`); sandbox outcomes: ``erlay.sandbox.results.
# Outcome``; judge failure kinds: a Judgement's ``kind`` and the runner's
# ``judge_failure_kind``.  tests/actors/observe/test_metrics_zero.py checks them against
# their sources.
RESTART_CAUSES = ("killed", "error", "hang", "lost", "start_error")
SANDBOX_OUTCOME_KINDS = ("ok", "error", "timeout", "memory", "file_size", "output_limit",
                         "killed", "spawn_failed", "poison")
JUDGE_FAILURE_KINDS = ("timeout", "exception", "bad_return", "poison", "unavailable",
                       "undecided", "circuit_open", "error")


def zero_series(domains: tuple[str, ...]) -> list[tuple[str, dict[str, str]]]:
    """Every (counter, tags) series the job exports at 0 when it starts (``run`` aside):
    rollouts, tokens, poison inputs and failed checkpoint saves; restarts per domain and
    cause; time lost per domain; sandbox outcomes and judge failures per kind."""
    out: list[tuple[str, dict[str, str]]] = [("rollouts", {}), ("tokens", {}), ("poison", {}),
                                             ("checkpoint_failures", {})]
    out += [("restarts", {"domain": d, "cause": c}) for d in domains for c in RESTART_CAUSES]
    out += [("time_lost", {"domain": d}) for d in domains]
    out += [("sandbox_outcomes", {"kind": k}) for k in SANDBOX_OUTCOME_KINDS]
    out += [("judge_failures", {"kind": k}) for k in JUDGE_FAILURE_KINDS]
    return out


@dataclass(frozen=True)
class _Instruments:
    """The process's Ray instruments, one per metric name (shared by every RayMetrics)."""

    rollouts: Any
    tokens: Any
    generation_latency: Any
    restarts: Any
    sandbox_outcomes: Any
    judge_failures: Any
    time_lost: Any
    poison: Any
    checkpoint_failures: Any
    goodput: Any
    time_efficiency: Any
    rollouts_per_s: Any
    tokens_per_s: Any


def _build_instruments() -> _Instruments:
    """Create the Ray instruments.  Raises whatever Ray raises if its metrics are unusable."""
    from ray.util.metrics import Counter, Gauge, Histogram

    def counter(name: str, what: str, *tags: str) -> Counter:
        return Counter(name, what, tag_keys=("run", *tags))

    def gauge(name: str, what: str) -> Gauge:
        return Gauge(name, what, tag_keys=("run",))

    return _Instruments(
        rollouts=counter(ROLLOUTS, "Rollouts completed (scored and journaled)."),
        tokens=counter(TOKENS, "Tokens generated by the engines."),
        generation_latency=Histogram(
            GENERATION_LATENCY, "Time from a generation request to its completion.",
            boundaries=list(LATENCY_BOUNDARIES_S), tag_keys=("run",)),
        restarts=counter(RESTARTS, "Child restarts by the supervisor tree.", "domain", "cause"),
        sandbox_outcomes=counter(SANDBOX_OUTCOMES, "Sandbox executions by outcome.", "kind"),
        judge_failures=counter(JUDGE_FAILURES, "Judge calls that failed, by kind.", "kind"),
        time_lost=counter(TIME_LOST, "Seconds of progress lost to failures.", "domain"),
        poison=counter(POISON, "Samples that met a poison input: a call that killed its "
                       "worker (or host) twice, not tried again."),
        checkpoint_failures=counter(CHECKPOINT_FAILURES, "Checkpoint saves given up: the "
                                    "writer made no progress, or failed."),
        goodput=gauge(GOODPUT, "Tokens of trained samples per second of wall time."),
        time_efficiency=gauge(TIME_EFFICIENCY,
                              "Share of RL wall time not lost to failures (0..1)."),
        rollouts_per_s=gauge(ROLLOUTS_PER_S, "Recent rollout throughput."),
        tokens_per_s=gauge(TOKENS_PER_S, "Recent generation throughput in tokens."),
    )


class _ProcessState:
    """The process-wide lazily built instruments, or the fact that they are unavailable."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instruments: _Instruments | None = None
        self.disabled = False

    def get(self) -> _Instruments | None:
        """The instruments, built on first call; ``None`` once metrics are found unusable."""
        if self.instruments is None and not self.disabled:
            with self.lock:
                if self.instruments is None and not self.disabled:
                    try:
                        self.instruments = _build_instruments()
                    except Exception as exc:  # noqa: BLE001 - any failure means no Ray metrics
                        self.disable(exc)
        return None if self.disabled else self.instruments

    def disable(self, exc: BaseException) -> None:
        """Turn Ray metrics off for this process, logging why (only the first time)."""
        if not self.disabled:
            self.disabled = True
            log.warning("Ray metrics unavailable, recording none from this process: %r", exc)


_STATE = _ProcessState()


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


class RayMetrics:
    """Records the job's metrics into Ray for one run (every series is tagged ``run``).

    Cheap to construct; instruments are shared by all instances in the process.  Every
    method returns ``None`` and never raises (see the module docstring).  Tag values should
    come from closed sets (domain names, failure causes, outcome kinds): each distinct
    value is a new Prometheus series.
    """

    def __init__(self, run: str) -> None:
        self.run = str(run)

    @property
    def enabled(self) -> bool:
        """False once Ray metrics were found unusable in this process."""
        return not _STATE.disabled

    def export_zeros(self, domains: tuple[str, ...]) -> None:
        """Export every counter of :func:`zero_series` at 0 now, so that each series exists
        before its first event.  Ray's ``Counter.inc`` refuses 0, so the point is recorded
        through the metric's ``_record`` (Ray 2.60's ``Metric._record``, which ``inc``
        itself calls after its check); a later ``inc`` adds to it."""
        for instrument, tags in zero_series(domains):
            self._record(instrument, "_record", 0.0, tags)

    def rollouts(self, n: int) -> None:
        """Count ``n`` completed rollouts (``erlay_rollouts_total``)."""
        self._inc("rollouts", n)

    def tokens(self, n: int) -> None:
        """Count ``n`` generated tokens (``erlay_generated_tokens_total``)."""
        self._inc("tokens", n)

    def generation_latency(self, seconds: float) -> None:
        """Observe one generation's latency (``erlay_generation_latency_seconds``)."""
        if _finite(seconds) and seconds >= 0:
            self._record("generation_latency", "observe", float(seconds), {})

    def generation_latencies(self, seconds: Sequence[float]) -> None:
        """Observe a step's generation latencies (``erlay_generation_latency_seconds``) in
        one call: the tags are built and checked once, not per value (Ray 2.60's
        ``Histogram.observe`` merges and validates them on every call; the driver observes a
        step's few hundred latencies at once).  Falls back to :meth:`generation_latency`
        per value where Ray's internals differ."""
        instruments = _STATE.get()
        if instruments is None:
            return
        values = [float(s) for s in seconds if _finite(s) and s >= 0]
        if not values:
            return
        histogram = instruments.generation_latency
        if getattr(histogram, "_discard_metric", False):
            return   # what observe() does for a name Ray refuses
        try:
            record = histogram._metric.record  # Ray 2.60: the core worker's metric
            tags = histogram._get_final_tags({"run": self.run})
            histogram._validate_tags(tags)
        except Exception:  # noqa: BLE001 - another Ray: the public, per-value path
            for value in values:
                self.generation_latency(value)
            return
        try:
            for value in values:
                record(value, tags=tags)
        except Exception as exc:  # noqa: BLE001 - a metrics failure must never reach the job
            _STATE.disable(exc)

    def restart(self, domain: str, cause: str) -> None:
        """Count one restart of a child in ``domain`` for ``cause`` (``erlay_restarts_total``)."""
        self._inc("restarts", 1, domain=domain, cause=cause)

    def sandbox_outcome(self, kind: str, n: int = 1) -> None:
        """Count ``n`` sandbox executions ending in ``kind``
        (``erlay_sandbox_outcomes_total``)."""
        self._inc("sandbox_outcomes", n, kind=kind)

    def judge_failure(self, kind: str, n: int = 1) -> None:
        """Count ``n`` failed judge calls of ``kind`` (``erlay_judge_failures_total``)."""
        self._inc("judge_failures", n, kind=kind)

    def time_lost(self, seconds: float, domain: str) -> None:
        """Add ``seconds`` lost to failures in ``domain`` (``erlay_time_lost_seconds_total``)."""
        self._inc("time_lost", seconds, domain=domain)

    def poison(self, n: int) -> None:
        """Count ``n`` samples that met a poison input (``erlay_poison_inputs_total``)."""
        self._inc("poison", n)

    def checkpoint_failure(self) -> None:
        """Count one checkpoint save given up (``erlay_checkpoint_failures_total``)."""
        self._inc("checkpoint_failures", 1)

    def goodput(self, tokens_per_s: float) -> None:
        """Set goodput, trained tokens per second (``erlay_goodput_tokens_per_second``)."""
        if _finite(tokens_per_s) and tokens_per_s >= 0:
            self._record("goodput", "set", float(tokens_per_s), {})

    def time_efficiency(self, fraction: float) -> None:
        """Set the share of RL wall time not lost to failures, clamped to 0..1
        (``erlay_time_efficiency_ratio``)."""
        if _finite(fraction):
            self._record("time_efficiency", "set", min(1.0, max(0.0, float(fraction))), {})

    def rollouts_per_s(self, x: float) -> None:
        """Set the recent rollout throughput (``erlay_rollouts_per_second``)."""
        if _finite(x):
            self._record("rollouts_per_s", "set", float(x), {})

    def tokens_per_s(self, x: float) -> None:
        """Set the recent token throughput (``erlay_tokens_per_second``)."""
        if _finite(x):
            self._record("tokens_per_s", "set", float(x), {})

    def _inc(self, instrument: str, value: float, **tags: str) -> None:
        if _finite(value) and value > 0:
            self._record(instrument, "inc", float(value), tags)

    def _record(self, instrument: str, method: str, value: float, tags: dict[str, str]) -> None:
        instruments = _STATE.get()
        if instruments is None:
            return
        final = {"run": self.run, **{key: str(val) for key, val in tags.items()}}
        try:
            getattr(getattr(instruments, instrument), method)(value, tags=final)
        except Exception as exc:  # noqa: BLE001 - a metrics failure must never reach the job
            _STATE.disable(exc)
