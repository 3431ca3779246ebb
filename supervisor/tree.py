"""A supervision tree for a driver process: the root supervisor in its own event-loop thread,
with a synchronous API, stable child references and a text rendering.

The root runs in a background thread so that whatever the driver's main thread does (a
training loop, a progress bar, a blocking ``ray.get``) never delays failure handling.

``SupervisionTree.wait()`` returns the root's exit reason, or raises
:class:`~erlay.supervisor.errors.SupervisorFailed` naming the offending leaf when the root gave up
because restart intensity was exceeded somewhere below it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from erlay.supervisor.actor_child import ActorProcess, actor_starter
from erlay.supervisor.errors import ChildNotRunning, SupervisorFailed
from erlay.supervisor.events import EventSink, LoggingSink
from erlay.supervisor.hosted import InProcessChild
from erlay.supervisor.procs import ProcessKeeper, process_keeper
from erlay.supervisor.reason import ExitKind, ExitReason
from erlay.supervisor.runtime import (
    ChildProcess,
    NestedSupervisor,
    Starter,
    Supervisor,
    cancel_safe,
)
from erlay.supervisor.spares import SparePool
from erlay.supervisor.spec import (
    ActorStart,
    ChildSpec,
    InProcessStart,
    StartSpec,
    SubprocessStart,
    SupervisorFlags,
)
from erlay.supervisor.subprocess_child import SubprocessChild

T = TypeVar("T")
log = logging.getLogger("erlay.supervisor")


def default_starters(keeper: ProcessKeeper) -> dict[type[StartSpec], Starter]:
    return {ActorStart: actor_starter(), InProcessStart: InProcessChild.start,
            SubprocessStart: cancel_safe(partial(SubprocessChild.start, keeper=keeper))}


class SupervisionTree:
    """Run ``flags`` + ``children`` as the root supervisor named ``name``."""

    def __init__(self, name: str, flags: SupervisorFlags, children: list[ChildSpec],
                 *, sink: EventSink | None = None,
                 starters: dict[type[StartSpec], Starter] | None = None) -> None:
        self.name = name
        self.keeper = process_keeper()
        self._flags = flags
        self._children = tuple(children)
        self._sink = sink or LoggingSink()
        self._starters = starters or default_starters(self.keeper)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-tree",
                                        daemon=True)
        self.root: Supervisor | None = None

    # ------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = 300) -> SupervisionTree:
        """Boot the root; raises ChildStartError (and leaves nothing running) on failure."""
        self._thread.start()

        async def boot() -> Supervisor:
            # Published before booting, so children started during the boot (a coordinator
            # that looks up its siblings) can already navigate the tree.
            self.root = Supervisor(self.name, self._flags, self._children,
                                   starters=self._starters, sink=self._sink)
            starter = self._starters.get(ActorStart)
            launch = getattr(starter, "launch_ahead", None)
            try:
                if launch is not None:  # ActorStart.boot_ahead: construct beside the elders
                    await launch(self.name, self._children)
                await self.root.boot()
            finally:
                if launch is not None and (left := starter.discard_ahead()):
                    log.info("%s: boot ended before starting %s; killed them", self.name,
                             ", ".join(left))
            return self.root

        try:
            self.run(boot, timeout=timeout)
        except BaseException:
            self._close()
            raise
        return self

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float | None = 60) -> T:
        """Run ``fn()`` on the tree's loop and wait for its result.  Raises ChildNotRunning
        once the tree's loop has stopped (the coroutine is then never created)."""
        if self._loop.is_closed() or (self.root is not None and not self._loop.is_running()):
            raise ChildNotRunning(f"the tree {self.name} has stopped")
        future = asyncio.run_coroutine_threadsafe(fn(), self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"tree call did not finish within {timeout} s") from None

    def wait(self, timeout: float | None = None) -> ExitReason:
        """Block until the root terminates; raise SupervisorFailed if it gave up."""
        reason = self.run(self._root().wait_exit, timeout=timeout)
        self._close()
        if reason.offender is not None:
            raise SupervisorFailed(self.name, failure_message(self.name, reason),
                                   reason.root_offender, reason.chain)
        return reason

    def stop(self, timeout: float = 120) -> ExitReason:
        """Shut the whole tree down in reverse start order, within ``timeout`` seconds.
        Idempotent.

        Bounded: each child gets its shutdown policy (an ``infinity`` one lasts while the
        child answers its heartbeat); whatever is still running when ``timeout`` passes is
        killed, with its process group, and the reason says so.  Never raises TimeoutError.
        """
        if self.root is None:
            return ExitReason.from_dict({"kind": "shutdown"})
        if not self._loop.is_running():
            return self.root.state.exit_reason or ExitReason.from_dict({"kind": "shutdown"})
        try:
            reason = self.run(self.root.shutdown, timeout=timeout)
        except TimeoutError:
            log.warning("%s did not stop within %g s; killing what is left", self.name, timeout)
            try:
                self.run(partial(kill_everything, self.root), timeout=30)
            except TimeoutError:
                log.error("%s: the kill did not finish within 30 s", self.name)
            reason = ExitReason(ExitKind.KILLED, f"the tree did not stop within {timeout:g} s; "
                                "what was left was killed")
        self._close()
        return reason

    def _close(self) -> None:
        """Stop the tree's loop cleanly: every task still on it (watchers, pumps, a
        coordinator's clients) is cancelled and awaited first, so none is destroyed pending
        and no coroutine is left never awaited; then the loop stops and is closed."""
        self.keeper.close()
        spares = self.spares
        if spares is not None:   # ActorStart.spares: none outlives the tree
            killed = self._on_loop(spares.discard)
            if killed:
                log.info("%s: killed its warm spares %s", self.name, ", ".join(killed))
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result(15)
            except Exception:  # noqa: BLE001 - best effort: the loop stops regardless
                log.warning("%s: some tasks did not finish cancelling", self.name)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the tree's loop if it runs (bounded), else here."""
        if not self._loop.is_running():
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(15)

    @property
    def spares(self) -> SparePool | None:
        """The tree's warm spares (``ActorStart.spares``), read-only: for status and benches."""
        return getattr(self._starters.get(ActorStart), "spares", None)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The tree's event loop, on which every supervisor runs (read-only: a probe may
        schedule a timer on it, as ``bench/loop_lag.py`` does; nothing else belongs there)."""
        return self._loop

    @property
    def thread_native_id(self) -> int | None:
        """OS thread id of the tree's event loop (where every supervisor runs)."""
        return self._thread.native_id

    @property
    def alive(self) -> bool:
        return self.root is not None and not self.root.exited

    # ----------------------------------------------------------------------- navigation
    def _root(self) -> Supervisor:
        if self.root is None:
            raise ChildNotRunning("the tree has not started")
        return self.root

    def supervisor(self, path: str) -> Supervisor:
        """The running supervisor at ``path`` (``erlay/gen``).

        Raises ChildNotRunning when it, or a supervisor above it, is not running (it is
        restarting, or gone), and KeyError for a path outside this tree, which no restart
        can fix: that is a bug of the caller."""
        sup = self._root()
        parts = path.split("/")
        if parts[0] != self.name:
            raise KeyError(f"{path} is not under {self.name}")
        for part in parts[1:]:
            child = sup.child(part)
            if not isinstance(child, NestedSupervisor):
                raise ChildNotRunning(f"{path} is not a running supervisor")
            sup = child.sup
        return sup

    def child(self, path: str) -> ChildProcess:
        """The current incarnation of the child at ``path``."""
        parent, _, cid = path.rpartition("/")
        proc = self.supervisor(parent).child(cid)
        if proc is None:
            raise ChildNotRunning(f"{path} has no running incarnation")
        return proc

    # -------------------------------------------------- the dynamic API, synchronously
    def start_child(self, supervisor: str, spec: ChildSpec | None = None,
                    args: tuple[Any, ...] = (), timeout: float | None = 300) -> str:
        """OTP ``start_child`` on the supervisor at path ``supervisor``; the new child's id."""
        sup = self.supervisor(supervisor)
        return self.run(lambda: sup.start_child(spec, args), timeout=timeout)

    def terminate_child(self, supervisor: str, child_id: str) -> None:
        sup = self.supervisor(supervisor)
        self.run(lambda: sup.terminate_child(child_id), timeout=None)

    def restart_child(self, supervisor: str, child_id: str) -> str:
        sup = self.supervisor(supervisor)
        return self.run(lambda: sup.restart_child(child_id), timeout=None)

    def delete_child(self, supervisor: str, child_id: str) -> None:
        sup = self.supervisor(supervisor)
        self.run(lambda: sup.delete_child(child_id))

    def which_children(self, supervisor: str) -> list[dict[str, Any]]:
        sup = self.supervisor(supervisor)

        async def rows() -> list[dict[str, Any]]:
            return sup.which_children()
        return self.run(rows)

    def count_children(self, supervisor: str) -> dict[str, int]:
        sup = self.supervisor(supervisor)

        async def counts() -> dict[str, int]:
            return sup.count_children()
        return self.run(counts)

    def ref(self, path: str) -> ChildRef:
        return ChildRef(self, path)

    # ------------------------------------------------------------------------- snapshots
    def snapshot(self, timeout: float = 10) -> dict[str, Any]:
        """The whole tree as nested dicts, hosts' children included."""
        return self.run(partial(snapshot_supervisor, self._root()), timeout=timeout)

    def render(self, timeout: float = 10) -> str:
        return render_tree(self.snapshot(timeout))


class ChildRef:
    """A reference that follows a child across restarts.

    For an actor child, ``ref.method.remote(...)`` calls the current incarnation.  The bound
    method is cached per incarnation (Ray's handle builds a new one on every attribute read),
    so the lookup is a few dictionary reads and an identity check: a supervised call costs
    what a raw actor call does (``bench/supervision.py``'s ``call_overhead_ratio``).  The
    cache is one tuple, replaced whole, so a thread that reads it while another replaces it
    never pairs a new incarnation with an old handle's methods.
    """

    def __init__(self, tree: SupervisionTree, path: str) -> None:
        self._tree = tree
        self.path = path
        parent, _, self._cid = path.rpartition("/")
        self._parent_path = parent
        self._sup: Supervisor | None = None
        self._bound: tuple[ChildProcess | None, dict[str, Any]] = (None, {})

    @property
    def process(self) -> ChildProcess:
        sup = self._sup
        if sup is None or sup.exited:
            sup = self._sup = self._tree.supervisor(self._parent_path)
        proc = sup.child(self._cid)
        if proc is None:
            raise ChildNotRunning(f"{self.path} has no running incarnation")
        return proc

    @property
    def actor(self) -> Any:
        proc = self.process
        if not isinstance(proc, ActorProcess):
            raise TypeError(f"{self.path} is not an actor child")
        return proc.handle

    @property
    def incarnation(self) -> int:
        """The child's current incarnation number.  Raises ChildNotRunning while its
        supervisor is not running, and once the child is no longer one of its children
        (deleted, or a temporary child that exited): a gone child, not a bug."""
        sup = self._tree.supervisor(self._parent_path)
        record = sup.state.children.get(self._cid)
        if record is None:
            raise ChildNotRunning(f"{self.path} is no longer a child of {self._parent_path}")
        return record.incarnation

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        proc = self.process
        bound = self._bound
        if bound[0] is not proc:
            if not isinstance(proc, ActorProcess):
                raise TypeError(f"{self.path} is not an actor child")
            bound = self._bound = (proc, {})
        method = bound[1].get(name)
        if method is None:
            method = bound[1][name] = getattr(proc.handle, name)
        return method


async def snapshot_supervisor(sup: Supervisor) -> dict[str, Any]:
    """A supervisor and its subtree as plain data; host actors are asked for their children."""
    rows = sup.which_children()
    for row in rows:
        proc = sup.child(row["id"])
        if isinstance(proc, NestedSupervisor):
            row["children"] = (await snapshot_supervisor(proc.sup))["children"]
            row["strategy"] = proc.sup.state.strategy.value
        elif isinstance(proc, ActorProcess) and hasattr(proc.handle, "which_children"):
            try:
                row["children"] = await asyncio.wait_for(proc.handle.which_children.remote(), 5)
            except Exception as exc:  # noqa: BLE001 - a host that does not answer is shown so
                row["children_error"] = f"{type(exc).__name__}"
    flags = sup.state.flags
    return {"path": sup.path, "strategy": flags.strategy.value,  # type: ignore[union-attr]
            "intensity": flags.intensity, "period": flags.period,
            "status": sup.state.phase.value, "children": rows}


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait until they have finished."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=10)


async def kill_everything(sup: Supervisor) -> None:
    """Kill every child process under ``sup``, depth first, at once: the last resort of a
    stop that ran out of time.  Actor children are killed through Ray (and SIGKILL on this
    node), subprocess children with their process group; then ``sup`` is brutally shut
    down, which now finds nothing that can block it."""
    for proc in sup.live_processes():
        if isinstance(proc, NestedSupervisor):
            await kill_everything(proc.sup)
            continue
        try:
            await proc.kill(ExitReason(ExitKind.KILLED, "tree stop timed out"))
        except Exception:
            log.exception("killing %s failed", proc.info)
    try:
        await asyncio.wait_for(sup.shutdown(brutal=True), 10)
    except TimeoutError:
        log.error("%s did not finish its brutal shutdown", sup.path)


def render_tree(snapshot: dict[str, Any]) -> str:
    """Text rendering: one line per child with status, incarnation, restarts and last exit."""
    lines = [f"{snapshot['path']}  [{snapshot['strategy']}, {snapshot['intensity']} in "
             f"{snapshot['period']:g}s]  {snapshot['status']}"]

    def walk(rows: list[dict[str, Any]], prefix: str) -> None:
        for i, row in enumerate(rows):
            last = i == len(rows) - 1
            branch = "└── " if last else "├── "
            info = row.get("info") or {}
            where = f" pid={info['pid']}" if info.get("pid") else ""
            strategy = f" [{row['strategy']}]" if row.get("strategy") else ""
            exit_note = f"  last exit: {row['last_exit']}" if row.get("last_exit") else ""
            work = f"  work: {row['phase']}" if row.get("phase") else ""
            lines.append(f"{prefix}{branch}{row['id']}{strategy}  {row['status']}  "
                         f"inc={row['incarnation']} restarts={row['restarts']}"
                         f"{where}{work}{exit_note}")
            if row.get("children"):
                walk(row["children"], prefix + ("    " if last else "│   "))

    walk(snapshot["children"], "")
    return "\n".join(lines)


def failure_message(root: str, reason: ExitReason) -> str:
    chain = " <- ".join(reason.chain) if reason.chain else "?"
    leaf = reason
    while leaf.cause is not None:
        leaf = leaf.cause
    return (f"supervision tree {root} gave up: {reason.detail}; escalation chain {chain}; "
            f"offender {reason.root_offender} failed with: {leaf}")
