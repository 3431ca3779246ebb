"""OpenTelemetry in every process of a job: providers, exporters, trace propagation.

The driver calls :func:`configure` with the job's :class:`TelemetrySettings`; every other
process of the job (engines, the learner, sandbox and judge hosts) configures itself lazily,
the first time it asks for :func:`tracer`, from the ``ERLAY_TELEMETRY`` environment variable
the job sets on its actors (:meth:`TelemetrySettings.env`).  So no component takes telemetry
arguments, and a process that never traces pays nothing.

Exporters: ``file`` (the default) writes one JSON object per finished span to
``RUN_DIR/telemetry/spans-<service>-<pid>.jsonl`` (one file per process: appends from many
processes never interleave) and the driver's metrics to ``metrics-<pid>.jsonl``; ``console``
prints the same to stdout; ``otlp`` sends both over OTLP/HTTP to a collector; ``none`` keeps
the API as no-ops.  Finished spans go to a bounded queue (:class:`BoundedSpanQueue`) that a
thread exports about every half second; ending a span never waits on the exporter, and a span
that finds the queue full is dropped and counted (:func:`spans_dropped`).  A process killed
by SIGKILL loses the spans of its last half second, never the job's other data.

Sampling: tracing every rollout would cost the driver far more than the 3% budget (a span
costs ~35 µs of CPU to create and export, and a rollout makes five), so rollouts are sampled by a
deterministic hash of their key (:func:`sampled`; ``sample_ratio``, default 2%): a traced
rollout is traced whole, in every process, and the same rollout replayed after a failure is
traced again.  Spans of an unsampled block cost a context-variable read.  Spans without a
sample key (train steps, checkpoints, restarts) are always recorded.

Trace context crosses process boundaries explicitly, as a W3C ``traceparent`` carrier dict
that travels inside the request (:func:`carrier` on the caller, ``parent=`` on the callee),
so a rollout's spans in the coordinator, the engine, the sandbox host and the judge host form
one trace.  The providers are this module's own, not OpenTelemetry's process-global ones, so
one test process can run several jobs one after the other.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

log = logging.getLogger("erlay.telemetry")

ENV_VAR = "ERLAY_TELEMETRY"
Exporter = Literal["file", "console", "otlp", "none"]
Carrier = dict[str, str]


@dataclass(frozen=True)
class TelemetrySettings:
    """What a process of the job needs to export: the exporter and where it writes."""

    exporter: Exporter = "file"
    dir: str | None = None          # file: RUN_DIR/telemetry
    endpoint: str | None = None     # otlp: the collector's base URL
    interval_s: float = 5.0         # metrics export period
    run: str = ""                   # the run's name, a resource attribute of every span
    sample_ratio: float = 0.02      # share of sampled keys (rollouts) that are traced

    def env(self) -> dict[str, str]:
        """The environment variable that makes a child process configure itself alike."""
        return {ENV_VAR: json.dumps(asdict(self))}

    @staticmethod
    def from_env(environ: Mapping[str, str] = os.environ) -> TelemetrySettings | None:
        raw = environ.get(ENV_VAR)
        if not raw:
            return None
        try:
            return TelemetrySettings(**json.loads(raw))
        except (TypeError, ValueError) as exc:
            log.warning("ignoring a malformed %s (%s); telemetry is off here", ENV_VAR, exc)
            return None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """The compact JSON shape of one finished span in the file exporter's files."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start": (span.start_time or 0) / 1e9,
        "end": (span.end_time or 0) / 1e9,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{link.context.trace_id:032x}",
                   "span_id": f"{link.context.span_id:016x}"} for link in span.links],
        "status": span.status.status_code.name,
        "pid": os.getpid(),
        "service": str(span.resource.attributes.get("service.name", "")),
    }


def _line(span: ReadableSpan) -> str:
    return json.dumps(span_record(span), default=str) + "\n"


class BoundedSpanQueue(SpanProcessor):
    """Finished spans, exported off the hot path: ``on_end`` appends the span to a bounded
    queue (no I/O, no lock, no wait); a daemon thread exports the queue in batches every
    ``delay_s``.  When the queue is full (an exporter that stalls: a slow disk, a collector
    that is down) the span is dropped and counted in :attr:`dropped`, never waited for; the
    count is reported at shutdown and by :func:`spans_dropped`.  A burst that fills a batch
    wakes the thread early, so a burst is exported, not dropped.  ``shutdown`` exports what
    is queued, within ``timeout_s``."""

    def __init__(self, exporter: SpanExporter, max_queue: int = 8192, batch: int = 512,
                 delay_s: float = 0.5) -> None:
        self._exporter = exporter
        self._queue: deque[ReadableSpan] = deque()
        self._max, self._batch, self._delay_s = max_queue, batch, delay_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="erlay-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._stop.is_set() or len(self._queue) >= self._max:
            self.dropped += 1   # a lost increment under a race undercounts by one, no more
            return
        self._queue.append(span)
        if len(self._queue) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._drain()

    def _drain(self, timeout_s: float | None = None) -> bool:
        """Export what is queued; False if an export already in flight (another thread's)
        did not end within ``timeout_s`` (None: wait for it)."""
        if not self._export_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return False
        try:
            while self._queue:
                batch = [self._queue.popleft()
                         for _ in range(min(self._batch, len(self._queue)))]
                try:
                    self._exporter.export(batch)
                except Exception:  # an exporter that fails loses its batch, not the job
                    log.warning("telemetry: exporting %d spans failed", len(batch),
                                exc_info=True)
        finally:
            self._export_lock.release()
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._drain(timeout_millis / 1000)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and export what is queued, all within ``timeout_s``: an exporter
        stuck in a call (a collector that stopped answering) costs its spans, not the
        process's exit."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if not self._drain(max(0.0, deadline - time.monotonic())):
            self.dropped += len(self._queue)
            self._queue.clear()
            log.warning("telemetry: the span exporter did not finish within %.0f s; the "
                        "spans still queued are dropped", timeout_s)
        else:
            self._exporter.shutdown()
        if self.dropped:
            log.warning("telemetry: %d spans were dropped: the exporter fell behind or stopped "
                        "(queue of %d)", self.dropped, self._max)


class _State:
    """This process's providers (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: BoundedSpanQueue | None = None
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.settings: TelemetrySettings | None = None
        self.files: list[Any] = []
        self.tried_env = False


_state = _State()


def configure(settings: TelemetrySettings, service: str,
              extra: SpanExporter | None = None) -> None:
    """Set up this process's tracer provider (replacing an earlier one of this module's).

    ``extra`` is one more exporter, called synchronously as each span ends (tests pass an
    ``InMemorySpanExporter``).  ``exporter: none`` without ``extra`` leaves tracing off.
    """
    with _state.lock:
        _shutdown_locked()
        _state.settings = settings
        _state.tried_env = True
        if settings.exporter == "none" and extra is None:
            return
        resource = Resource.create({"service.name": service, "erlay.run": settings.run,
                                    "process.pid": os.getpid()})
        provider = TracerProvider(resource=resource)
        exporter = _span_exporter(settings, service)
        if exporter is not None:
            _state.queue = BoundedSpanQueue(exporter)
            provider.add_span_processor(_state.queue)
        if extra is not None:
            provider.add_span_processor(SimpleSpanProcessor(extra))
        _state.provider = provider
        _state.tracer = provider.get_tracer("erlay")


def _span_exporter(settings: TelemetrySettings, service: str) -> SpanExporter | None:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    match settings.exporter:
        case "file":
            assert settings.dir, "the file exporter needs a directory"
            out = open_telemetry_file(Path(settings.dir), f"spans-{service}-{os.getpid()}")
            _state.files.append(out)
            return ConsoleSpanExporter(out=out, formatter=_line)
        case "console":
            return ConsoleSpanExporter(formatter=_line)
        case "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(endpoint=otlp_url(settings.endpoint, "traces"))
    return None


def open_telemetry_file(directory: Path, stem: str) -> Any:
    """A line-buffered append-mode file ``directory/stem.jsonl`` (created as needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    return open(directory / f"{stem}.jsonl", "a", encoding="utf-8",  # held open
                buffering=1)


def otlp_url(endpoint: str | None, signal: str) -> str:
    """``http://host:4318`` + ``/v1/<signal>``; the OTLP environment variable by default."""
    base = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    return f"{base.rstrip('/')}/v1/{signal}"


def tracer() -> trace.Tracer:
    """This process's tracer; the first call in a job's child process configures it from
    ``ERLAY_TELEMETRY``.  A no-op tracer where telemetry is off."""
    if not _state.tried_env:
        with _state.lock:
            settings = None if _state.tried_env else TelemetrySettings.from_env()
            _state.tried_env = True
        if settings is not None:
            configure(settings, _service_name())
            atexit.register(shutdown)
    return _state.tracer


def _service_name() -> str:
    """The actor's name in a Ray worker, the child's tree path in a process a host spawned
    (``ERLAY_CHILD_PATH``), else ``process``.  Ray is asked only where it is loaded already:
    importing it costs seconds, which a worker process must not pay on its first call."""
    name = os.environ.get("ERLAY_CHILD_PATH")
    if not name and "ray" in sys.modules:
        try:
            import ray
            name = ray.get_runtime_context().get_actor_name()
        except Exception:  # noqa: BLE001 - not in a Ray worker: a plain process
            name = None
    return name.replace("/", ".").replace("@", "-") if name else "process"


def shutdown() -> None:
    """Flush and close this process's exporters; tracing is off until configured again."""
    with _state.lock:
        _shutdown_locked()


def _shutdown_locked() -> None:
    if _state.provider is not None:
        try:
            _state.provider.shutdown()
        except Exception:  # a collector that is gone must not fail the job
            log.warning("telemetry: flushing spans failed", exc_info=True)
    for f in _state.files:
        f.close()
    _state.files = []
    _state.provider = None
    _state.queue = None
    _state.tracer = trace.NoOpTracer()


def spans_dropped() -> int:
    """Spans this process dropped since telemetry was configured, because its exporter fell
    behind (see :class:`BoundedSpanQueue`)."""
    queue = _state.queue
    return 0 if queue is None else queue.dropped


def enabled() -> bool:
    return _state.provider is not None


def sampled(key: str) -> bool:
    """Whether the work named ``key`` (a rollout id) is traced: a stable hash of the key
    below the configured ratio, so every process and every replay agrees."""
    settings = _state.settings
    if _state.provider is None or settings is None or settings.sample_ratio <= 0:
        return False
    return zlib.crc32(key.encode()) < settings.sample_ratio * 2**32


# Set inside an unsampled block: the spans under it are skipped without touching OpenTelemetry.
_quiet: ContextVar[bool] = ContextVar("erlay_telemetry_quiet", default=False)


# ---------------------------------------------------------------------- propagation
def carrier(span: trace.Span | None = None) -> Carrier | None:
    """The W3C trace context of ``span`` (default: the current span) as a dict to send
    along with a request; None when there is nothing to propagate (tracing off)."""
    if span is None:
        if _state.provider is None or _quiet.get():
            return None   # nothing is traced here: skip OpenTelemetry's context lookup
        span = trace.get_current_span()
    if not span.get_span_context().is_valid:
        return None
    out: Carrier = {}
    inject(out, context=trace.set_span_in_context(span))
    return out


def parent_context(trace_carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a callee starts its span under, from the caller's :func:`carrier`."""
    return extract(dict(trace_carrier)) if trace_carrier else None


class _Quiet:
    """The block of an unsampled key: the spans under it (in this task) are skipped."""

    __slots__ = ("_token",)

    def __enter__(self) -> trace.Span:
        self._token = _quiet.set(True)
        return trace.INVALID_SPAN

    def __exit__(self, *_: object) -> None:
        try:
            _quiet.reset(self._token)
        except ValueError:  # closed by the garbage collector outside its task
            pass


_NOTHING: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)
"""A block that records nothing (reusable: nullcontext keeps no state)."""


def span(name: str, parent: Mapping[str, str] | None = None, *, root: bool = False,
         sample_key: str | None = None, child_only: bool = False,
         **attributes: Any) -> AbstractContextManager[trace.Span]:
    """A span around a block: a child of ``parent`` (a carrier from another process) if
    given, the root of a new trace if ``root``, else a child of the current span.

    ``sample_key``: trace the block only if :func:`sampled`; else the block and every span
    under it (in this task) are skipped.  ``child_only``: record only under a ``parent``
    (a callee traces only the calls of traced work).  Attribute names get the ``erlay.``
    prefix; None values are left out.  An exception marks the span as an error and
    propagates.  Where nothing is recorded the block gets an invalid span, whose
    :func:`carrier` is None.

    Cost: a block that records nothing is a shared no-op context manager (no generator, no
    OpenTelemetry call), and an unsampled key a slotted object and one context-variable set;
    the driver pays one of these per rollout phase (profiled: ``bench/telemetry.py
    --profile``)."""
    if not _state.tried_env:
        tracer()
    if (_state.provider is None or (child_only and not parent)
            or (parent is None and _quiet.get())):
        return _NOTHING
    if sample_key is not None and not sampled(sample_key):
        return _Quiet()
    return _recorded(name, parent, root, attributes)


@contextmanager
def _recorded(name: str, parent: Mapping[str, str] | None, root: bool,
              attributes: dict[str, Any]) -> Iterator[trace.Span]:
    attrs = {f"erlay.{k}": v for k, v in attributes.items() if v is not None}
    ctx = otel_context.Context() if root else parent_context(parent)
    with _state.tracer.start_as_current_span(name, context=ctx, attributes=attrs) as current:
        yield current


def start_span(name: str, parent: Mapping[str, str] | None = None,
               start_time: float | None = None, **attributes: Any) -> trace.Span:
    """A span that is not made current, for work that ends elsewhere (an engine request
    ends in the decode loop); the caller must ``end()`` it."""
    if not parent and _quiet.get():
        return trace.INVALID_SPAN
    attrs = {f"erlay.{k}": v for k, v in attributes.items() if v is not None}
    return tracer().start_span(name, context=parent_context(parent), attributes=attrs,
                               start_time=None if start_time is None else int(start_time * 1e9))
