"""Child classes used by the Ray-level tests.  Importable, so Ray workers can load them."""

from __future__ import annotations

import os
import sys
import threading

from erlay.supervisor.failpoints import failpoint
from erlay.supervisor.progress import Progress

SLEEPER = ("import os, time\n"
           "fd = os.environ.get('ERLAY_READY_FD')\n"
           "fd and os.write(int(fd), b'ready\\n')\n"
           "while True: time.sleep(3600)\n")
# Spawns a grandchild in the same group, then sleeps: group cleanup must take both.
FAMILY = ("import os, subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(3600)'])\n"
          "fd = os.environ.get('ERLAY_READY_FD')\n"
          "fd and os.write(int(fd), b'ready\\n')\n"
          "while True: time.sleep(3600)\n")
CRASHER = "import sys; sys.exit(3)\n"


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-S", "-c", code)


class Engine:
    """An actor child with progress counters."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.n = 0

    def pid(self) -> int:
        return os.getpid()

    def inc(self) -> int:
        self.n += 1
        return self.n

    def hold_work(self) -> None:
        self.progress.begin("decode_step", work="rollout-7")


class AsyncEngine:
    """An async actor child."""

    async def pid(self) -> int:
        return os.getpid()


class DiesAfterStart:
    """An actor child that dies right after every start: a crash loop."""

    def __init__(self) -> None:
        threading.Timer(0.3, lambda: os._exit(1)).start()

    def pid(self) -> int:
        return os.getpid()


class Echo:
    def ping(self, x: int = 0) -> int:
        return x

    def crash(self) -> None:
        raise RuntimeError("injected")


class BuildsSlowly:
    """An actor whose constructor takes ``delay_s``; ``pid`` names its process (so a test can
    tell which actor serves a child)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        import time
        time.sleep(delay_s)

    def pid(self) -> int:
        import os
        return os.getpid()


class FaultPoint:
    """A child whose ``hit`` passes the failpoint ``point``: an actor or in-process child."""

    def __init__(self, point: str) -> None:
        self.point = point

    def hit(self, x: int = 0) -> int:
        failpoint(self.point)
        return x


class BlocksItsLoop:
    """An async actor child whose user code can block its event loop (a deadlock, a
    blocking call in async code): erlay's own methods on the loop stop answering too."""

    async def ping(self) -> str:
        return "pong"

    async def block(self) -> None:
        import time
        time.sleep(3600)


class SlowBoot:
    """Logs ``enter NAME T`` and ``exit NAME T`` (wall times) around its constructor, and
    ``ready NAME T`` when ``erlay_ready`` begins, in ``log``.  The constructor works
    ``delay_s``, cut short once the line ``until`` (e.g. ``"ready b"``) is logged;
    ``erlay_ready`` raises if ``fail_ready``, once ``until`` is logged (at most 60 s), so a
    test can make a boot fail only after a sibling was created ahead."""

    def __init__(self, log: str, name: str, delay_s: float = 0.0, fail_ready: bool = False,
                 until: str | None = None) -> None:
        import time
        self.log, self.name, self.fail_ready, self.until = log, name, fail_ready, until
        self._write(f"enter {name} {time.time()}")
        self._wait_for_until(delay_s)
        self._write(f"exit {name} {time.time()}")

    def _write(self, line: str) -> None:
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def _wait_for_until(self, budget_s: float) -> None:
        import time
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            with open(self.log, encoding="utf-8") as f:
                if self.until and f"{self.until} " in f.read():
                    return
            time.sleep(0.02)

    def erlay_ready(self) -> None:
        import time
        self._write(f"ready {self.name} {time.time()}")
        if self.fail_ready:
            self._wait_for_until(60.0)
            raise RuntimeError("planted: not ready")

    def ping(self) -> str:
        return "pong"
