"""The ``placement`` section of a job config: whether learner ranks and engines share devices
(``colocate``), and the deadlines of the engines' memory hand-off (docs/scaling.md,
"Colocated placement").

Kept beside :mod:`erlay.actors.config` (which includes it in :class:`JobConfig` and runs
:func:`colocation_fits` on the whole config).  The pairing is fixed: engine ``i`` shares
bundle ``i`` of one Ray placement group with learner rank ``i``, so a colocated job has as
many engines as ranks.  The bundle's GPUs are what the two children ask for,
``learner.num_gpus`` plus ``engine.vllm.num_gpus`` (the torch engine asks for none): no
second set of fractions to keep in step with them.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from erlay.actors.config.learner import LearnerSection


class PlacementSection(BaseModel):
    """Where the learner ranks and the engines run relative to each other."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    colocate: bool = Field(False, description="put learner rank i and engine i in bundle i "
                           "of one Ray placement group (one device between them, as two "
                           "processes and two fault domains); the engines sleep (free their "
                           "KV cache) for each train step, and generation and training "
                           "alternate instead of overlapping")
    bundle_cpus: float = Field(1.0, gt=0, description="colocate: CPUs each bundle reserves "
                               "(Ray's accounting; the children themselves ask for none, as "
                               "every erlay actor does); its GPUs are learner.num_gpus + "
                               "engine.vllm.num_gpus")
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="colocate: the placement group's strategy; a bundle is on "
        "one node whatever it is, STRICT_PACK puts every bundle on one node (PACK for ranks "
        "over several nodes)")
    ready_timeout_s: float = Field(120.0, gt=0, description="colocate: how long the job "
                                   "waits for the placement group's resources before it "
                                   "fails (exit 1), starting nothing")
    sleep_level: Literal[1, 2] = Field(2, description="vllm: the sleep level while the "
                                       "learner steps: 1 offloads the weights to host memory "
                                       "and drops the KV cache; 2 drops both, since the refit "
                                       "after each step replaces every weight (refused with "
                                       "a speculative_config, whose draft weights no refit "
                                       "reaches); the torch engine drops its KV cache either "
                                       "way and keeps its weights")
    sleep_timeout_s: float = Field(60.0, gt=0, description="colocate: deadline of one "
                                   "engine's sleep; past it the engine is logged and left to "
                                   "its supervisor, and the train step goes ahead")
    wake_timeout_s: float = Field(120.0, gt=0, description="colocate: deadline of one "
                                  "engine's wake-up (each of its two stages: weights before "
                                  "the refit, KV cache after it); past it the engine is "
                                  "logged and left to its supervisor")
    gpu_memory_gib: float | None = Field(None, gt=0, description="memory of each GPU the "
                                         "roles run on, GiB (e.g. 80 for an H100): `erlay "
                                         "run` refuses a learner rank, an engine or a "
                                         "colocated pair whose predicted memory does not "
                                         "fit it (`erlay run --dry-run` prints the "
                                         "estimates; docs/scaling.md); null: not checked")


class _Paired(Protocol):
    """What :func:`colocation_fits` reads of a JobConfig (not imported: the JobConfig's
    module imports this one)."""

    placement: PlacementSection
    engine: Any        # erlay.actors.config.EngineSection
    learner: LearnerSection


Config = TypeVar("Config", bound=_Paired)


def colocation_fits(cfg: Config) -> Config:
    """``cfg`` if its placement can run; else a ValueError that says which key to change.

    Checked at load time (a pydantic "after" validator of :class:`JobConfig`, so the message
    reaches the user as one line of :class:`~erlay.actors.config.ConfigError`, exit 2)."""
    placement, engine, learner = cfg.placement, cfg.engine, cfg.learner
    if not placement.colocate:
        return cfg
    if engine.num_engines != learner.num_ranks:
        raise ValueError(f"placement.colocate pairs engine i with learner rank i: "
                         f"engine.num_engines ({engine.num_engines}) must equal "
                         f"learner.num_ranks ({learner.num_ranks})")
    if engine.spares:
        raise ValueError(f"placement.colocate: engine.spares ({engine.spares}) must be 0 or "
                         "unset: a spare engine has no bundle to wait in")
    engine_gpus = engine.vllm.num_gpus if engine.backend == "vllm" else 0.0
    if learner.num_gpus + engine_gpus > 1.0:
        raise ValueError(f"placement.colocate shares one device per pair: learner.num_gpus "
                         f"({learner.num_gpus:g}) + engine.vllm.num_gpus ({engine_gpus:g}) "
                         "must be at most 1")
    if engine.backend == "vllm":
        if engine.vllm.num_gpus <= 0:
            raise ValueError("placement.colocate with engine.backend vllm needs GPUs: vLLM's "
                             "sleep mode runs on CUDA only (set engine.vllm.num_gpus, e.g. "
                             "0.5, and learner.num_gpus; or use engine.backend torch on CPU)")
        if placement.sleep_level == 2 and engine.vllm.speculative_config:
            raise ValueError("placement.sleep_level 2 discards the draft model's weights, "
                             "which no refit restores: use sleep_level 1 with "
                             "engine.vllm.speculative_config")
    return cfg
