"""How a run ended, decided from what the runner observed: a pure function, tested alone.

The table, first match wins:

==========================================  ==============  =====================================
observed                                    outcome         why
==========================================  ==============  =====================================
the runner killed it for output             output_limit    our kill explains any signal
the runner killed it at the wall timeout    timeout
exit code 0                                 ok
launcher error line, code 1/2/125/126/127   spawn_failed    the launch chain failed, not the code
SIGXCPU, or SIGKILL after >= cpu_seconds    timeout         RLIMIT_CPU: soft, then hard limit
SIGXFSZ                                     file_size       RLIMIT_FSIZE with the default action
stderr says MemoryError / ENOMEM            memory          RLIMIT_AS makes allocations fail
stderr says EFBIG / "File too large"        file_size       Python ignores SIGXFSZ, so writes fail
another signal                              killed
another exit code                           error           detail: the last stderr line
==========================================  ==============  =====================================

The code runs as pid 1 of its pid namespace under unshare, and the kernel drops signals with
the default action that a namespace's init sends itself, SIGXCPU and SIGXFSZ included.  So
the CPU limit shows there as the hard limit's SIGKILL, which is why the CPU time is checked.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from erlay.sandbox.results import Outcome

# How the launch chain's own failures start (the setup step's $0 is erlay-sandbox-setup).
LAUNCHER_PREFIXES = ("unshare: ", "bwrap: ", "env: ", "setpriv: ", "mount: ", "mkdir: ",
                     "erlay-sandbox-setup: ")
# unshare re-raises the signal its child died of on itself, except SIGKILL, which it cannot
# reset: then it prints this (in the C locale) and exits 1.
UNSHARE_SIGKILL_LINE = "unshare: sigprocmask unblock failed: Invalid argument"
LAUNCHER_EXIT_CODES = frozenset({1, 2, 125, 126, 127})
# RLIMIT_CPU is enforced on the scheduler's clock and reported on the accounting clock;
# allow for the difference.
CPU_LIMIT_SLACK = 0.9

_MEMORY = re.compile(r"^MemoryError\b|Cannot allocate memory|\[Errno 12\]|out of memory")
_FILE_SIZE = re.compile(r"File too large|\[Errno 27\]")


@dataclass(frozen=True)
class RunEnd:
    """What the runner saw.  ``returncode`` is Popen-style (``-9`` = SIGKILL), None when the
    status was lost; ``cpu_s`` is the CPU time of the run's reaped processes, if known."""

    returncode: int | None
    wall_timed_out: bool = False
    output_limited: bool = False
    cpu_s: float | None = None
    first_stderr_line: str = ""
    last_stderr_line: str = ""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    signal: str | None
    detail: str


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def launcher_returncode(returncode: int | None, last_stderr_line: str) -> int | None:
    """The status of the code, seen through its launcher: unshare's exit 1 with
    :data:`UNSHARE_SIGKILL_LINE` means the code died of SIGKILL."""
    if returncode == 1 and last_stderr_line.strip() == UNSHARE_SIGKILL_LINE:
        return -signal.SIGKILL
    return returncode


def classify(end: RunEnd, *, timeout_s: float, cpu_seconds: int,
             output_hard_cap: int) -> Verdict:
    """The outcome of a run, per the module's table."""
    rc = end.returncode
    sig = signal_name(-rc) if rc is not None and rc < 0 else None
    last = end.last_stderr_line.strip()
    if end.output_limited:
        return Verdict(Outcome.OUTPUT_LIMIT, sig, f"output exceeded {output_hard_cap} bytes")
    if end.wall_timed_out:
        return Verdict(Outcome.TIMEOUT, sig, f"wall timeout {timeout_s:g} s")
    if rc is None:
        return Verdict(Outcome.KILLED, None, "exit status lost (reaped elsewhere)")
    if rc == 0:
        return Verdict(Outcome.OK, None, "")
    if rc in LAUNCHER_EXIT_CODES and end.first_stderr_line.startswith(LAUNCHER_PREFIXES):
        return Verdict(Outcome.SPAWN_FAILED, None, end.first_stderr_line.strip())
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and end.cpu_s is not None
                                 and end.cpu_s >= cpu_seconds * CPU_LIMIT_SLACK):
        return Verdict(Outcome.TIMEOUT, sig, f"cpu limit {cpu_seconds} s")
    if rc == -signal.SIGXFSZ:
        return Verdict(Outcome.FILE_SIZE, sig, "file size limit")
    if _MEMORY.search(last):
        return Verdict(Outcome.MEMORY, sig, last or "out of memory")
    if _FILE_SIZE.search(last):
        return Verdict(Outcome.FILE_SIZE, sig, last)
    if sig is not None:
        return Verdict(Outcome.KILLED, sig, f"killed by {sig}")
    return Verdict(Outcome.ERROR, None, last or f"exit code {rc}")
