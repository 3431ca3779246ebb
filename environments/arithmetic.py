"""Multi-digit addition (and subtraction) with carries: a verifiable single-turn task.

Sized for a tiny character-level transformer trained on two CPU cores: the prompt is
``"47+85="`` and the expected completion is ``"132"`` then EOS.  Columns that carry (or
borrow) are what such a model gets wrong first, so :class:`ArithmeticEnv` controls their
share with ``with_carry_fraction``; a reward curve that rises under RL means the model learnt
to carry, not only to copy digits.

The environment checks the *format* of the completion (an optionally signed integer and
nothing else); the judge checks its *value*.  A completion like ``"132abc"`` is a malformed
answer here, although a lenient math parser would read 132 from it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import replace

from erlay.environments.base import (
    Episode,
    EpisodeStateError,
    EpisodeStatus,
    Failure,
    StepResult,
    check_param,
)

OPERATIONS = ("+", "-")
MAX_DIGITS = 7          # keeps the prompt within 16 characters
_INTEGER = re.compile(r"-?\d+")
_CARRY_TRIES = 64       # rejection-sampling bound; see ArithmeticEnv.reset


def operand_range(digits: int) -> tuple[int, int]:
    """Inclusive range of ``digits``-digit operands (0-9 for one digit, so 0 can appear)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1


def has_carry(a: int, b: int, op: str) -> bool:
    """Whether ``a op b`` carries (``+``) or borrows (``-``, with ``a >= b >= 0``) in any
    column."""
    carry = 0
    while a or b:
        da, db = a % 10, b % 10
        if op == "+":
            carry = 1 if da + db + carry >= 10 else 0
        else:
            carry = 1 if da - db - carry < 0 else 0
        if carry:
            return True
        a, b = a // 10, b // 10
    return False


def parse_operations(operations: str | Sequence[str], allowed: Sequence[str]) -> tuple[str, ...]:
    """``"+-"`` or ``["+", "-"]`` as a tuple of distinct operators from ``allowed``."""
    ops = tuple(operations)
    check_param(bool(ops) and all(op in allowed for op in ops) and len(set(ops)) == len(ops),
                "operations", operations, f"distinct operators from {''.join(allowed)!r}")
    return ops


class ArithmeticEnv:
    """``a op b =`` with ``digits``-digit operands; the answer is the integer result.

    - ``digits``: operand length, 1 to 7 (default 2: ``"47+85="``).
    - ``operations``: operators to draw from, ``"+"`` (default), ``"-"`` or ``"+-"``.
      Subtraction puts the larger operand first, so results are never negative.
    - ``with_carry_fraction``: the share of episodes drawn with at least one carry (or
      borrow), default 0.5; the rest have none.  Where the wanted kind cannot exist (one-digit
      subtraction never borrows) the episode is drawn without the constraint.

    Single turn: ``step`` ends the episode.  A well-formed integer goes to the judge as
    ``judge_input``; an empty or malformed completion ends with reward 0.0 and a failure.
    """

    max_turns = 1

    def __init__(self, digits: int = 2, operations: str | Sequence[str] = "+",
                 with_carry_fraction: float = 0.5, name: str = "arithmetic") -> None:
        check_param(isinstance(digits, int) and not isinstance(digits, bool)
                    and 1 <= digits <= MAX_DIGITS, "digits", digits, f"an int in 1..{MAX_DIGITS}")
        check_param(isinstance(with_carry_fraction, (int, float))
                    and not isinstance(with_carry_fraction, bool)
                    and 0.0 <= with_carry_fraction <= 1.0,
                    "with_carry_fraction", with_carry_fraction, "a number in [0, 1]")
        check_param(isinstance(name, str) and bool(name), "name", name, "a non-empty string")
        self.digits = digits
        self.operations = parse_operations(operations, OPERATIONS)
        self.with_carry_fraction = float(with_carry_fraction)
        self.name = name

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        lo, hi = operand_range(self.digits)
        op = rng.choice(self.operations)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if op == "-" and b > a:
            a, b = b, a
        return a, op, b

    def reset(self, index: int, seed: int) -> Episode:
        """Episode ``index`` of stream ``seed``.  Seeding ``random.Random`` with a string
        hashes it with SHA-512, so the episode is the same in every process."""
        rng = random.Random(f"{self.name}:{seed}:{index}")
        want_carry = rng.random() < self.with_carry_fraction
        for _ in range(_CARRY_TRIES):
            a, op, b = self._draw(rng)
            if has_carry(a, b, op) == want_carry:
                break
        result = a + b if op == "+" else a - b
        return Episode(episode_id=f"{self.name}/{seed}/{index}", prompt=f"{a}{op}{b}=",
                       answer=str(result),
                       metadata={"a": a, "b": b, "op": op, "carry": has_carry(a, b, op)})

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        """End the episode: a bare integer (surrounding whitespace allowed) is judged;
        anything else scores 0.0 with failure "empty answer" or "malformed answer"."""
        if episode.status is not EpisodeStatus.GENERATING:
            raise EpisodeStateError(f"step on episode {episode.episode_id} in state "
                                    f"{episode.status.value}")
        done = replace(episode, turn=episode.turn + 1, status=EpisodeStatus.DONE)
        text = completion.strip()
        if not text:
            return done, StepResult.failed(Failure.EMPTY_ANSWER)
        if not _INTEGER.fullmatch(text):
            return done, StepResult.failed(Failure.MALFORMED_ANSWER)
        return done, StepResult(done=True, judge_input=text)

    def observe(self, episode: Episode, tool_output: str,
                ok: bool = True) -> tuple[Episode, str]:
        """Never valid: this task has no tool calls, so no episode awaits a tool result."""
        raise EpisodeStateError(f"observe on single-turn episode {episode.episode_id}")

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        """One pair: the prompt and the answer."""
        return [(episode.prompt, episode.answer)]
