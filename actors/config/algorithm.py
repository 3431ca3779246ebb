"""The ``algorithm`` section of a job config: which policy objective the learner trains with
(:mod:`erlay.actors.learner.objectives`) and each objective's own knobs.

Each objective's knobs live in a subsection named after it; setting a subsection of an
objective the job does not train with is an error (it would be silently ignored).  The
learner's ``clip_eps``, ``is_cap`` and ``kl_coef`` apply to every objective unless an
objective's own clip range replaces ``clip_eps`` (dapo, gspo).  Kept beside
:mod:`erlay.actors.config`, which includes it in :class:`JobConfig` and resolves it against
the engine's budget (:func:`objective`).

May import: erlay.actors.learner.objectives.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from erlay.actors.learner.objectives import Name, Objective


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class DrGrpoSection(Section):
    """Dr. GRPO (Liu et al. 2025, eq. 2-3)."""

    max_tokens: int | None = Field(None, ge=1, description="the constant each completion's "
                                   "token sum is divided by (null: engine.max_new_tokens)")


class DapoSection(Section):
    """DAPO (Yu et al. 2025): decoupled clip (eq. 8), dynamic sampling, overlong shaping
    (eq. 13); token-level aggregation is the learner's token mean."""

    clip_low: float = Field(0.2, gt=0, lt=1, description="ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, gt=0, le=10, description="ratio clip above: "
                             "1 + clip_high (clip-higher keeps low-probability tokens "
                             "explorable)")
    overlong_buffer: int | None = Field(None, ge=0, description="tokens before the budget "
                                        "where the overlong penalty ramps from 0 to "
                                        "-overlong_penalty (null: a fifth of "
                                        "engine.max_new_tokens, at least 1; 0: no shaping)")
    overlong_penalty: float = Field(1.0, ge=0, description="the penalty at the budget")
    dynamic_sampling: bool = Field(True, description="drop groups whose rewards are all "
                                   "equal (no learning signal) and refill the step with new "
                                   "groups")
    max_fill_rounds: int = Field(3, ge=0, le=20, description="refill rounds per step at "
                                 "most; a step still short after them trains on the groups "
                                 "it has")
    fill_budget: float = Field(0.5, ge=0, le=64, description="refill groups per step at "
                               "most, as a multiple of rollout.prompts_per_step (0.5: a step "
                               "plays at most 1.5 times its own groups): what dynamic "
                               "sampling may add to a step's generation")


class GspoSection(Section):
    """GSPO (Zheng et al. 2025, eq. 5-7): sequence-level ratio and clip."""

    clip_low: float = Field(3e-4, gt=0, lt=1, description="sequence-ratio clip below")
    clip_high: float = Field(4e-4, gt=0, le=10, description="sequence-ratio clip above")


class AlgorithmSection(Section):
    """The policy objective.  See docs/algorithms.md for how to choose one."""

    name: Name = Field("grpo", description="grpo | dr_grpo | dapo | gspo | rloo | "
                       "reinforce_pp")
    dr_grpo: DrGrpoSection = DrGrpoSection()
    dapo: DapoSection = DapoSection()
    gspo: GspoSection = GspoSection()

    @model_validator(mode="after")
    def _knobs_of_the_chosen_one(self) -> AlgorithmSection:
        # Compared with the defaults, not with the keys given: a run directory's saved
        # config writes every subsection out.
        for other in ("dr_grpo", "dapo", "gspo"):
            if other != self.name and getattr(self, other) != type(getattr(self, other))():
                raise ValueError(f"algorithm.{other} is set but algorithm.name is "
                                 f"{self.name!r}: its knobs would be ignored")
        return self

    @property
    def dynamic_sampling(self) -> bool:
        """Whether the coordinator drops all-equal groups and refills the step."""
        return self.name == "dapo" and self.dapo.dynamic_sampling

    @property
    def max_fill_rounds(self) -> int:
        return self.dapo.max_fill_rounds if self.dynamic_sampling else 0

    def max_fill_groups(self, prompts_per_step: int) -> int:
        """The refill groups a step may play at most."""
        return int(self.dapo.fill_budget * prompts_per_step) if self.dynamic_sampling else 0


def objective(section: AlgorithmSection, max_new_tokens: int) -> Objective:
    """The learner's :class:`Objective` for ``section``, with budgets defaulting to the
    engine's ``max_new_tokens``."""
    match section.name:
        case "dr_grpo":
            return Objective("dr_grpo", max_tokens=section.dr_grpo.max_tokens or max_new_tokens)
        case "dapo":
            d = section.dapo
            buffer = max(1, max_new_tokens // 5) if d.overlong_buffer is None \
                else d.overlong_buffer
            return Objective("dapo", clip_low=d.clip_low, clip_high=d.clip_high,
                             overlong_max=max_new_tokens,
                             overlong_buffer=min(buffer, max_new_tokens),
                             overlong_penalty=d.overlong_penalty)
        case "gspo":
            return Objective("gspo", clip_low=section.gspo.clip_low,
                             clip_high=section.gspo.clip_high)
        case name:
            return Objective(name)
