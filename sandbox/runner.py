"""One sandbox run: spawn, watch, stop, classify, clean up, all on the running event loop.

:func:`run_in_sandbox` never raises for anything the code does; bad code is a
:class:`~erlay.sandbox.results.SandboxResult`.  Its invariants, on every path, cancellation
included:

- the run's processes are gone when it returns: its process group is killed and, with a pid
  namespace, so is everything the code spawned, in or out of the group;
- the scratch directory is removed;
- no thread is used: the pipes are read with ``loop.add_reader``, stdin is written with
  ``loop.add_writer``, the exit is seen through a pidfd, the timeout is a loop timer.

Stopping a run (timeout, output limit, cancellation) kills the *child* of the launcher (the
init of the run's pid namespace) and lets the launcher reap it and exit: killing the launcher
first would orphan the init, and an orphan's zombie is left to whatever reaps for pid 1, which
on some machines nothing does.  If the launcher has not exited a second later, the whole group
is killed.  After the main process exits its group is killed while it is still a zombie, so
the group id cannot have been reused by then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid

import psutil

from erlay.sandbox.classify import RunEnd, classify, launcher_returncode
from erlay.sandbox.isolation import (
    RUN_TOKEN_VAR,
    SCRIPT_NAME,
    Isolation,
    IsolationKind,
    SandboxUnavailable,
    code_dir,
    current_isolation,
    launch_argv,
    make_preexec,
    rlimit_values,
    sandbox_env,
    tmpfs_mb,
)
from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.results import Outcome, SandboxRequest, SandboxResult
from erlay.supervisor.procs import ProcessKeeper, process_keeper
from erlay.supervisor.reaper import TOKEN_VAR

log = logging.getLogger("erlay.sandbox")

READ_CHUNK = 65536
TAIL_BYTES = 4096          # the end of stderr, kept to classify a run whose head was truncated
DRAIN_GRACE_S = 0.5        # after exit, how long to wait for the pipes' EOF
ESCALATE_AFTER_S = 1.0     # after killing the init, when to kill the whole group
SWEEP_TIMEOUT_S = 1.0      # how long to wait for stray processes of the run to die


class StreamCapture:
    """The head of one output stream, up to ``keep`` bytes, plus its last bytes."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head = bytearray()
        self.tail = b""
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.tail = (self.tail + data)[-TAIL_BYTES:]

    @property
    def truncated(self) -> bool:
        return self.total > self.keep

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")

    def first_line(self) -> str:
        return next((ln for ln in self.text().splitlines() if ln.strip()), "")

    def drop_trailing(self, line: str) -> None:
        """Forget a last line that the launcher, not the code, wrote."""
        suffix = line.encode() + b"\n"
        if not self.tail.endswith(suffix):
            return
        self.total -= len(suffix)
        del self.head[self.total:]  # the head holds the first min(total, keep) bytes
        self.tail = self.tail[:-len(suffix)]

    def last_line(self) -> str:
        lines = [ln for ln in self.tail.decode("utf-8", errors="replace").splitlines()
                 if ln.strip()]
        return lines[-1] if lines else ""


class _Run:
    """The live part of one run: callbacks on the loop, from spawn until the pipes close."""

    def __init__(self, proc: subprocess.Popen[bytes], iso: Isolation, limits: SandboxLimits,
                 timeout_s: float, keeper: ProcessKeeper, stdin: bytes) -> None:
        self.loop = asyncio.get_running_loop()
        self.proc = proc
        self.pid = proc.pid
        self.iso = iso
        self.keeper = keeper
        self.hard_cap = limits.output_hard_cap_bytes
        self.out = StreamCapture(limits.output_cap_bytes)
        self.err = StreamCapture(limits.output_cap_bytes)
        self.wall_timed_out = False
        self.output_limited = False
        self.stopped = False
        self.exited: asyncio.Future[tuple[int | None, float | None]] = self.loop.create_future()
        self.drained: asyncio.Future[None] = self.loop.create_future()
        self._group_registered = True
        self._timers: list[asyncio.TimerHandle] = []
        self._streams: dict[int, StreamCapture] = {}
        self._stdin_left = memoryview(stdin)
        self._pidfd = os.pidfd_open(self.pid)
        self.loop.add_reader(self._pidfd, self._on_exit)
        for stream, capture in ((proc.stdout, self.out), (proc.stderr, self.err)):
            assert stream is not None
            fd = stream.fileno()
            os.set_blocking(fd, False)
            self._streams[fd] = capture
            self.loop.add_reader(fd, self._on_readable, fd)
        assert proc.stdin is not None
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            self.loop.add_writer(proc.stdin.fileno(), self._on_writable)
        else:
            self._close_stdin()
        self._timers.append(self.loop.call_later(timeout_s, self._on_timeout))

    # -- loop callbacks --------------------------------------------------------------------
    def _on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(fd)
            self._streams.pop(fd, None)
            if not self._streams and not self.drained.done():
                self.drained.set_result(None)
            return
        self._streams[fd].feed(data)
        if not self.output_limited and self.out.total + self.err.total > self.hard_cap:
            self.output_limited = True
            self.stop()

    def _on_writable(self) -> None:
        assert self.proc.stdin is not None
        try:
            written = os.write(self.proc.stdin.fileno(), self._stdin_left[:READ_CHUNK])
        except BlockingIOError:
            return
        except OSError:  # the code closed stdin or exited: the rest is not wanted
            written = len(self._stdin_left)
        self._stdin_left = self._stdin_left[written:]
        if not self._stdin_left:
            self.loop.remove_writer(self.proc.stdin.fileno())
            self._close_stdin()

    def _close_stdin(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass

    def _on_timeout(self) -> None:
        if not self.exited.done():
            self.wall_timed_out = True
            self.stop()

    def _on_exit(self) -> None:
        self.loop.remove_reader(self._pidfd)
        rc, cpu = self._reap()
        self._finish_exit(rc, cpu)

    # -- stopping and reaping --------------------------------------------------------------
    def stop(self) -> None:
        """Kill the run (timeout, output limit, cancellation).  Idempotent."""
        if self.stopped or self.exited.done():
            return
        self.stopped = True
        if not self.iso.has_launcher or not self._kill_launcher_children():
            self._kill_group()
            return
        self._timers.append(self.loop.call_later(ESCALATE_AFTER_S, self._escalate))

    def _kill_launcher_children(self) -> bool:
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return False
        for child in children:
            try:
                child.kill()  # psutil checks the pid still names the same process
            except psutil.Error:
                pass
        return bool(children)

    def _escalate(self) -> None:
        if not self.exited.done():
            log.warning("sandbox launcher %d outlived its child; killing its group", self.pid)
            self._kill_group()

    def _kill_group(self) -> None:
        if self._group_registered:
            self._group_registered = False
            self.keeper.kill_group(self.pid)

    def _reap(self) -> tuple[int | None, float | None]:
        """The exit status and CPU seconds of the main process (and the children it reaped)."""
        # The main process is a zombie (or about to be): kill its group before reaping it,
        # while the group id is still held and cannot name another group.
        self._kill_group()
        try:
            _, status, usage = os.wait4(self.pid, 0)
        except ChildProcessError:  # reaped by someone else: the status is lost
            self.proc.returncode = -1  # and Popen must not wait for a pid that may be reused
            return None, None
        rc = os.waitstatus_to_exitcode(status)
        self.proc.returncode = rc
        return rc, usage.ru_utime + usage.ru_stime

    def _finish_exit(self, rc: int | None, cpu: float | None) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if not self.exited.done():
            self.exited.set_result((rc, cpu))

    def abort(self) -> None:
        """Synchronous teardown for cancellation: kill, then reap within a bounded wait."""
        if self.exited.done():
            return
        self.loop.remove_reader(self._pidfd)
        self.stop()
        deadline = time.monotonic() + ESCALATE_AFTER_S
        # Give the launcher its moment to reap the killed init (WNOWAIT: look, do not reap).
        while os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        rc, cpu = self._reap()
        self._finish_exit(rc, cpu)

    def close(self) -> None:
        """Drop every loop registration and close the pipes."""
        for timer in self._timers:
            timer.cancel()
        for fd in list(self._streams):
            self.loop.remove_reader(fd)
        self._streams.clear()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.loop.remove_writer(self.proc.stdin.fileno())
            self._close_stdin()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        if self._pidfd >= 0:
            self.loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def wait(self) -> RunEnd:
        """Wait for the exit and the pipes' EOF, then say what happened."""
        rc, cpu = await asyncio.shield(self.exited)
        try:
            await asyncio.wait_for(asyncio.shield(self.drained), DRAIN_GRACE_S)
        except TimeoutError:
            log.debug("sandbox run %d: pipes still open %.1f s after exit", self.pid,
                      DRAIN_GRACE_S)
        last = self.err.last_line()
        code_rc = launcher_returncode(rc, last) if self.iso.kind is IsolationKind.UNSHARE else rc
        if code_rc != rc:  # the launcher's line is not the code's output
            self.err.drop_trailing(last)
            last = self.err.last_line()
        return RunEnd(returncode=code_rc, wall_timed_out=self.wall_timed_out,
                      output_limited=self.output_limited, cpu_s=cpu,
                      first_stderr_line=self.err.first_line(), last_stderr_line=last)


# -- scratch directories and stray processes ------------------------------------------------
def make_scratch(code: str, uid: int | None) -> str:
    """A private directory holding the code as ``main.py``, owned by ``uid``."""
    path = tempfile.mkdtemp(prefix="erlay-sandbox-")
    script = os.path.join(path, SCRIPT_NAME)
    try:
        with open(script, "wb") as f:
            # Lone surrogates become invalid UTF-8, which Python then reports as a syntax error.
            f.write(code.encode("utf-8", errors="surrogatepass"))
        if uid is not None:
            os.chown(script, uid, uid)
            os.chown(path, uid, uid)
    except OSError:
        remove_scratch(path)
        raise
    return path


def remove_scratch(path: str) -> None:
    """Remove a scratch directory, even one whose modes the code changed."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
        return
    for root, dirs, _ in os.walk(path):  # only needed without root: modes bind us then
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        log.warning("sandbox: could not remove scratch directory %s", path)


def processes_with_run_token(token: str) -> list[psutil.Process]:
    """Live processes whose environment carries this run's token."""
    needle = f"{RUN_TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(psutil.Process(int(entry)))
        except (OSError, psutil.Error):
            continue
    return found


def kill_run_processes(token: str) -> int:
    """SIGKILL every live process with the run's token; how many there were."""
    strays = processes_with_run_token(token)
    for proc in strays:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(strays)


async def sweep_run_processes(token: str) -> None:
    """Kill every process left with the run's token and wait (bounded) until they are gone."""
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    while kill_run_processes(token):
        if time.monotonic() > deadline:
            log.warning("sandbox: processes of run %s would not die", token)
            return
        await asyncio.sleep(0.01)


# -- the entry point ---------------------------------------------------------------------------
def _spawn_failed(request: SandboxRequest, isolation: str, detail: str,
                  wall_s: float = 0.0) -> SandboxResult:
    return SandboxResult(request.key, Outcome.SPAWN_FAILED, None, None, "", "", False, False,
                         wall_s, isolation, detail)


async def run_in_sandbox(request: SandboxRequest, limits: SandboxLimits, *,
                         slot: int = 0) -> SandboxResult:
    """Run ``request.code`` isolated, under ``limits``, as worker slot ``slot``'s uid.

    Returns the result whatever the code does.  An infrastructure failure (no interpreter,
    no disk for the scratch directory, a launcher that cannot start) is a ``spawn_failed``
    result.  Cancelling the call kills the run and cleans up before the cancellation
    propagates.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    timeout_s = request.timeout_s if request.timeout_s is not None else limits.wall_timeout_s
    try:
        iso, python = current_isolation(limits, slot)
    except SandboxUnavailable as exc:
        return _spawn_failed(request, "none", str(exc))
    keeper = process_keeper()
    token = uuid.uuid4().hex
    try:
        scratch = make_scratch(request.code, iso.uid)
    except OSError as exc:
        return _spawn_failed(request, iso.label, f"scratch directory: {exc}")
    try:
        env = sandbox_env(code_dir(iso, scratch), keeper.token, token, TOKEN_VAR)
        argv = launch_argv(iso, python=python, scratch=scratch, env=env,
                           tmpfs_size_mb=tmpfs_mb(limits))
        # unshare must stay root to create the namespaces; it drops to the uid itself.
        drop = None if iso.kind is IsolationKind.UNSHARE else iso.uid
        try:
            # LC_ALL=C reaches the launcher only (the code's environment is rebuilt), so
            # its messages are the ones the classifier knows.
            proc = keeper.spawn(argv, env={"LC_ALL": "C"}, cwd=scratch, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=make_preexec(rlimit_values(limits), drop))
        except (OSError, subprocess.SubprocessError) as exc:
            return _spawn_failed(request, iso.label, f"cannot start {argv[0]}: {exc}",
                                 loop.time() - started)
        try:
            run = _Run(proc, iso, limits, timeout_s, keeper,
                       request.stdin.encode("utf-8", errors="surrogatepass"))
        except BaseException:
            keeper.kill_group(proc.pid)
            proc.wait()
            raise
        try:
            end = await run.wait()
        except BaseException:
            run.abort()
            if not iso.has_launcher:
                kill_run_processes(token)
            raise
        finally:
            run.close()
        if run.stopped or not iso.has_launcher:
            await sweep_run_processes(token)
    finally:
        remove_scratch(scratch)
    verdict = classify(end, timeout_s=timeout_s, cpu_seconds=limits.cpu_seconds,
                       output_hard_cap=limits.output_hard_cap_bytes)
    rc = end.returncode
    result = SandboxResult(
        key=request.key, outcome=verdict.outcome,
        exit_code=rc if rc is not None and rc >= 0 else None, signal=verdict.signal,
        stdout=run.out.text(), stderr=run.err.text(), stdout_truncated=run.out.truncated,
        stderr_truncated=run.err.truncated, wall_s=round(loop.time() - started, 4),
        isolation=iso.label, detail=verdict.detail)
    log.debug("sandbox run %s: %s (%s) in %.3f s", request.key, result.outcome.value,
              result.detail, result.wall_s)
    return result

