"""Rewards: rule verifiers, test-based code judging, model judges.

- :mod:`judges.base`: :class:`Judgement`, the :class:`Judge` / :class:`AsyncJudge`
  protocols and :func:`load_judge`.
- :mod:`judges.math`: :class:`~judges.math.MathJudge`, equivalence via ``math-verify``.
- :mod:`judges.code`: :class:`~judges.code.CodeJudge`, tests run in the sandbox.
- :mod:`judges.worker`: :class:`~judges.worker.JudgeWorker`, the hosted child that serves a
  judge with a deadline, progress and a reuse cache.
- :mod:`judges.budget`: retry budget and circuit breaker for callers of judges.

The heavy judges (``math``: sympy) are not imported here, so importing the contract is cheap.
"""

ERLAY_PACKAGE = "judges"  # marker checked by `erlay` to detect a shadowing distribution

from judges.base import AsyncJudge, Judge, Judgement, JudgeUsageError, load_judge  # noqa: E402

__all__ = ["AsyncJudge", "Judge", "JudgeUsageError", "Judgement", "load_judge"]
