"""The ``logging`` section of a job config: the experiment trackers a run's metrics go to.

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig`), as
:mod:`erlay.actors.config.data` is.  Feeding the trackers is
:mod:`erlay.actors.observe.trackers`' job; this module only says what the keys mean.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class MlflowSection(_Section):
    tracking_uri: str = Field(description="MLflow tracking URI: http(s)://host:port of a "
                              "tracking server, or a database such as sqlite:///abs/mlflow.db "
                              "(recent MLflow refuses plain file stores)")
    experiment: str | None = Field(None, description="experiment name (created when "
                                   "missing); null = the run's name (run.name)")
    artifact_location: str | None = Field(None, description="where a new experiment keeps "
                                          "its artifacts; null = the server's default, or "
                                          "for sqlite:///PATH a directory mlartifacts beside "
                                          "the database")
    request_timeout_s: float = Field(10.0, gt=0, description="http(s) URIs: seconds one "
                                     "request may take before the tracker counts as failed")
    retries: int = Field(2, ge=0, description="http(s) URIs: retries of a failed request")


class WandbSection(_Section):
    project: str = Field(description="W&B project")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="online: sync as the run goes (needs network and a login); "
        "offline: write RUN_DIR/wandb/offline-run-* for a later `wandb sync`; disabled: no-op")
    entity: str | None = Field(None, description="W&B team or user; null = the login's "
                               "default")


class LoggingSection(_Section):
    """Experiment trackers.  Each gets the per-step scalars (docs/observability.md,
    "Experiment tracking"); one that fails warns once and its records go to
    RUN_DIR/tracker-fallback.jsonl, training goes on."""

    tensorboard: bool = Field(False, description="write TensorBoard scalars to "
                              "RUN_DIR/tensorboard")
    mlflow: MlflowSection | None = Field(None, description="{tracking_uri, experiment, "
                                         "artifact_location, request_timeout_s, retries}: "
                                         "log metrics, the flattened config as params and "
                                         "the final HF export as an artifact to MLflow (pip "
                                         "install 'erlay[tracking]')")
    wandb: WandbSection | None = Field(None, description="{project, mode, entity}: log "
                                       "metrics and the config to Weights & Biases (pip "
                                       "install 'erlay[tracking]')")
