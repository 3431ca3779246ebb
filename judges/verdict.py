"""The verdict parser of the LLM judge: a generated text in, a :class:`Judgement` out.

A :class:`VerdictParser` finds the verdict in what a judging model wrote with a regular
expression (``pattern``, searched, first match) and turns its capture into a reward:

- with ``choices`` (label -> reward), the captured label, stripped, must be one of the
  labels exactly (``{"CORRECT": 1.0, "INCORRECT": 0.0}``);
- without, the capture must be a number, and it must lie in ``reward_range``
  (``"Score: 7"`` with ``reward_range: [0, 10]``).

The capture is the group named ``verdict`` when the pattern has one, else group 1, else the
whole match.  Anything else -- no match, a label that is no choice, a capture that is no
number, a NaN, a number outside the range -- is *undecided*, kind ``bad_return`` (the judge's
own failure: its model returned something that is not a verdict), with a reason that starts
with :data:`UNPARSEABLE_VERDICT` and quotes the start of the text.  Never a silent 0.0.

Example::

    >>> p = VerdictParser(r"\\b(CORRECT|INCORRECT)\\b", {"CORRECT": 1.0, "INCORRECT": 0.0})
    >>> p.parse(" INCORRECT, because 3 != 4")
    Judgement(reward=0.0, ok=True, reason='verdict INCORRECT', kind='')
    >>> p.parse("I think so").kind
    'bad_return'

May import: erlay.judges.base.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from erlay.judges.base import Judgement

UNPARSEABLE_VERDICT = "unparseable verdict"   # how the reason of every parse failure starts
_QUOTE = 80   # characters of the generated text a failure's reason quotes


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


class VerdictParser:
    """Parses a judging model's text into a :class:`Judgement` (see the module docstring).

    Args:
        pattern: a regular expression, searched in the text; its ``verdict`` group, else
            group 1, else the whole match, is the verdict.
        choices: label -> reward; None means the verdict is a number.
        reward_range: ``(low, high)``, the rewards a numeric verdict may take (inclusive).
        judge: the name failure reasons give the judge.

    Raises ``ValueError`` (one line) for a pattern that does not compile, empty or
    non-finite choices, or a bad range.
    """

    def __init__(self, pattern: str, choices: Mapping[str, float] | None = None,
                 reward_range: Sequence[float] = (0.0, 1.0), judge: str = "LLM judge") -> None:
        if choices is not None:
            if not isinstance(choices, Mapping) or not choices or not all(
                    isinstance(k, str) and k.strip() == k and k and _finite(v)
                    for k, v in choices.items()):
                raise ValueError(f"choices: expected a mapping of non-empty, stripped labels "
                                 f"to finite rewards, got {choices!r}")
            choices = {k: float(v) for k, v in choices.items()}
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern: expected a regular expression, got {pattern!r}")
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern: {pattern!r} does not compile ({exc})") from None
        if (not isinstance(reward_range, Sequence) or len(reward_range) != 2
                or not all(_finite(x) for x in reward_range)
                or not reward_range[0] < reward_range[1]):
            raise ValueError(f"reward_range: expected [low, high] with low < high, got "
                             f"{reward_range!r}")
        self.pattern = pattern
        self.choices = choices
        self.low, self.high = float(reward_range[0]), float(reward_range[1])
        self.judge = judge

    def parse(self, text: str) -> Judgement:
        """The verdict in ``text``: decided with reason ``verdict <capture>``, or undecided,
        kind ``bad_return``, reason ``unparseable verdict: ...``."""
        match = self.regex.search(text)
        if match is None:
            return self._unparseable(text, f"no match for {self.pattern!r}")
        captured = self._capture(match).strip()
        if self.choices is not None:
            reward = self.choices.get(captured)
            if reward is None:
                return self._unparseable(text, f"{captured!r} is none of the choices "
                                         f"{sorted(self.choices)}")
            return Judgement(reward, True, f"verdict {captured}")
        try:
            reward = float(captured)
        except ValueError:
            return self._unparseable(text, f"{captured!r} is not a number")
        if not math.isfinite(reward) or not self.low <= reward <= self.high:
            return self._unparseable(text, f"{captured} is outside [{self.low:g}, "
                                     f"{self.high:g}]")
        return Judgement(reward, True, f"verdict {captured}")

    @staticmethod
    def _capture(match: re.Match[str]) -> str:
        if "verdict" in match.re.groupindex:
            return match.group("verdict") or ""
        return (match.group(1) or "") if match.re.groups else match.group(0)

    def _unparseable(self, text: str, why: str) -> Judgement:
        quoted = text[:_QUOTE] + ("..." if len(text) > _QUOTE else "")
        return Judgement.undecided(f"{UNPARSEABLE_VERDICT}: the {self.judge} wrote {quoted!r}: "
                                   f"{why}", "bad_return")
