"""Judges that fail on purpose, for the judge domain's tests and chaos scenarios.

``FlakyJudge`` is the math judge that raises on a seeded share ``rate`` of its calls (the
call count and the key decide, so a retry may succeed), ``BrokenJudge`` raises on every call,
``HangingJudge`` never answers for the answer "hang".
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from typing import Any

from erlay.judges.base import Judgement
from erlay.judges.math import MathJudge


class FlakyJudge:
    name = "flaky"

    def __init__(self, rate: float = 0.15, seed: int = 0) -> None:
        self.rate = rate
        self.seed = seed
        self.inner = MathJudge()
        self._calls = itertools.count()
        self._lock = threading.Lock()

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        with self._lock:
            n = next(self._calls)
        key = f"{self.seed}:{context.get('key')}:{n}".encode()
        if int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2 ** 64 \
                < self.rate:
            raise RuntimeError("the flaky judge failed")
        return self.inner.score(judge_input, answer)


class BrokenJudge:
    name = "broken"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        raise RuntimeError("the judge is broken")


class HangingJudge:
    name = "hanging"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        if answer == "hang":
            time.sleep(3600)
        return Judgement(1.0, True, "fine")

