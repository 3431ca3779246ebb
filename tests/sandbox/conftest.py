"""Fixtures for sandbox tests: small limits, a private slot, and a leftover-process check."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from erlay.sandbox.isolation import RUN_TOKEN_VAR, slot_uid, unshare_works
from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.results import SandboxRequest, SandboxResult
from erlay.sandbox.runner import run_in_sandbox
from erlay.supervisor.procs import process_keeper
from erlay.supervisor.reaper import TOKEN_VAR

# A slot no other test module uses, so "a process of the slot uid" means "one of ours".
SLOT = 7
LIMITS = SandboxLimits(wall_timeout_s=2, cpu_seconds=10, memory_mb=256, max_processes=16,
                       max_file_mb=1, max_open_files=64, output_cap_bytes=4096)
NAMESPACES = os.geteuid() == 0 and unshare_works()
needs_namespaces = pytest.mark.skipif(not NAMESPACES,
                                      reason="needs root and a working unshare")
# Programs print their run token first, so a test can look for their processes afterwards.
PROLOGUE = f"import os; print(os.environ[{RUN_TOKEN_VAR!r}], flush=True)\n"
FORK_BOMB = PROLOGUE + ("while True:\n"
                        "    try:\n"
                        "        os.fork()\n"
                        "    except OSError:\n"
                        "        pass\n")
KILL_PARENT = PROLOGUE + ("import signal\n"
                          "print(os.getppid(), flush=True)\n"
                          "os.kill(os.getppid(), signal.SIGKILL)\n"
                          "print('survived', flush=True)\n")


def run(code: str, *, stdin: str = "", limits: SandboxLimits = LIMITS, slot: int = SLOT,
        timeout_s: float | None = None) -> SandboxResult:
    request = SandboxRequest(f"test/{uuid.uuid4().hex[:8]}", code, stdin, timeout_s)
    return asyncio.run(run_in_sandbox(request, limits, slot=slot))


def run_token(result: SandboxResult) -> str:
    return result.stdout.splitlines()[0]


class Spawned:
    """Records the process groups the keeper spawns, and finds what is left of them."""

    def __init__(self) -> None:
        self.pgids: list[int] = []
        self.since = time.time() - 0.1  # create_time has jiffy resolution

    def leftovers(self, *tokens: str, uid: int | None = slot_uid(SLOT),
                  zombies: bool = True) -> list[str]:
        """Processes started since the fixture began (zombies included) that are in a
        recorded group, carry a given run token or the keeper's token, or run as ``uid``."""
        keeper_token = process_keeper().token
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid() or proc.create_time() < self.since:
                    continue
                if not zombies and proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                why = []
                if os.getpgid(proc.pid) in self.pgids:
                    why.append("group")
                if uid is not None and proc.uids().real == uid:
                    why.append("slot uid")
                try:
                    env = proc.environ()
                except psutil.Error:  # a zombie has no environment left
                    env = {}
                if env.get(TOKEN_VAR) == keeper_token or env.get(RUN_TOKEN_VAR) in tokens:
                    why.append("token")
                if why:
                    found.append(f"{proc.pid} {proc.status()} {proc.name()} ({', '.join(why)})")
            except (psutil.Error, OSError):
                continue
        return found


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spawned]:
    keeper = process_keeper()
    record = Spawned()
    original = keeper.spawn

    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = original(*args, **kwargs)
        record.pgids.append(proc.pid)
        return proc

    monkeypatch.setattr(keeper, "spawn", spawn)
    yield record
    assert not keeper.groups, "every process group must be killed and unregistered"
