"""Seeing a job: telemetry, Ray metrics, the live tree and the run report.

- :mod:`.telemetry`: the driver's telemetry hub (OpenTelemetry spans and metrics);
- :mod:`.metrics`: the same numbers as Ray application metrics, for the dashboard;
- :mod:`.status`: ``erlay status``, the live tree read through a named endpoint;
- :mod:`.dashboard`: a cluster's GCS address, found from its Ray dashboard URL;
- :mod:`.report`: ``erlay report``, Markdown and plots from a run directory;
- :mod:`.summary`: the run's ``summary.md`` and reward curve, written when the driver ends;
- :mod:`.attribution`: which fault domain cost the run what time;
- :mod:`.trackers`: the experiment trackers (TensorBoard, MLflow, W&B) fed the step metrics;
- :mod:`.goodput`: goodput's one definition (trained tokens per second of wall time) and
  the per-step counts of samples trained and not trained.

Contract: observing never changes the job; reports read only the run directory.

May import: erlay.supervisor, erlay.actors.config, erlay.actors.rundir.
"""
