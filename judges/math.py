"""A rule judge for math answers, on Hugging Face's ``math-verify``.

:class:`MathJudge` parses the gold answer and the model's answer with
``math_verify.parse`` and checks them with ``math_verify.verify``, so ``"132"``, ``"132.0"``,
``"$132$"`` and ``"\\boxed{132}"`` all match a gold ``132``, and ``"1/2"`` matches ``0.5``.

Time: math-verify's own timeouts use ``signal.alarm``, which only works in a process's main
thread; erlay judges run in actor threads, so they are disabled here (``parsing_timeout=None``,
``timeout_seconds=None``) and the judge enforces its own budget instead, in two layers:

1. Before verifying, it bounds the size of every number exact evaluation could produce and
   refuses answers past it ("answer too costly to verify", a decided 0.0).  Parsing is cheap
   (math-verify builds unevaluated expressions), but verifying ``9^9^9`` computes a
   369-million-digit integer in C with the GIL held, which no thread budget can interrupt.
2. Parsing and verifying run in a daemon thread under ``time_budget_s``; an overrun is
   ``ok=False`` "judge timeout".  See :mod:`erlay.judges.deadline` for what that can and cannot
   stop.

Verdicts: correct -> 1.0 "correct"; not equal -> 0.0 "wrong answer"; nothing mathematical
in the answer -> 0.0 "unparseable answer"; all ``ok=True``.  A gold answer that does not
parse, a timeout or an internal exception -> ``ok=False`` with the reason.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Any

import sympy
from math_verify import parse, verify
from sympy.functions.combinatorial.factorials import (
    FallingFactorial,
    RisingFactorial,
    binomial,
    factorial,
    factorial2,
    subfactorial,
)

from erlay.judges.base import CORRECT, JUDGE_TIMEOUT, UNPARSEABLE_ANSWER, WRONG_ANSWER, Judgement
from erlay.judges.deadline import BudgetExceeded, call_with_budget

log = logging.getLogger("erlay.judges")

MAX_RESULT_DIGITS = 100_000   # past this, exact arithmetic may take seconds with the GIL held
_LOG10_2 = math.log10(2)
_GROWTH = (factorial, factorial2, subfactorial, binomial, RisingFactorial, FallingFactorial,
           sympy.gamma)


def _int_digits(n: int) -> float:
    return abs(n).bit_length() * _LOG10_2 + 1


def result_digits_bound(expr: Any) -> float:
    """An upper bound on the decimal digits of any number that exactly evaluating ``expr``
    (a sympy object) can produce; ``inf`` when it cannot be bounded below ~10**7 digits.
    Non-numeric parts (symbols) count as small: they are not evaluated."""
    if isinstance(expr, sympy.Integer):
        return _int_digits(int(expr))
    if isinstance(expr, sympy.Rational):
        return max(_int_digits(expr.p), _int_digits(expr.q))
    if not isinstance(expr, sympy.Basic) or not expr.args:
        return 1.0  # floats (fixed precision), symbols, constants
    args = [result_digits_bound(a) for a in expr.args]
    if isinstance(expr, sympy.Pow):
        exponent = expr.args[1]
        if isinstance(exponent, sympy.Rational) and args[1] <= 8:
            return args[0] * max(1, abs(int(exponent.p)))
        return math.inf if args[1] > 7 else args[0] * 10 ** args[1]
    if isinstance(expr, _GROWTH):
        # n! has about n*log10(n) digits, and n < 10**digits(n).
        return math.inf if args[0] > 7 else 10 ** args[0] * max(1.0, args[0])
    if isinstance(expr, sympy.Mul):
        return sum(args)
    return max(args) + 1


def _too_costly(values: list[Any]) -> bool:
    return any(result_digits_bound(v) > MAX_RESULT_DIGITS for v in values
               if isinstance(v, sympy.Basic))


class MathJudge:
    """Math answers by equivalence, via ``math-verify``.

    - ``time_budget_s``: budget of one judgement (parse and verify), or None to run inline
      with no budget (the caller bounds it).  Default 2 s.
    - ``max_input_chars``: a longer ``judge_input`` scores 0.0 "answer too long" unparsed;
      environments pass the extracted final answer, not a whole completion.
    - ``float_rounding``, ``strict``: passed to ``math_verify.verify``.

    ``score`` never raises; see the module docstring for the verdicts.
    """

    name = "math"

    def __init__(self, time_budget_s: float | None = 2.0, max_input_chars: int = 1000,
                 float_rounding: int = 6, strict: bool = True, memo_size: int = 65536) -> None:
        if time_budget_s is not None and not time_budget_s > 0:
            raise ValueError(f"time_budget_s: expected a number > 0 or None, got "
                             f"{time_budget_s!r}")
        if max_input_chars < 1:
            raise ValueError(f"max_input_chars: expected an int >= 1, got {max_input_chars!r}")
        self.time_budget_s = time_budget_s
        self.max_input_chars = max_input_chars
        self.float_rounding = float_rounding
        self.strict = strict
        # A judgement is a pure function of (input, gold), and the samples of one GRPO group
        # often give the same answer: decided verdicts are remembered, not re-verified.
        self.memo_size = memo_size
        self._memo: OrderedDict[tuple[str, str], Judgement] = OrderedDict()
        self.memo_hits = 0

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        """Judge ``judge_input`` against the gold ``answer``; ``context`` is ignored."""
        memo = self._memo.get((judge_input, answer))
        if memo is not None:
            self._memo.move_to_end((judge_input, answer))
            self.memo_hits += 1
            return memo
        judgement = self._score(judge_input, answer)
        if judgement.ok and self.memo_size:
            self._memo[(judge_input, answer)] = judgement
            while len(self._memo) > self.memo_size:
                self._memo.popitem(last=False)
        return judgement

    def _score(self, judge_input: str, answer: str) -> Judgement:
        if len(judge_input) > self.max_input_chars:
            return Judgement(0.0, True, "answer too long")
        if not judge_input.strip():
            return Judgement(0.0, True, UNPARSEABLE_ANSWER)
        try:
            if self.time_budget_s is None:
                return self._decide(judge_input, answer)
            return call_with_budget(self._decide, judge_input, answer,
                                    budget_s=self.time_budget_s, name="erlay-math-judge")
        except BudgetExceeded:
            log.warning("math judge overran its %g s budget on an answer of %d chars; its "
                        "thread is abandoned", self.time_budget_s, len(judge_input))
            return Judgement.undecided(JUDGE_TIMEOUT)
        except Exception as exc:  # an undecided verdict, never a crash
            log.warning("math judge failed: %s: %s", type(exc).__name__, exc, exc_info=True)
            return Judgement.undecided(f"judge error: {type(exc).__name__}: {exc}")

    def _decide(self, judge_input: str, answer: str) -> Judgement:
        gold = parse(answer, parsing_timeout=None)
        if not gold:
            return Judgement.undecided("unparseable gold answer")
        predicted = parse(judge_input, parsing_timeout=None)
        if not predicted:
            return Judgement(0.0, True, UNPARSEABLE_ANSWER)
        if _too_costly(predicted):
            return Judgement(0.0, True, "answer too costly to verify")
        if verify(gold, predicted, float_rounding=self.float_rounding, strict=self.strict,
                  timeout_seconds=None):
            return Judgement(1.0, True, CORRECT)
        return Judgement(0.0, True, WRONG_ANSWER)
