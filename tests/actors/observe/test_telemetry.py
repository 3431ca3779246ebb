"""Telemetry: one rollout is one trace across processes; failures, restarts and escalations
are spans linked to their cause; the hub's per-step figures are right."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from erlay.actors.config import TelemetrySection, load_config
from erlay.actors.job.driver import Job
from erlay.actors.observe.goodput import goodput
from erlay.actors.observe.telemetry import JobTelemetry, percentile, step_time_lost
from erlay.actors.rundir import RunDir
from erlay.supervisor import telemetry
from erlay.supervisor.events import EventKind, SupervisorEvent
from erlay.supervisor.otel import TracingEventSink, cause_of, domain_of, is_failure
from tests.conftest import wait_for
from tests.paths import REPO

CONFIGS = REPO / "configs"


def event(context: EventKind, reason: str, t: float, child: str = "engine-1",
          sup: str = "erlay/generation", attempt: int = 0) -> SupervisorEvent:
    return SupervisorEvent(sup, child, context, reason, attempt, t)


# ------------------------------------------------------------------------ pure parts
def test_domain_cause_and_failure_of_events() -> None:
    assert domain_of("erlay/sandbox/host@node-0/sandbox-2") == "sandbox"
    assert domain_of("erlay") == "root"
    killed = event(EventKind.EXIT, "killed: SIGKILL", 1.0)
    assert is_failure(killed) and cause_of(killed) == "killed"
    assert cause_of(event(EventKind.EXIT, "hang: decode_step made no progress", 1)) == "hang"
    assert not is_failure(event(EventKind.EXIT, "normal", 1.0))
    assert not is_failure(event(EventKind.EXIT, "shutdown: auto_shutdown", 1.0))
    start_error = event(EventKind.START_ERROR, "error: boom", 1.0)
    assert is_failure(start_error) and cause_of(start_error) == "start_error"


def test_percentile_and_time_lost() -> None:
    assert percentile([], 50) is None
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0 and percentile([3.0], 99) == 3.0
    assert step_time_lost(5.0, [1.0, 2.0, 3.0], failed=True) == 3.0
    assert step_time_lost(5.0, [1.0, 2.0, 3.0], failed=False) == 0.0
    assert step_time_lost(1.0, [2.0], failed=True) == 0.0   # faster than usual: nothing lost
    assert step_time_lost(9.0, [], failed=True) == 0.0      # no baseline yet


def test_restart_span_links_to_its_failure_and_escalation_to_the_leaf() -> None:
    memory = InMemorySpanExporter()
    telemetry.configure(telemetry.TelemetrySettings(exporter="none"), "test", extra=memory)
    restarts: list[tuple[str, str]] = []
    try:
        sink = TracingEventSink(telemetry.tracer, on_restart=lambda d, c: restarts.append((d, c)))
        sink.emit(event(EventKind.EXIT, "killed: SIGKILL", 100.0))
        sink.emit(event(EventKind.RESTART, "killed: SIGKILL", 100.01, attempt=1))
        sink.emit(event(EventKind.START, "started", 101.5, attempt=1))
        sink.emit(event(EventKind.EXIT, "error: RuntimeError: x", 102.0))
        sink.emit(event(EventKind.ESCALATION, "shutdown: reached_max_restart_intensity",
                        102.1))
        sink.emit(event(EventKind.EXIT, "normal", 103.0, child="coordinator",
                        sup="erlay/rollout"))
    finally:
        spans = list(memory.get_finished_spans())
        telemetry.shutdown()
    names = [s.name for s in spans]
    assert names == ["failure", "restart", "failure", "escalation"]
    first_failure, restart, second_failure, escalation = spans
    assert first_failure.attributes["erlay.cause"] == "killed"
    assert first_failure.attributes["erlay.domain"] == "generation"
    assert restart.links[0].context.span_id == first_failure.context.span_id
    assert restart.attributes["erlay.cause"] == "killed"
    assert (restart.end_time - restart.start_time) / 1e9 == pytest.approx(1.49, abs=1e-3)
    assert escalation.links[0].context.span_id == second_failure.context.span_id
    assert restarts == [("generation", "killed")]


def test_the_hub_adds_latency_tails_time_lost_and_time_efficiency(tmp_path: Path) -> None:
    hub = JobTelemetry(TelemetrySection(exporter="none", ray_metrics=False), tmp_path, "t")
    hub.start()
    try:
        for seconds in (0.1, 0.2, 0.3, 0.4, 2.0):
            hub.generation_latency(seconds, step=0)
        hub.generation_latency(9.0, step=1)  # a rollout of the next step, generated early
        first = hub.step({"step": 0, "step_s": 2.0, "samples": 64, "gen_tokens": 640})
        assert first["gen_latency_p50_s"] == 0.3 and first["gen_latency_max_s"] == 2.0
        assert first["rollouts_per_s"] == 32.0 and first["tokens_per_s"] == 320.0
        assert first["lost_s"] == 0.0 and first["time_efficiency"] == 1.0
        hub._restarted("generation", "killed")
        second = hub.step({"step": 1, "step_s": 5.0, "samples": 64, "gen_tokens": 640})
        assert second["gen_latency_max_s"] == 9.0
        assert second["lost_s"] == 3.0
        assert second["time_efficiency"] == round(1 - 3.0 / 7.0, 4)
    finally:
        hub.close()


def test_the_hub_goodput_is_trained_tokens_per_step_second_not_generated(
        tmp_path: Path) -> None:
    hub = JobTelemetry(TelemetrySection(exporter="none", ray_metrics=False), tmp_path, "t")
    hub.start()
    try:
        # 640 tokens generated, 400 of them trained (the rest masked): goodput counts 400.
        record = hub.step({"step": 0, "step_s": 4.0, "samples": 64, "gen_tokens": 640,
                           "trained_tokens": 400})
        assert record["goodput"] == 100.0 and record["tokens_per_s"] == 160.0
        assert hub._gauges["goodput"] == 100.0 and hub._gauges["time_efficiency"] == 1.0
        # A step that trained nothing (every sample masked) has no goodput, however fast.
        idle = hub.step({"step": 1, "step_s": 1.0, "samples": 64, "gen_tokens": 640,
                         "trained_tokens": 0})
        assert idle["goodput"] == 0.0 and idle["time_efficiency"] == 1.0
        assert hub.step({"step": 2, "step_s": 0.0, "trained_tokens": 9})["goodput"] == 0.0
    finally:
        hub.close()


def test_rollouts_are_sampled_by_a_stable_hash_and_unsampled_ones_cost_no_span() -> None:
    memory = InMemorySpanExporter()
    telemetry.configure(telemetry.TelemetrySettings(exporter="none", sample_ratio=0.25),
                        "test", extra=memory)
    try:
        keys = [f"r{i:05d}-g000-0" for i in range(2000)]
        picked = [k for k in keys if telemetry.sampled(k)]
        assert picked == [k for k in keys if telemetry.sampled(k)]  # stable
        assert 0.2 < len(picked) / len(keys) < 0.3
        skipped = next(k for k in keys if not telemetry.sampled(k))
        with telemetry.span("rollout", root=True, sample_key=skipped) as root:
            assert telemetry.carrier(root) is None
            with telemetry.span("generate") as inner:
                assert not inner.get_span_context().is_valid
            assert telemetry.start_span("consume") is trace.INVALID_SPAN
        with telemetry.span("rollout", root=True, sample_key=picked[0]) as root:
            carried = telemetry.carrier(root)
            with telemetry.span("generate"):
                pass
        with telemetry.span("judge.score", child_only=True):
            pass  # a callee without a caller's trace records nothing
        with telemetry.span("judge.score", parent=carried, child_only=True):
            pass
        with telemetry.span("train_step", root=True):
            pass  # no sample key: always recorded
    finally:
        names = [s.name for s in memory.get_finished_spans()]
        telemetry.shutdown()
    assert names == ["generate", "rollout", "judge.score", "train_step"]


def test_settings_travel_through_the_environment() -> None:
    settings = telemetry.TelemetrySettings(exporter="file", dir="/x/telemetry", run="r")
    assert telemetry.TelemetrySettings.from_env(settings.env()) == settings
    assert telemetry.TelemetrySettings.from_env({}) is None
    assert telemetry.TelemetrySettings.from_env({telemetry.ENV_VAR: "{not json"}) is None


def test_otlp_without_an_endpoint_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from erlay.actors.config import ConfigError
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with pytest.raises(ConfigError, match="exporter otlp needs otlp_endpoint"):
        load_config(CONFIGS / "cpu.yaml", ["telemetry.exporter=otlp"])
    cfg = load_config(CONFIGS / "cpu.yaml", ["telemetry.exporter=otlp",
                                             "telemetry.otlp_endpoint=http://127.0.0.1:4318"])
    assert cfg.telemetry.otlp_endpoint == "http://127.0.0.1:4318"


# ---------------------------------------------------------------- across processes
def _file_spans(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(directory.glob("spans-*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


@pytest.mark.ray
def test_one_rollout_is_one_trace_across_processes(tmp_path: Path, fresh_ray: None) -> None:
    """The coordinator's spans (in memory) and the engine's, the sandbox host's and the
    judge host's (in their own processes' files) form one trace per rollout."""
    cfg = load_config(CONFIGS / "cpu.yaml", [
        "run.steps=3", "warm_start.steps=10", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "ray.num_cpus=4", "checkpoint.every_steps=2",
        "telemetry.ray_metrics=false", "telemetry.rollout_sample_ratio=1.0"])
    job = Job(cfg, RunDir.create(tmp_path, "trace"))
    memory = InMemorySpanExporter()
    job.span_exporter = memory
    holder: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: holder.update(result=job.run(progress=False)))
    thread.start()
    wait_for(lambda: job.coordinator is not None and job.coordinator.loop is not None
             and job.coordinator.sandbox is not None, 120, what="the coordinator")

    async def tool_call() -> dict[str, Any]:
        # A tool call through the job's own sandbox client, as a rollout makes one.
        with telemetry.span("rollout", root=True, rollout_id="t-tool") as root, \
                telemetry.span("tool_call", rollout_id="t-tool"):
            result = await job.coordinator.sandbox.execute("t-tool/tool0", "print(6 * 7)",
                                                           trace=telemetry.carrier())
            holder["tool_trace"] = f"{root.get_span_context().trace_id:032x}"
            return result
    future = asyncio.run_coroutine_threadsafe(tool_call(), job.coordinator.loop)
    assert future.result(120)["stdout"].strip() == "42"
    thread.join(300)
    assert holder["result"].status == "finished", holder["result"].reason

    local = [telemetry.span_record(s) for s in memory.get_finished_spans()]
    remote = _file_spans(job.run_dir.path / "telemetry")
    assert {s["pid"] for s in remote} - {s["pid"] for s in local}, "no span from another process"
    by_id = {s["span_id"]: s for s in local + remote}
    roots = [s for s in local if s["name"] == "rollout" and s["parent_id"] is None
             and s["attributes"]["erlay.rollout_id"].startswith("r")]
    assert len(roots) == 48
    for root in roots:
        assert root["attributes"]["erlay.policy_version"] >= 1
        children = [s for s in local + remote if s["parent_id"] == root["span_id"]]
        names = {s["name"] for s in children}
        assert {"dispatch", "generate", "consume"} <= names, names
        assert all(s["trace_id"] == root["trace_id"] for s in children)
    engine = [s for s in remote if s["name"] == "engine.generate"]
    assert engine and all(s["service"].startswith("erlay.generation.engine") for s in engine)
    for span in engine:
        parent = by_id[span["parent_id"]]
        assert parent["name"] == "generate" and parent["trace_id"] == span["trace_id"]
        assert by_id[parent["parent_id"]]["name"] == "rollout"
    judged = [s for s in remote if s["name"] == "judge.score"]
    assert judged, "no rollout reached the judge"
    for span in judged:
        assert by_id[span["parent_id"]]["name"] == "judge"
        assert by_id[by_id[span["parent_id"]]["parent_id"]]["name"] == "rollout"
    sandbox = [s for s in remote if s["name"] == "sandbox.run"]
    assert [s["trace_id"] for s in sandbox] == [holder["tool_trace"]]
    assert by_id[sandbox[0]["parent_id"]]["name"] == "tool_call"
    assert sandbox[0]["service"].startswith("erlay.sandbox.host")
    assert {"train_step", "weight_update", "checkpoint"} <= {s["name"] for s in local}
    rl = job.run_dir.rl_steps()
    assert all(m["gen_latency_p99_s"] >= m["gen_latency_p50_s"] > 0 for m in rl)
    assert all(m["time_efficiency"] == 1.0 and m["lost_s"] == 0.0 for m in rl)
    assert all(m["goodput"] == round(goodput(m["trained_tokens"], m["step_s"]), 1) for m in rl)
    assert any(m["goodput"] > 0 for m in rl)
    exported = (job.run_dir.path / "telemetry").glob("metrics-*.jsonl")
    names = {m["name"] for f in exported for line in f.read_text().splitlines()
             for rm in json.loads(line)["resource_metrics"]
             for sm in rm["scope_metrics"] for m in sm["metrics"]}
    assert {"erlay.rollouts", "erlay.generated_tokens", "erlay.generation.latency",
            "erlay.goodput", "erlay.time_efficiency"} <= names


def test_the_otlp_exporter_reaches_a_collector_on_loopback(tmp_path: Path) -> None:
    """A stand-in OTLP/HTTP collector on 127.0.0.1 receives the spans and the metrics."""
    import http.server

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    received: dict[str, list[bytes]] = {"/v1/traces": [], "/v1/metrics": []}

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the http.server API names it so
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    hub = JobTelemetry(TelemetrySection(exporter="otlp", otlp_endpoint=endpoint,
                                        ray_metrics=False), tmp_path, "otlp-run")
    try:
        hub.start()
        with telemetry.span("rollout", root=True, rollout_id="r1"), telemetry.span("generate"):
            pass
        hub.step({"step": 0, "step_s": 1.0, "samples": 4, "gen_tokens": 12})
    finally:
        hub.close()
        server.shutdown()
    spans = [span.name for body in received["/v1/traces"]
             for rs in ExportTraceServiceRequest.FromString(body).resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    assert sorted(spans) == ["generate", "rollout"]
    metrics = {m.name: m for body in received["/v1/metrics"]
               for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics}
    assert metrics["erlay.generated_tokens"].sum.data_points[0].as_int == 12
    assert not (tmp_path / "telemetry").exists()  # otlp writes no files
