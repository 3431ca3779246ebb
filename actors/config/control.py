"""The ``control`` section of a job config: the goodput controller's bounds.

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig`), as
:mod:`erlay.actors.config.data` is.  What the controller does with them is
:mod:`erlay.actors.control`'s; this module only says what the keys mean.  Every action the
controller takes stays inside these bounds, and ``control.enabled: false`` turns it off
(the job then runs with the static limits of ``sandbox`` and ``judge``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class EngineControl(_Section):
    """Engine health: each engine's recent per-request decode rate against its peers'."""

    window: int = Field(16, ge=2, description="recent finished streams per engine its rate "
                        "is the median of")
    min_samples: int = Field(4, ge=1, description="streams an engine needs before it is "
                             "judged (and, after being routed away, before it is judged "
                             "recovered)")
    slow_ratio: float = Field(0.5, gt=0, lt=1, description="route new rollouts away from an "
                              "engine whose rate is below this share of its peers' median ...")
    slow_ticks: int = Field(3, ge=1, description="... at this many judgements in a row (one a "
                            "second): a moment's imbalance is not a slow engine")
    recover_ratio: float = Field(0.8, gt=0, le=1, description="an engine on trial is healthy "
                                 "again once its rate is at least this share of its peers'")
    retry_s: float = Field(10.0, gt=0, description="an engine routed away gets a trial (its "
                           "share of new rollouts again, so it is measured under the same "
                           "load as its peers) after this long; doubled after each failed "
                           "trial ...")
    retry_max_s: float = Field(120.0, gt=0, description="... up to this")
    max_failures: int = Field(3, ge=1, description="stream failures within failure_window_s "
                              "after which a live engine is drained and restarted")
    failure_window_s: float = Field(60.0, gt=0, description="seconds failures are counted in")
    restart_after_s: float = Field(300.0, gt=0, description="an engine routed away this long "
                                   "and still slow is drained and restarted")
    drain_timeout_s: float = Field(30.0, gt=0, description="the longest a restart waits for "
                                   "the engine's rollouts in flight to move or finish")
    intensity_headroom: int = Field(1, ge=0, description="restarts of the generation domain's "
                                    "intensity left to real faults: the controller restarts "
                                    "only while more than this many remain")


class HedgeControl(_Section):
    """Straggler hedging: the step's last rollouts, re-dispatched from their prefix."""

    enabled: bool = Field(True, description="hedge stragglers (torch engine only: a hedge "
                          "continues from the journaled prefix with the same (seed, "
                          "position) sampling, so either copy's tokens are the rollout's)")
    percentile: float = Field(0.9, gt=0, lt=1, description="a turn is a straggler once it "
                              "runs longer than this percentile of recent turns ...")
    factor: float = Field(1.5, ge=1, description="... times this factor")
    floor_s: float = Field(0.5, ge=0, description="... and at least this long")
    tail_fraction: float = Field(0.25, gt=0, le=1, description="hedge only while at most this "
                                 "share of the awaited step's rollouts is unfinished")
    max_per_step: int = Field(16, ge=1, description="hedges a step may start")
    min_samples: int = Field(32, ge=1, description="turn latencies needed before hedging")


class CallControl(_Section):
    """Adaptive limits for calls into one domain (the sandbox, the judge)."""

    enabled: bool = Field(True, description="adapt this domain's deadline and concurrency")
    deadline_percentile: float = Field(0.99, gt=0, lt=1, description="a call's deadline "
                                       "follows this percentile of recent call latencies ...")
    deadline_multiplier: float = Field(3.0, ge=1, description="... times this multiplier ...")
    deadline_floor_s: float = Field(1.0, gt=0, description="... never below this, and never "
                                    "above the domain's configured deadline")
    min_samples: int = Field(20, ge=1, description="completed calls before the deadline adapts")
    window: int = Field(256, ge=8, description="recent call latencies kept")
    min_concurrency: int = Field(1, ge=1, description="AIMD: the concurrency never falls "
                                 "below this")
    max_concurrency: int = Field(1024, ge=1, description="AIMD: nor rises above this, "
                                 "where a host starts: only congestion lowers it (a step's "
                                 "calls to a host travel together, so a low start would "
                                 "split them into rounds)")
    increase: float = Field(1.0, gt=0, description="AIMD: added per call that met its deadline, "
                            "divided by the current limit (one per round of calls)")
    decrease: float = Field(0.5, gt=0, lt=1, description="AIMD: the limit is multiplied by "
                            "this on a call that hit its deadline")

    @model_validator(mode="after")
    def _bounds(self) -> CallControl:
        if self.min_concurrency > self.max_concurrency:
            raise ValueError(f"min_concurrency ({self.min_concurrency}) must not exceed "
                             f"max_concurrency ({self.max_concurrency})")
        return self


class ControlSection(_Section):
    """The goodput controller (:mod:`erlay.actors.control`)."""

    enabled: bool = Field(True, description="run the goodput controller; false: static "
                          "routing (least loaded), no hedging, the configured deadlines")
    engine: EngineControl = EngineControl()
    hedge: HedgeControl = HedgeControl()
    sandbox: CallControl = CallControl()
    judge: CallControl = CallControl()
