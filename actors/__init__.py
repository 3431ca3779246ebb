"""The RL components as supervised children, and the job that wires them.

Rooms, each a subpackage with one responsibility (lower rooms never import higher ones):

- :mod:`erlay.actors.config` and :mod:`erlay.actors.rundir`: the job's typed config and its
  run directory, the vocabulary every room shares;
- :mod:`erlay.actors.model`: the policy model, tokenizer, seeded sampling, MTP, HF export;
- :mod:`erlay.actors.data`: datasets (``data.train``, ``data.validation``) loaded into checked
  rows;
- :mod:`erlay.actors.journal`: the durable rollout journal (format, folded state, reading);
- :mod:`erlay.actors.engine`: the generation engine protocol and its torch and vLLM backends;
- :mod:`erlay.actors.learner`: the GRPO learner, its rank actor and its checkpoints;
- :mod:`erlay.actors.observe`: telemetry, Ray metrics, ``erlay status`` and ``erlay report``;
- :mod:`erlay.actors.control`: the goodput controller's decisions, state and adaptive limits;
- :mod:`erlay.actors.job`: the coordinator, rollouts, domain clients and the job's tree;
- :mod:`erlay.actors.commands`: the ``run``, ``journal``, ``status`` and ``report``
  subcommands, registered through the ``erlay.commands`` entry points.

May import: erlay.supervisor, erlay.environments, erlay.sandbox, erlay.judges.
"""

import warnings as _warnings

# nvidia-resiliency-ext (async checkpoints) installs pynvml; torch then warns at import, in
# every process, that pynvml is deprecated.  erlay never uses pynvml itself.
_warnings.filterwarnings("ignore", message="The pynvml package is deprecated",
                         category=FutureWarning)
