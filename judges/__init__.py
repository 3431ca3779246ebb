"""Rewards: rule verifiers, test-based code judging, model judges.

- :mod:`erlay.judges.base`: :class:`Judgement`, the :class:`Judge` / :class:`AsyncJudge`
  protocols and :func:`load_judge`.
- :mod:`erlay.judges.math`: :class:`~erlay.judges.math.MathJudge`, equivalence via ``math-verify``.
- :mod:`erlay.judges.code`: :class:`~erlay.judges.code.CodeJudge`, tests run in the sandbox.
- :mod:`erlay.judges.server`: :class:`~erlay.judges.server.JudgeServer`, what a judge host's
  worker processes serve: the judge's own failures as values, and a reuse cache.
- :mod:`erlay.judges.budget`: retry budget and circuit breaker for callers of judges.

The heavy judges (``math``: sympy) are not imported here, so importing the contract is cheap.

May import: erlay.supervisor.
"""


from erlay.judges.base import AsyncJudge, Judge, Judgement, JudgeUsageError, load_judge

__all__ = ["AsyncJudge", "Judge", "JudgeUsageError", "Judgement", "load_judge"]
