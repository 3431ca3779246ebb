"""A user environment that fails on purpose, loaded as "tests.environments.faulty_env:FaultyEnv".

It is the built-in arithmetic task (single turn) or the tool-use task (multi-turn) with a
fault planted in one method: ``raise`` (ValueError), ``hang`` (sleeps an hour), ``none``
(returns None), ``freeze`` (a catastrophic regex: one C call that holds the GIL for minutes),
``die`` (``os._exit``: the process dies, every time), ``die_once:<path>`` (dies unless
``<path>`` exists, creating it first: a death that a retry does not meet), or ``rate:<p>``
(raises on a seeded share ``p`` of calls, the same calls in every process).  A mode may name
one episode index as ``<mode>@<index>`` (``freeze@3``: only episode 3's calls freeze).  It
implements the Environment interface structurally, as a user's would.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

from erlay.environments.arithmetic import ArithmeticEnv
from erlay.environments.tool_use import ToolUseEnv


def _unlucky(rate: float, *key: Any) -> bool:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64 < rate


class FaultyEnv:
    """``reset``, ``step`` and ``observe`` each take a fault mode (None: well behaved)."""

    def __init__(self, reset: str | None = None, step: str | None = None,
                 observe: str | None = None, tool_use: bool = False) -> None:
        self.inner = ToolUseEnv() if tool_use else ArithmeticEnv()
        self.name = f"faulty-{self.inner.name}"
        self.max_turns = self.inner.max_turns
        self.modes = {"reset": reset, "step": step, "observe": observe}

    def _fault(self, method: str, *key: Any, index: int | None = None) -> Any:
        mode = self.modes[method]
        if mode is None:
            return None
        if "@" in mode:
            mode, only = mode.split("@", 1)
            if index != int(only):
                return None
        if mode == "freeze":
            re.match(r"(a|aa)+$", "a" * 48 + "b")   # minutes in one C call, GIL held
        if mode == "die":
            os._exit(7)
        if mode.startswith("die_once:"):
            marker = Path(mode[len("die_once:"):])
            if not marker.exists():
                marker.touch()
                os._exit(7)
            return None
        if mode == "raise":
            raise ValueError(f"the user's {method} failed")
        if mode == "hang":
            time.sleep(3600)
        if mode == "none":
            return "none"
        if mode.startswith("rate:") and _unlucky(float(mode[5:]), method, *key):
            raise ValueError(f"the user's {method} failed at random")
        return None

    def reset(self, index: int, seed: int) -> Any:
        if self._fault("reset", index, seed, index=index) == "none":
            return None
        return self.inner.reset(index, seed)

    def step(self, episode: Any, completion: str) -> Any:
        last = str(episode.episode_id).rsplit("/", 1)[-1]    # the built-ins': "name/seed/i"
        index = int(last) if last.isdigit() else None
        if self._fault("step", episode.episode_id, completion, index=index) == "none":
            return None
        return self.inner.step(episode, completion)

    def observe(self, episode: Any, tool_output: str, ok: bool = True) -> Any:
        if self._fault("observe", episode.episode_id, tool_output) == "none":
            return None
        return self.inner.observe(episode, tool_output, ok)

    def demonstration(self, episode: Any) -> list[tuple[str, str]]:
        return self.inner.demonstration(episode)
