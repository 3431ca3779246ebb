"""RL environments (tasks, multi-turn tool use), pluggable by import path.

- :mod:`erlay.environments.base`: the contract every environment keeps (:class:`Environment`,
  :class:`Episode`, :class:`StepResult`, :class:`ToolCall`) and :func:`load_environment`.
- :mod:`erlay.environments.arithmetic`: multi-digit addition with carries, single turn.
- :mod:`erlay.environments.tool_use`: compute with a Python tool call, then answer; multi-turn.

A new environment is one class implementing :class:`Environment`, named in the job config as
``"module:Class"``; nothing in erlay needs editing.

May import: erlay.supervisor.
"""


from erlay.environments.base import (
    Environment,
    Episode,
    EpisodeStateError,
    EpisodeStatus,
    Failure,
    InvalidEnvironmentConfig,
    InvalidStepResult,
    StepResult,
    ToolCall,
    load_environment,
    tool_output_from_result,
)

__all__ = [
    "Environment", "Episode", "EpisodeStateError", "EpisodeStatus", "Failure",
    "InvalidEnvironmentConfig", "InvalidStepResult", "StepResult", "ToolCall",
    "load_environment", "tool_output_from_result",
]
