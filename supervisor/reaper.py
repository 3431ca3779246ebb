"""The reaper: a tiny watchdog that kills a hosting process's subprocesses if it dies.

Run as ``python -I -S reaper.py TOKEN`` (standard library only, so it starts in ~10 ms).
The hosting process writes ``+PGID`` / ``-PGID`` lines to its stdin as it spawns and reaps
process groups.  When stdin reaches EOF, which happens however the host ends, SIGKILL
included, the reaper kills every group still registered and every process whose environment
carries ``ERLAY_HOST_TOKEN=TOKEN`` (a descendant that left its group), then exits.
"""

from __future__ import annotations

import os
import signal
import sys

TOKEN_VAR = "ERLAY_HOST_TOKEN"


def processes_with_token(token: str) -> list[int]:
    """PIDs whose environment holds ``ERLAY_HOST_TOKEN=token`` (read from /proc)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_everything(groups: set[int], token: str) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for pid in processes_with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main() -> None:
    token = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only EOF ends the watch
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+"):
            groups.add(int(line[1:]))
        elif line.startswith("-"):
            groups.discard(int(line[1:]))
    kill_everything(groups, token)


if __name__ == "__main__":
    main()
