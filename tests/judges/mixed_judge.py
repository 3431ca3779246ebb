"""A judge that fails of its own cause on chosen inputs, for the judge domain's tests and
chaos: raise, hang, a bad return, a GIL-holding freeze, a process death."""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any

from erlay.judges.base import Judgement


def _share(key: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64


class MixedFaultJudge:
    """A judge (correct iff the input equals the answer) that fails of its own cause on a
    seeded share ``rate`` of inputs (by key, so the same inputs in every process): a third
    raise, a third hang (sleep; the host's deadline ends it), a third return None.  ``mode``
    fixes one of them, or ``freeze`` (a C call holding the GIL) or ``die`` (``os._exit``).
    It imports nothing heavy, so a replaced worker process is back in a tenth of a second."""

    name = "mixed"

    def __init__(self, rate: float = 0.15, seed: int = 0, mode: str | None = None) -> None:
        self.rate = rate
        self.seed = seed
        self.mode = mode

    @staticmethod
    def fault_of(key: str, rate: float, seed: int = 0, mode: str | None = None) -> str | None:
        """Which fault ``key`` meets (None: it is judged as the math judge would)."""
        share = _share(key, seed)
        if share >= rate:
            return None
        return mode or ("raise", "hang", "none")[int(3 * share / rate)]

    def score(self, judge_input: str, answer: str, **context: Any) -> Any:
        match self.fault_of(str(context.get("key")), self.rate, self.seed, self.mode):
            case "raise":
                raise RuntimeError("the mixed judge failed")
            case "hang":
                time.sleep(3600)
            case "none":
                return None
            case "freeze":
                re.match(r"(a|aa)+$", "a" * 48 + "b")   # minutes in one C call, GIL held
            case "die":
                os._exit(9)
        return Judgement(float(judge_input == answer), True, "compared")
