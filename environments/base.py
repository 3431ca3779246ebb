"""The environment contract: one interface for single-turn and multi-turn episodes.

A generic rollout coordinator drives every environment the same way::

    episode = env.reset(index, seed)
    for _ in range(env.max_turns):
        completion = policy(context)                 # decoded text, up to (not incl.) EOS
        episode, result = env.step(episode, completion)
        if result.done:
            break                                    # score result.judge_input, or take
                                                     # result.reward as is
        text, ok = tool_output_from_result(sandbox.run(result.tool_call))
        episode, observation = env.observe(episode, text, ok)
        context += completion + observation          # then generate the next turn

Contracts every environment keeps:

- **Pure and deterministic.**  ``reset`` depends only on ``(index, seed)``; ``step`` and
  ``observe`` only on their arguments.  Episodes are immutable values, so a coordinator that
  recovers from its journal replays a rollout by calling the same methods again.
- **Model output never raises.**  A malformed completion ends the episode with
  ``reward=0.0`` and a ``failure`` reason, or (where the environment allows another turn)
  becomes an error observation.  Only a *coordinator* bug raises: stepping a finished
  episode or observing when no tool call is pending raises :class:`EpisodeStateError`.
- **Bounded.**  An episode ends within ``max_turns`` calls to ``step``: the step that would
  leave no turn for an answer ends it with a failure instead.
- **Text stays in the tokenizer's alphabet.**  The built-in environments' prompts,
  observations and demonstrations use only :data:`TEXT_ALPHABET` characters (printable ASCII,
  space and newline), the alphabet of the built-in model's character tokenizer, so nothing
  they write becomes an unknown token there.  An HF model's own tokenizer (the CPU default's
  byte-level BPE included) takes any text.

A new environment is one class implementing :class:`Environment`, referenced from the job
config as ``"module:Class"`` and built by :func:`load_environment`; no edit to erlay.

Example, the built-in arithmetic environment: a malformed answer ends the episode with
reward 0 and says why, it never raises::

    >>> from erlay.environments.arithmetic import ArithmeticEnv
    >>> env = ArithmeticEnv()
    >>> episode = env.reset(0, 1)
    >>> episode, result = env.step(episode, "banana")
    >>> result.done, result.reward, result.failure
    (True, 0.0, 'malformed answer')
"""

from __future__ import annotations

import enum
import string
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from erlay.supervisor.errors import ErlayError
from erlay.supervisor.imports import import_path

# Mirrors erlay.actors.model.tokenizer.ALPHABET (environments may not import actors; a test checks
# that the two agree).
TEXT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
_TEXT_CHARS = frozenset(TEXT_ALPHABET)


class EpisodeStateError(ErlayError):
    """A coordinator called ``step`` or ``observe`` out of order (never raised for model
    output): stepping a finished episode, stepping while a tool result is pending, or
    observing when no tool call is pending."""


class InvalidStepResult(ErlayError, ValueError):
    """A :class:`StepResult` breaks its invariants; an environment bug, caught at once."""


class InvalidEnvironmentConfig(ErlayError, ValueError):
    """An environment was constructed with a bad parameter; the message names it."""

    def __init__(self, param: str, value: object, expected: str) -> None:
        self.param = param
        self.value = value
        self.expected = expected
        super().__init__(f"{param}: expected {expected}, got {value!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Survives pickling (inside a RayTaskError): rebuild from the fields, not the message.
        return (type(self), (self.param, self.value, self.expected))


def check_param(valid: bool, param: str, value: object, expected: str) -> None:
    """Raise :class:`InvalidEnvironmentConfig` unless ``valid``."""
    if not valid:
        raise InvalidEnvironmentConfig(param, value, expected)


class Failure(enum.StrEnum):
    """Reasons the built-in environments record for malformed output.  A StrEnum, so it
    journals as the plain string; other environments may record any short string."""

    NO_ANSWER_TAG = "no answer tag"
    EMPTY_ANSWER = "empty answer"
    MALFORMED_ANSWER = "malformed answer"
    UNPARSEABLE_TOOL_CALL = "unparseable tool call"
    TOO_MANY_TOOL_CALLS = "too many tool calls"
    MAX_TURNS = "max turns exceeded"
    ANSWER_WITHOUT_TOOL_CALL = "answer without tool call"


class EpisodeStatus(enum.StrEnum):
    """Where an episode stands: the next call the coordinator may make on it."""

    GENERATING = "generating"        # the policy generates; then ``step``
    AWAITING_TOOL = "awaiting_tool"  # a tool call is pending; run it, then ``observe``
    DONE = "done"                    # finished; score it, call nothing else


@dataclass(frozen=True)
class Episode:
    """One episode's state: a plain, JSON-serialisable value (journaled by the coordinator).

    ``answer`` is the ground truth handed to the judge ("" for judge-free tasks); ``turn``
    counts the completions stepped so far and ``tool_calls`` the tool calls issued.
    ``metadata`` holds environment-specific, JSON-serialisable extras.
    """

    episode_id: str
    prompt: str
    answer: str
    turn: int = 0
    tool_calls: int = 0
    status: EpisodeStatus = EpisodeStatus.GENERATING
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Episode:
        return Episode(episode_id=str(data["episode_id"]), prompt=str(data["prompt"]),
                       answer=str(data["answer"]), turn=int(data.get("turn", 0)),
                       tool_calls=int(data.get("tool_calls", 0)),
                       status=EpisodeStatus(data.get("status", EpisodeStatus.GENERATING)),
                       metadata=dict(data.get("metadata") or {}))


@dataclass(frozen=True)
class ToolCall:
    """Code the coordinator runs in the sandbox on the episode's behalf."""

    code: str
    language: str = "python"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> ToolCall:
        return ToolCall(str(data["code"]), str(data.get("language", "python")))


@dataclass(frozen=True)
class StepResult:
    """What one completion did to the episode.  Exactly one of three shapes:

    - ``done=False, tool_call=...``: run the tool call, then :meth:`Environment.observe`.
    - ``done=True, judge_input=...``: score ``judge_input`` against ``episode.answer``.
    - ``done=True, reward=...``: the reward is final, no judge (e.g. malformed output: 0.0
      with ``failure`` saying why).

    Violating this raises :class:`InvalidStepResult` at construction.
    """

    done: bool
    tool_call: ToolCall | None = None
    judge_input: str | None = None
    reward: float | None = None
    failure: str | None = None

    def __post_init__(self) -> None:
        if not self.done:
            if self.tool_call is None or self.judge_input is not None \
                    or self.reward is not None or self.failure is not None:
                raise InvalidStepResult("a step that is not done carries exactly a tool_call")
            return
        if self.tool_call is not None:
            raise InvalidStepResult("a finished step carries no tool_call")
        if (self.judge_input is None) == (self.reward is None):
            raise InvalidStepResult("a finished step carries exactly one of judge_input, reward")
        if self.failure is not None and self.reward is None:
            raise InvalidStepResult("a failure carries its reward (the judge is not consulted)")

    @property
    def needs_judge(self) -> bool:
        return self.done and self.judge_input is not None

    @staticmethod
    def failed(failure: str) -> StepResult:
        """The episode ends with reward 0.0 because of malformed output."""
        return StepResult(done=True, reward=0.0, failure=str(failure))

    def to_dict(self) -> dict[str, Any]:
        return {"done": self.done,
                "tool_call": self.tool_call.to_dict() if self.tool_call else None,
                "judge_input": self.judge_input, "reward": self.reward,
                "failure": None if self.failure is None else str(self.failure)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> StepResult:
        call = data.get("tool_call")
        reward = data.get("reward")
        return StepResult(done=bool(data["done"]),
                          tool_call=ToolCall.from_dict(call) if call else None,
                          judge_input=data.get("judge_input"),
                          reward=None if reward is None else float(reward),
                          failure=data.get("failure"))


@runtime_checkable
class Environment(Protocol):
    """An RL environment.  See the module docstring for the contract all methods share.

    ``name`` names the task in episode ids and reports.  ``max_turns`` bounds the calls to
    ``step`` per episode (1 for a single-turn task).
    """

    name: str
    max_turns: int

    def reset(self, index: int, seed: int) -> Episode:
        """Episode ``index`` of the stream drawn with ``seed``; the same pair gives the same
        episode in any process."""
        ...

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        """Consume one completion (decoded text, without EOS).  Never raises for malformed
        output; raises :class:`EpisodeStateError` unless ``episode.status`` is GENERATING."""
        ...

    def observe(self, episode: Episode, tool_output: str,
                ok: bool = True) -> tuple[Episode, str]:
        """Take the result of the pending tool call and return the observation text to
        append to the context before the next turn.

        ``tool_output`` is what the program printed when ``ok``, else a short description
        of the failure ("timeout", "ZeroDivisionError: division by zero"); see
        :func:`tool_output_from_result`.  Raises :class:`EpisodeStateError` unless
        ``episode.status`` is AWAITING_TOOL.
        """
        ...

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        """A correct episode as ``(context, target)`` pairs, one per turn, for the short
        supervised warm start.  Targets exclude EOS (the trainer appends it).  The first
        context is ``episode.prompt``; each later context starts with the previous context
        plus the previous target and continues with the observation, so a trainer that keeps
        EOS between turns can rebuild the exact token context the policy will see."""
        ...


_MEMBERS = ("reset", "step", "observe", "demonstration")


def _missing_members(obj: Any, data: bool) -> list[str]:
    missing = [m for m in _MEMBERS if not callable(getattr(obj, m, None))]
    if data:
        if not isinstance(getattr(obj, "name", None), str):
            missing.append("name (str)")
        turns = getattr(obj, "max_turns", None)
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            missing.append("max_turns (int >= 1)")
    return missing


def load_environment(path: str, **kwargs: Any) -> Environment:
    """Build the environment at ``"module:Class"`` with ``kwargs``.

    Raises ValueError for a malformed path, ImportError naming the module when it cannot be
    imported, AttributeError naming the class when the module lacks it, and TypeError naming
    the missing members when the class (checked before it is built) or the built object does
    not implement :class:`Environment`.  Errors the constructor raises propagate unchanged.
    """
    target = import_path(path, "environment")
    if not callable(target):
        raise TypeError(f"environment {path!r} is not a class or factory: {target!r}")
    if isinstance(target, type):
        missing = _missing_members(target, data=False)
        if missing:
            raise TypeError(f"{path} does not implement the Environment interface: missing "
                            f"{', '.join(missing)}")
    env = target(**kwargs)
    missing = _missing_members(env, data=True)
    if missing:
        raise TypeError(f"{path} does not implement the Environment interface: missing "
                        f"{', '.join(missing)}")
    return env  # type: ignore[no-any-return]


# Sandbox outcomes (erlay.sandbox.results.Outcome values) and the short text an observation shows.
_OUTCOME_TEXT = {"timeout": "timeout", "memory": "memory limit", "file_size": "file too large",
                 "output_limit": "too much output", "killed": "killed",
                 "spawn_failed": "sandbox unavailable",
                 "poison": "the tool call killed its sandbox twice"}


def tool_output_from_result(result: Mapping[str, Any]) -> tuple[str, bool]:
    """``(text, ok)`` for :meth:`Environment.observe` from a sandbox result dict.

    A run that exited 0 gives its stdout and ``ok=True``.  A failed run gives
    ``ok=False`` and a short cause: for ``error`` the last line of stderr (the exception,
    "NameError: name 'x' is not defined"), otherwise the outcome in words ("timeout").
    Pure, so the coordinator and the tests share it without importing the sandbox.
    """
    outcome = str(result.get("outcome", ""))
    if outcome == "ok":
        return str(result.get("stdout") or ""), True
    if outcome == "error":
        lines = [ln for ln in str(result.get("stderr") or "").splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip(), False
        return f"exit code {result.get('exit_code')}", False
    return _OUTCOME_TEXT.get(outcome, outcome or "error"), False


def sanitize_text(text: str) -> str:
    """``text`` with every character outside :data:`TEXT_ALPHABET` replaced: tabs and
    carriage returns by a space, anything else by ``?``."""
    if all(ch in _TEXT_CHARS for ch in text):
        return text
    return "".join(ch if ch in _TEXT_CHARS else (" " if ch in "\t\r" else "?") for ch in text)
