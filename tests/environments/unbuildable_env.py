"""An environment whose constructor fails on purpose, loaded as
"tests.environments.unbuildable_env:UnbuildableEnv", for preflight's build tests.

``fault`` picks how the constructor fails (:func:`plant`, shared with
:mod:`tests.judges.unbuildable_judge`): ``raise`` (ValueError), ``hang`` (sleeps an hour, after
spawning a ``sleep`` into its process group and writing both pids to ``pid_file``), ``exit``
(``os._exit(3)``), ``kill`` (SIGKILLs its own process), ``print`` (prints a fake build record
to stdout, then raises).  With no fault it is the built-in arithmetic task.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from erlay.environments.arithmetic import ArithmeticEnv


def plant(fault: str | None, pid_file: str | None = None) -> None:
    """Fail a constructor the way ``fault`` names (module docstring)."""
    if fault == "raise":
        raise ValueError("the user's constructor failed")
    if fault == "hang":
        sleeper = subprocess.Popen(["sleep", "3600"])
        if pid_file is not None:
            Path(pid_file).write_text(f"{os.getpid()} {sleeper.pid}\n", encoding="utf-8")
        time.sleep(3600)
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "print":
        print('{"done": true}', flush=True)
        raise ValueError("the user's constructor failed after printing")


class UnbuildableEnv(ArithmeticEnv):
    def __init__(self, fault: str | None = None, pid_file: str | None = None) -> None:
        plant(fault, pid_file)
        super().__init__()
