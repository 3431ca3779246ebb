"""The judge contract: a judgement, the judge protocols, and loading a judge by import path.

A judge turns ``(judge_input, answer)`` into a :class:`Judgement`.  The one rule every judge
keeps: when it *could not decide* (it timed out, crashed, or the sandbox could not run the
code) it says so with ``ok=False`` and a reason.  Such a sample is marked and left out of
training; it is never silently scored 0.0, which would teach the policy that a correct
answer was wrong.  ``ok=True`` with reward 0.0 means the judge decided the answer is wrong.

Example, the default math judge (math-verify underneath)::

    >>> from erlay.judges.math import MathJudge
    >>> MathJudge().score(r"The answer is \\boxed{4}", "4")
    Judgement(reward=1.0, ok=True, reason='correct', kind='')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from erlay.supervisor.errors import ErlayError
from erlay.supervisor.imports import import_path

# Reasons shared by the built-in judges, so reports can group by them.
CORRECT = "correct"
WRONG_ANSWER = "wrong answer"
UNPARSEABLE_ANSWER = "unparseable answer"
JUDGE_TIMEOUT = "judge timeout"


class JudgeUsageError(ErlayError, RuntimeError):
    """A judge was called in a way its contract forbids (e.g. a sync ``score`` from inside a
    running event loop, where only ``score_async`` can work)."""


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one sample.

    ``reward`` is finite.  ``ok=False`` means the judge could not decide; ``reason`` then
    says why, and the sample is marked rather than trained on.  ``kind`` types an undecided
    judgement: ``timeout`` (the judge hung), ``exception`` (it raised), ``bad_return`` (it
    returned something that is not a Judgement, a NaN or infinite reward included) and
    ``poison`` (the input killed its worker process twice) are the judge's own failures;
    ``unavailable`` (no worker could be reached) and ``undecided`` (the judge said it cannot
    decide) are not.
    """

    reward: float
    ok: bool
    reason: str = ""
    kind: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool) \
                or not math.isfinite(self.reward):
            raise ValueError(f"reward: expected a finite number, got {self.reward!r}")
        object.__setattr__(self, "reward", float(self.reward))

    @staticmethod
    def undecided(reason: str, kind: str = "") -> Judgement:
        """The judge could not decide: reward 0.0, ``ok=False``, marked with ``reason``."""
        return Judgement(0.0, False, reason, kind)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"reward": self.reward, "ok": self.ok, "reason": self.reason}
        if self.kind:
            data["kind"] = self.kind
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Judgement:
        return Judgement(float(data["reward"]), bool(data["ok"]), str(data.get("reason", "")),
                         str(data.get("kind", "")))


# The kinds of an undecided judgement that are the judge's own fault (user code failing).
USER_ERROR_KINDS = ("timeout", "exception", "bad_return", "poison")


@runtime_checkable
class Judge(Protocol):
    """A synchronous judge.

    ``score`` must not raise for any model output: an answer it cannot read is a decided
    0.0 (``ok=True``), an internal failure is ``ok=False``.  ``context`` carries optional
    extras: ``key`` (the caller's idempotency key) and ``prompt`` (the episode's prompt, as
    the environment posed it; ``""`` when the caller has none); judges ignore what they do
    not use.  It may block (callers run it in a thread) but should bound its own time.
    """

    name: str

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement: ...


@runtime_checkable
class AsyncJudge(Protocol):
    """A judge that awaits I/O (a sandbox run, a model call).  Same contract as
    :class:`Judge`; :class:`~erlay.judges.server.JudgeServer` prefers ``score_async`` when a judge
    has both."""

    name: str

    async def score_async(self, judge_input: str, answer: str, **context: Any) -> Judgement: ...


def load_judge(path: str, **kwargs: Any) -> Judge | AsyncJudge:
    """Build the judge at ``"module:Class"`` with ``kwargs``.

    Errors as :func:`import_path`, plus TypeError when the built object has neither a
    callable ``score`` nor ``score_async``.
    """
    target = import_path(path, "judge")
    if not callable(target):
        raise TypeError(f"judge {path!r} is not a class or factory: {target!r}")
    judge = target(**kwargs)
    if not (callable(getattr(judge, "score", None))
            or callable(getattr(judge, "score_async", None))):
        raise TypeError(f"{path} does not implement the Judge interface: missing score or "
                        "score_async")
    return judge  # type: ignore[no-any-return]
