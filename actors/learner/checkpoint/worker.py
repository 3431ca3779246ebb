"""The trainer's hold on its checkpoint worker: the write's progress deadline, and stopping or
killing the worker without ever waiting on it for ever.

Both checkpointers (:mod:`erlay.actors.learner.checkpoint`,
:mod:`erlay.actors.learner.checkpoint.sharded`) write in nvidia-resiliency-ext's persistent
worker process.  A worker that is SIGSTOPped, stuck in uninterruptible I/O (D state) on a
hung filesystem, or blocked for any other reason still counts as alive, so waiting for it
alone would hang the learner.  This module holds what the checkpointers need to give up on
it:

- **Progress is measured, not assumed.**  :func:`writer_sample` reads the counters of the
  worker's main thread, the one that runs the write: CPU time and the bytes it passed to
  ``read``/``write`` calls (``/proc/<pid>/task/<pid>/stat`` and ``io``).  A stopped or
  D-state thread moves none of them; serializing, writing, fsyncing small files and hashing
  move at least one.  The worker's other thread (it watches for its trainer's death, waking
  once a second) is left out, so it never passes for progress.  Where ``/proc`` cannot be
  read, the sample is the bytes in the save's temporary directory.
- **The deadline** (:class:`ProgressDeadline`, pure): a write has made no progress for as
  long as its counters have stayed equal across samples, counted from the first sample that
  showed them; a runnable (``R``) writer counts as progressing, since it runs or waits for
  a CPU.  Samples are taken when the trainer looks (each poll, and every 50 ms while
  it waits), so the deadline never expires early; it expires at the first look after it has
  passed.
- **Killing** (:func:`kill_worker`): SIGKILL, which also ends a stopped process, to the
  worker and anything it started, then a bounded join.  A process in D state dies only when
  its I/O returns; one that has not died after ``wait_s`` is dropped all the same (logged,
  never waited on), and the next save starts a new worker.
- **Stopping** (:func:`stop_worker`): the library's own ``close()`` waits without bound for
  the worker to acknowledge; here the polite stop is bounded by ``grace_s``, then the worker
  is killed.

Either way the library's queues are released without waiting on a reader that may be gone.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

__all__ = ["ProgressDeadline", "WriterSample", "kill_worker", "release_queues",
           "stop_worker", "why_lost", "writer_sample"]

log = logging.getLogger("erlay.checkpoint")

# /proc/<pid>/stat's state letters, as a reason names them.
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O (D)",
           "T": "stopped (T)", "t": "stopped by a tracer (t)", "Z": "a zombie (Z)"}


@dataclass(frozen=True)
class WriterSample:
    """What the writer has done so far.  Two samples are equal exactly when no progress was
    made between them; ``state`` (the process state letter, ``?`` when unknown) is only for
    the reason a failure gives, and does not count."""

    counters: tuple[int, ...]
    state: str = field(default="?", compare=False)

    def describe_state(self) -> str:
        """``stopped (T)``, ``in uninterruptible I/O (D)``, ...; ``in state ?`` if unknown."""
        return _STATES.get(self.state, f"in state {self.state}")


class ProgressDeadline:
    """Whether a write has gone ``deadline_s`` without progress, from samples and times.

    Pure: the caller passes each :class:`WriterSample` with the (monotonic) time it was taken.
    Never expires before ``deadline_s`` has passed since the first sample showing the current
    counters, so a writer that makes any progress is never given up.

    >>> watch = ProgressDeadline(5.0)
    >>> watch.observe(WriterSample((1, 10)), now=100.0)
    0.0
    >>> watch.expired(WriterSample((1, 10)), now=104.0)
    False
    >>> watch.expired(WriterSample((1, 10)), now=105.0)
    True
    >>> watch.expired(WriterSample((2, 10)), now=106.0)  # progress: the clock starts again
    False
    """

    def __init__(self, deadline_s: float) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        self._last: WriterSample | None = None
        self._since = 0.0

    def observe(self, sample: WriterSample, now: float) -> float:
        """Record ``sample`` taken at ``now``; returns the seconds the writer has gone
        without progress (0 when this sample shows progress, or is the first)."""
        # A runnable writer is not stuck: it runs (and its CPU time moves) or waits for a CPU.
        if self._last is None or sample != self._last or sample.state == "R":
            self._last, self._since = sample, now
            return 0.0
        return now - self._since

    def expired(self, sample: WriterSample, now: float) -> bool:
        """:meth:`observe`, then whether the deadline has passed."""
        return self.observe(sample, now) >= self.deadline_s


def writer_sample(pid: int, tmp: Path) -> WriterSample | None:
    """The progress counters of worker ``pid``'s main thread (module docstring), or of the
    bytes under ``tmp`` where ``/proc`` is not readable; None if the process is gone."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        stat = (task / "stat").read_text()
        io = dict(line.split(": ", 1) for line in (task / "io").read_text().splitlines())
    except FileNotFoundError:
        return None if Path("/proc/self").exists() else _tmp_sample(tmp)
    except (OSError, ValueError):
        return _tmp_sample(tmp)
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is first
    cpu_ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return WriterSample((cpu_ticks, int(io["rchar"]), int(io["wchar"])), fields[0])


def why_lost(caller: Any, watch: ProgressDeadline, tmp: Path, now: float) -> str | None:
    """Why the worker of ``caller`` can no longer finish the save it holds (writing into
    ``tmp``): ``"died"``, or that it made no progress for ``watch``'s deadline (sampled now,
    at monotonic time ``now``); None while it may still finish."""
    process = caller.process
    if process is None or not process.is_alive():
        return "died"
    sample = writer_sample(process.pid, tmp)
    if sample is None:
        return "died"
    stalled_s = watch.observe(sample, now)
    if stalled_s < watch.deadline_s:
        return None
    return (f"made no progress for {stalled_s:.1f} s (checkpoint.deadline_s "
            f"{watch.deadline_s:g} s; pid {process.pid} was {sample.describe_state()}) and "
            f"was killed")


def _tmp_sample(tmp: Path) -> WriterSample:
    total = 0
    for path in tmp.rglob("*") if tmp.exists() else ():
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return WriterSample((total,))


def release_queues(caller: Any, *, flush: bool) -> None:
    """Close the library's queues, which it leaves open: their feeder threads would keep
    their semaphores alive until the process exits.  Without ``flush`` (the reader is dead
    or stuck) nothing waits for unsent data."""
    for queue in (caller.queue, caller.preload_q, caller.comp_q):
        if not flush:
            queue.cancel_join_thread()
        queue.close()
        if flush:
            queue.join_thread()


def kill_worker(caller: Any, wait_s: float) -> int | None:
    """SIGKILL the worker of the library's ``caller`` (a ``PersistentAsyncCaller``) and every
    process it started, wait up to ``wait_s`` for it, and drop it: the caller holds no
    process afterwards and its queues are released.  Returns the exit code, or None if the
    worker had none or has not died yet (D state: it dies when its I/O returns)."""
    process = caller.process
    caller.process = None
    code = None
    if process is not None and process.pid is not None:
        victims = [process.pid]
        try:
            victims += [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        except psutil.Error:
            pass
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)  # ends a stopped process too
            except OSError:
                pass
        process.join(wait_s)
        code = process.exitcode
        if code is None:
            log.error("checkpoint worker %d has not died %.1f s after SIGKILL (stuck in the "
                      "kernel); left to exit when its I/O returns", process.pid, wait_s)
    release_queues(caller, flush=False)
    return code


def stop_worker(caller: Any, grace_s: float) -> None:
    """Stop the worker of ``caller`` politely (the library's ``DONE``), waiting at most
    ``grace_s`` for it to exit, then kill it (:func:`kill_worker`)."""
    process = caller.process
    if process is None or not process.is_alive():
        caller.process = None
        release_queues(caller, flush=False)
        return
    caller.queue.put("DONE")
    process.join(grace_s)
    if process.is_alive():
        log.warning("checkpoint worker %d did not stop within %.1f s; killing it",
                    process.pid, grace_s)
        kill_worker(caller, grace_s)
        return
    caller.process = None
    release_queues(caller, flush=True)
