"""The reaper: a tiny watchdog that kills a hosting process's subprocesses if it dies.

Run as ``python -I -S reaper.py TOKEN`` (standard library only, so it starts in ~10 ms).
The hosting process writes ``+PGID:START`` / ``-PGID`` lines to its stdin as it spawns and
reaps process groups (``START`` is the group leader's start time, see :func:`start_ticks`).
When stdin reaches EOF, which happens however the host ends, SIGKILL included, the reaper
kills every group still registered and every process whose environment carries
``ERLAY_HOST_TOKEN=TOKEN`` (a descendant that left its group), then exits.

Process ids wrap (``pid_max`` is 32768 on many machines), so a group id registered long ago
may belong to someone else by the time it is killed.  A group is killed only while it is
still the one registered: see :func:`same_group`.
"""

from __future__ import annotations

import os
import signal
import sys

TOKEN_VAR = "ERLAY_HOST_TOKEN"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field
    22); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_group(pgid: int, leader_start: int | None) -> bool:
    """Whether process group ``pgid`` is still the one whose leader started at
    ``leader_start``.  While any member lives the kernel does not reuse the id; a reused id
    has a new leader (a process with pid ``pgid`` that started later).  So: the leader is
    ours, or there is no process with that pid (only our leaderless members can remain)."""
    now = start_ticks(pgid)
    return now is None or leader_start is None or now == leader_start


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


def kill_everything(groups: dict[int, int | None], token: str) -> None:
    for pgid, leader_start in groups.items():
        if not same_group(pgid, leader_start):
            continue  # the id was reused: that group is not ours
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
    groups: dict[int, int | None] = {}
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+"):
            pgid, _, start = line[1:].partition(":")
            groups[int(pgid)] = int(start) if start else None
        elif line.startswith("-"):
            groups.pop(int(line[1:]), None)
    kill_everything(groups, token)


if __name__ == "__main__":
    main()
