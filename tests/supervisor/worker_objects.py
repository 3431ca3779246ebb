"""Objects served by worker processes in tests: each method plays one way code fails."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

# A backtracking regex that holds the GIL until it finishes: ~1.5 s per extra 'a' doubles.
CATASTROPHIC = re.compile(r"(a|aa)+$")


class Echo:
    def __init__(self, tag: str = "echo", fail: bool = False, hang_s: float = 0.0) -> None:
        if fail:
            raise ValueError(f"{tag} refuses to start")
        if hang_s:
            time.sleep(hang_s)
        self.tag = tag
        self.calls = 0

    def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    def pid(self) -> int:
        return os.getpid()

    def count(self) -> int:
        return self.calls

    async def aecho(self, value: Any) -> Any:
        return value

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"

    def freeze(self, n: int = 40) -> bool:
        """Hold the GIL in one C call (catastrophic backtracking) for as long as it takes."""
        return CATASTROPHIC.match("a" * n + "b") is not None

    def deadlock(self) -> None:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()

    def die(self, code: int = 3) -> None:
        os._exit(code)

    def segfault(self) -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def boom(self) -> None:
        raise RuntimeError("boom")

    def unpicklable(self) -> Any:
        return threading.Lock()
