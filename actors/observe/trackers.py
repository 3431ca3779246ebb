"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed the job's metrics records.

:class:`Trackers` is the fan-out the driver feeds with every metrics record it writes to
``metrics.jsonl`` (:meth:`erlay.actors.job.driver.Job.report_metrics`).  Each record of an RL
step or a validation becomes a set of scalars under stable names (:func:`scalars`; the list
is in docs/observability.md, "Experiment tracking"), logged at the record's step to every
tracker ``logging`` enables:

- ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (torch's ``SummaryWriter``);
- ``mlflow``: one MLflow run in the experiment (default: ``run.name``), named after the run
  directory, with the whole config flattened into params (``model.hf``, ...) and, at the end,
  the run's final HF export as the artifact directory ``hf-export``;
- ``wandb``: one W&B run (``mode: offline`` writes ``RUN_DIR/wandb/offline-run-*``).

Contract: tracking never stops or slows training.  Records are queued and the trackers are
driven from one background thread, so a slow server costs the job nothing; a tracker that
raises (unreachable, full disk, a broken client) is warned about once, with the reason, and
switched off, and from then on every record also goes to ``RUN_DIR/tracker-fallback.jsonl``
(one JSON object a line: ``phase``, ``step``, ``trackers`` (the ones that are off), and
``scalars``).  :meth:`Trackers.close` waits a bounded time for the queue to drain.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from erlay.actors.config import LoggingSection

log = logging.getLogger("erlay.trackers")

FALLBACK = "tracker-fallback.jsonl"
DOMAINS = ("learner", "generation", "sandbox", "judge", "environment", "rollout")
"""Fault domains whose restarts and time lost are logged from step 0 (at 0 until the first
failure), so a dashboard shows 0 rather than no data; others appear when they first fail."""

RL_SCALARS = {
    "reward_mean": "reward/mean", "accuracy": "reward/accuracy", "loss": "loss", "kl": "kl",
    "clip_fraction": "clip_fraction", "grad_norm": "grad_norm",
    "tokens_per_s": "throughput/tokens_per_s", "rollouts_per_s": "throughput/rollouts_per_s",
    "goodput": "goodput", "time_efficiency": "time_efficiency",
    "staleness_max": "staleness/max", "restarts": "restarts/total",
    "lost_s": "time_lost_s/step", "judge_failed": "failures/judge",
    "user_errors": "failures/user_code", "masked_stale": "samples/masked_stale",
    "filtered": "samples/filtered", "filtered_groups": "samples/filtered_groups",
    "sandbox_calls": "sandbox/calls", "step_s": "time/step_s",
}
"""An RL record's field -> its scalar's name."""

VALIDATION_SCALARS = {"val_reward": "val/reward", "val_accuracy": "val/accuracy",
                      "val_failures": "val/failures"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def scalars(record: Mapping[str, Any], totals: Mapping[str, Mapping[str, float]] | None = None,
            sandbox_failed: float | None = None) -> dict[str, float]:
    """The scalars of one metrics ``record`` under their tracker names; ``{}`` for a phase
    other than ``rl`` and ``validation``.  ``totals`` (RL records): the run's running totals
    (:meth:`erlay.actors.observe.telemetry.JobTelemetry.totals`), giving
    ``restarts/<domain>`` and ``time_lost_s/<domain>``; ``sandbox_failed``: the sandbox runs of
    this step whose outcome was not ``ok`` (``failures/sandbox``).  Fields that are absent,
    None or not finite numbers are left out.  Pure."""
    phase = record.get("phase")
    names = RL_SCALARS if phase == "rl" else VALIDATION_SCALARS if phase == "validation" else {}
    out = {name: v for field, name in names.items()
           if (v := _number(record.get(field))) is not None}
    if phase != "rl":
        return out
    if sandbox_failed is not None:
        out["failures/sandbox"] = float(sandbox_failed)
    if totals is not None:
        for key, prefix in (("restarts", "restarts"), ("lost_s", "time_lost_s")):
            by_domain = totals.get(key, {})
            for domain in sorted(set(DOMAINS) | set(by_domain)):
                out[f"{prefix}/{domain}"] = float(by_domain.get(domain, 0.0))
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"model.hf": "...", ...}``: dotted keys, values as strings (lists
    and empty mappings as JSON).  Pure."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, str):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


def sandbox_failures(outcomes: Mapping[str, float]) -> float:
    """Sandbox runs, of the totals by outcome, that did not end ``ok``.  Pure."""
    return float(sum(n for kind, n in outcomes.items() if kind != "ok"))


class Tracker(Protocol):
    """One experiment tracker.  Every method may raise; :class:`Trackers` contains it."""

    name: str
    wants_export: bool

    def open(self) -> None: ...

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, status: str, export: Path | None) -> None: ...


class TensorBoardTracker:
    """Scalars to ``directory`` (TensorBoard's event files), flushed every record."""

    name = "tensorboard"
    wants_export = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self, status: str, export: Path | None) -> None:
        if self.writer is not None:
            self.writer.close()


def default_artifacts(tracking_uri: str) -> str | None:
    """Where a new experiment of a ``sqlite:///PATH`` store keeps its artifacts: the
    directory ``mlartifacts`` beside the database (MLflow's own default is ``./mlruns`` in
    the working directory, wherever the job was started); None for any other URI (the
    server decides).  Pure."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or tracking_uri == prefix + ":memory:":
        return None
    return str(Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts")


class MlflowTracker:
    """One MLflow run: params at open, metrics per record, the HF export at close."""

    name = "mlflow"
    wants_export = True
    MAX_PARAMS = 100   # per log_batch call (MLflow's limit)

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 params: Mapping[str, str], *, artifact_location: str | None = None,
                 timeout_s: float = 10.0, retries: int = 2) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.artifact_location = artifact_location or default_artifacts(tracking_uri)
        self.params = dict(params)
        self.timeout_s, self.retries = timeout_s, retries
        self.client: Any = None
        self.run_id: str | None = None

    def open(self) -> None:
        if self.tracking_uri.startswith(("http://", "https://")):
            # MLflow's REST client reads its timeout and retries from the environment at
            # each request (no client argument); without them a dead server holds a request
            # for minutes.  Set for this process: one job, one MLflow server.
            os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, math.ceil(self.timeout_s)))
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(self.retries)
        from mlflow import MlflowClient
        from mlflow.entities import Param
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (found.experiment_id if found is not None else
                         self.client.create_experiment(
                             self.experiment, artifact_location=self.artifact_location))
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        # MLflow caps a param's value (6000 characters in MLflow 3).
        items = [Param(k, v[:6000]) for k, v in sorted(self.params.items())]
        for i in range(0, len(items), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + self.MAX_PARAMS])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in values.items()])

    def close(self, status: str, export: Path | None) -> None:
        if self.run_id is None:
            return
        if export is not None:
            self.client.log_artifacts(self.run_id, str(export), "hf-export")
        self.client.set_terminated(self.run_id, "FINISHED" if status == "finished" else "FAILED")


class WandbTracker:
    """One W&B run, its files under ``directory`` (``wandb/`` inside it)."""

    name = "wandb"
    wants_export = False

    def __init__(self, project: str, mode: str, entity: str | None, run_name: str,
                 params: Mapping[str, str], directory: Path) -> None:
        self.project, self.mode, self.entity = project, mode, entity
        self.run_name, self.params, self.directory = run_name, dict(params), directory
        self.run: Any = None
        self._last_step = 0

    def open(self) -> None:
        import wandb
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                              name=self.run_name, dir=str(self.directory), config=self.params,
                              reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        # W&B drops a record whose step is below the last one (a rewind replays steps).
        self._last_step = max(self._last_step, step)
        self.run.log(dict(values), step=self._last_step)

    def close(self, status: str, export: Path | None) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)


def trackers_for(cfg: LoggingSection, run_dir: Path, run_name: str, run_label: str,
                 params: Mapping[str, str]) -> list[Tracker]:
    """The trackers ``cfg`` enables, not yet opened.  ``run_name``: ``run.name`` (the MLflow
    experiment's default); ``run_label``: this run's own name (the run directory's)."""
    out: list[Tracker] = []
    if cfg.tensorboard:
        out.append(TensorBoardTracker(run_dir / "tensorboard"))
    if cfg.mlflow is not None:
        m = cfg.mlflow
        out.append(MlflowTracker(m.tracking_uri, m.experiment or run_name, run_label, params,
                                 artifact_location=m.artifact_location,
                                 timeout_s=m.request_timeout_s, retries=m.retries))
    if cfg.wandb is not None:
        w = cfg.wandb
        out.append(WandbTracker(w.project, w.mode, w.entity, run_label, params, run_dir))
    return out


Export = Callable[[Path], Path]
"""Writes the run's final HF export into the given empty directory; returns the directory
to upload (raises when the run cannot be exported)."""


class Trackers:
    """The fan-out (module docstring).  ``start`` once, ``log`` per record, ``close`` once;
    none raises for a tracker's failure.  ``start`` and ``log`` return at once (the work is
    the background thread's); ``close`` waits for it, a bounded time."""

    def __init__(self, trackers: Iterable[Tracker], run_dir: Path) -> None:
        self.trackers = list(trackers)
        self.fallback = run_dir / FALLBACK
        self.failed: dict[str, str] = {}   # tracker name -> why it is off
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._sandbox_seen = 0.0
        self._fallback_broken = False

    @classmethod
    def for_job(cls, cfg: Any, run_dir: Path) -> Trackers:
        """The trackers of job config ``cfg`` (its ``logging`` section) for ``run_dir``."""
        params = flatten(cfg.model_dump(by_alias=True, mode="json"))
        return cls(trackers_for(cfg.logging, run_dir, cfg.run.name, run_dir.name, params),
                   run_dir)

    def start(self) -> None:
        if not self.trackers or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._work, name="erlay-trackers", daemon=True)
        self._thread.start()
        self._queue.put(("open", None))

    def log(self, record: Mapping[str, Any],
            totals: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """Queue one metrics record (``totals``: as :func:`scalars` takes them)."""
        if self._thread is None or record.get("phase") not in ("rl", "validation"):
            return
        failed = None
        if totals is not None and record.get("phase") == "rl":
            seen = sandbox_failures(totals.get("sandbox", {}))
            failed, self._sandbox_seen = seen - self._sandbox_seen, seen
        values = scalars(record, totals, failed)
        if values:
            self._queue.put(("log", (record.get("phase"), int(record.get("step", 0)), values)))

    def close(self, status: str, export: Export | None = None, timeout_s: float = 300.0) -> None:
        """Drain the queue, upload the export to the trackers that take one (``export`` is
        called only then; a failed export is warned about, the trackers still close), close
        every tracker.  Waits at most ``timeout_s``; a tracker still busy then is left to
        its daemon thread."""
        if self._thread is None:
            return
        self._queue.put(("close", (status, export)))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracking: the trackers did not finish within %.0f s; left behind",
                        timeout_s)
        self._thread = None

    # ----------------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            kind, item = self._queue.get()
            if kind == "open":
                for t in self.trackers:
                    self._guard(t, t.open)
            elif kind == "log":
                phase, step, values = item
                for t in self._live():
                    self._guard(t, t.log, step, values)
                if self.failed:
                    self._keep({"phase": phase, "step": step,
                                "trackers": sorted(self.failed), "scalars": values})
            else:
                self._finish(*item)
                return

    def _finish(self, status: str, export: Export | None) -> None:
        out: Path | None = None
        tmp: str | None = None
        if export is not None and any(t.wants_export for t in self._live()):
            tmp = tempfile.mkdtemp(prefix="erlay-export-")
            try:
                out = export(Path(tmp) / "hf")
            except Exception as exc:  # noqa: BLE001 - no artifact; the trackers still close
                log.warning("tracking: the final HF export failed, no artifact is logged: "
                            "%s: %s", type(exc).__name__, exc)
        try:
            for t in self._live():
                self._guard(t, t.close, status, out if t.wants_export else None)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _live(self) -> list[Tracker]:
        return [t for t in self.trackers if t.name not in self.failed]

    def _guard(self, tracker: Tracker, call: Callable[..., None], *args: Any) -> None:
        if tracker.name in self.failed:
            return
        try:
            call(*args)
        except Exception as exc:  # noqa: BLE001 - any tracker failure: off, never the job
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.failed[tracker.name] = why[:500]
            log.warning("tracking: %s failed and is off for the rest of the run (%s); its "
                        "records go to %s", tracker.name, why[:500], self.fallback)
            try:
                tracker.close("failed", None)
            except Exception:  # it is off already; closing it is a courtesy
                log.debug("tracking: closing %s failed", tracker.name, exc_info=True)

    def _keep(self, line: Mapping[str, Any]) -> None:
        if self._fallback_broken:
            return
        try:
            with self.fallback.open("a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            self._fallback_broken = True
            log.warning("tracking: %s cannot be written (%s); tracker records are dropped",
                        self.fallback, exc)
