"""The plug-ins built once, in a subprocess under a deadline, before anything starts.

``erlay run``'s preflight (:mod:`erlay.actors.job.preflight`) hands a :class:`BuildRequest` to
a :class:`BuildProcess`: a fresh interpreter (``python -m erlay.actors.job.preflight_build``)
in its own process group, which reads the request from its stdin (a pickle: the kwargs and the
dataset rows, never argv) and, in this order,

1. imports the judge class, checks it structurally and binds its kwargs, then builds it with
   :func:`erlay.judges.base.load_judge`;
2. for each environment (the training one; the validation one over ``data.validation``'s
   rows): checks the class and its kwargs the same way, builds it with
   :func:`erlay.environments.base.load_environment`, resets the requested episodes and sends
   back what the tokenizer needs to measure their prompts (prompt, chat messages, source,
   the environment's tool schemas), as JSON.

It writes one JSON record a line to its stdout: ``{"doing": ...}`` before each step (what is in
progress, for a hang or a death), ``{"prompts": ...}`` per environment, ``{"refused": line}``
at its first problem, ``{"done": true}`` last; then it leaves with ``os._exit(0)``, so no
thread or ``atexit`` hook a plug-in left behind can hold it.  Whatever a plug-in prints goes
to the process's stderr, never among the records.

Contract of :meth:`BuildProcess.finish`, the only wait: it returns within the deadline
(``plugins.build_timeout_s``, counted from the spawn), as a list of :class:`Prompts` and at
most one :class:`Refusal`, last.  A refusal is one line:

- a class that does not implement its protocol, or rejects its kwargs (as before the
  subprocess existed);
- ``judge: mypkg.judges:MyJudge(**{...}) raised ValueError: ...``: a constructor that raised;
- ``... did not finish within 60 s (plugins.build_timeout_s); its build process group was
  killed``: SIGKILLed, whatever was in progress (a constructor, an import, the resets);
- ``... ended its build process (killed by SIGSEGV)``: ``os._exit``, a crash, a signal.

Nothing a plug-in does, and nothing it spawns, outlives :meth:`BuildProcess.close`: the
group is killed, and a :class:`~erlay.supervisor.procs.ProcessKeeper` (whose reaper covers an
``erlay run`` killed meanwhile) kills any descendant that left the group.  No user code runs
in the process that awaits the build; the built objects are thrown away with their process.

May import: erlay.supervisor, erlay.environments, erlay.judges.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any

from erlay.supervisor.procs import ProcessKeeper

MODULE = "erlay.actors.job.preflight_build"
ENV_METHODS = ("reset", "step", "observe", "demonstration")
SHOWN_KWARGS = 200     # characters of a constructor's kwargs a message shows
SHOWN_OUTPUT = 200     # characters of the build process's last stderr line a death shows
TIMEOUT_KEY = "plugins.build_timeout_s"


# -- what crosses into the build process, and what comes back ------------------------------
@dataclass(frozen=True)
class PluginCall:
    """A plug-in class and the kwargs it is built with."""

    path: str                 # "module:Class"
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class EnvironmentBuild:
    """One environment to build and reset: the training one, or the validation one."""

    call: PluginCall          # kwargs with the dataset's rows= and shuffle=, when it has rows
    rows: int | None          # dataset rows in ``call.kwargs`` (None: no dataset)
    resets: tuple[int, ...]   # episode indexes to reset, in order


@dataclass(frozen=True)
class BuildRequest:
    """Everything the build process needs, pickled to its stdin: built and reset in this
    order, the judge first."""

    judge: PluginCall
    environments: tuple[EnvironmentBuild, ...]
    seed: int                 # run.seed, every reset's seed
    sys_path: tuple[str, ...]  # the caller's import path, so both resolve classes alike


@dataclass(frozen=True)
class Prompts:
    """One environment's reset episodes, in reset order: ``(index, prompt, messages,
    source)`` with ``messages`` the chat messages (None: plain prompt) and ``source`` the
    row's name (None unless a string), and the environment's tool schemas (None: none)."""

    episodes: tuple[tuple[int, Any, Any, str | None], ...]
    tools: list[Any] | None


@dataclass(frozen=True)
class Refusal:
    """The first problem the build met, as the one line ``erlay run`` prints."""

    line: str


BuildResult = Prompts | Refusal


def describe(call: PluginCall) -> str:
    """``path(**{kwargs})`` for a message: a dataset's rows shown by their count, the whole
    cut to :data:`SHOWN_KWARGS` characters.

    Example:
        >>> describe(PluginCall("pkg:Env", {"rows": [{}, {}], "shuffle": True}))
        "pkg:Env(**{'rows': <2 rows>, 'shuffle': True})"
    """
    shown = {k: _Count(len(v)) if k == "rows" and isinstance(v, list) else v
             for k, v in call.kwargs.items()}
    text = repr(shown)
    if len(text) > SHOWN_KWARGS:
        text = text[:SHOWN_KWARGS - 4] + "...}"
    return f"{call.path}(**{text})"


class _Count:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"<{self.n} rows>"


def one_line(text: str, limit: int = 500) -> str:
    """``text`` on one line (line breaks folded into spaces), at most ``limit`` characters."""
    folded = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return folded if len(folded) <= limit else folded[:limit - 3] + "..."


# -- the caller's side ------------------------------------------------------------------------
class BuildProcess:
    """The build process serving one :class:`BuildRequest` (module docstring).  Spawned on
    construction, so the caller can do its own checks meanwhile; awaited by :meth:`finish`;
    killed, group and descendants, by :meth:`close` (or leaving its ``with`` block)."""

    def __init__(self, request: BuildRequest, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        # The request, the records and the plug-ins' output: files, not pipes, so nothing
        # waits on a reader while the caller is busy elsewhere.  Closed by close().
        self._files = [tempfile.TemporaryFile() for _ in range(3)]  # noqa: SIM115
        self._request, self._out, self._err = self._files
        pickle.dump(request, self._request, protocol=pickle.HIGHEST_PROTOCOL)
        self._request.seek(0)
        self._keeper = ProcessKeeper()
        self._deadline = clock() + timeout_s
        try:
            self._proc = self._keeper.spawn([sys.executable, "-m", MODULE],
                                            stdin=self._request, stdout=self._out,
                                            stderr=self._err)
        except BaseException:
            self._keeper.close()
            for f in self._files:
                f.close()
            raise

    def __enter__(self) -> BuildProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def finish(self) -> list[BuildResult]:
        """Wait for the build, at most until its deadline; its results (module docstring)."""
        try:
            code = self._proc.wait(timeout=max(0.0, self._deadline - self._clock()))
        except subprocess.TimeoutExpired:
            code = None
            self._keeper.kill_group(self._proc.pid)
            self._proc.wait()
        records = self._records()
        results: list[BuildResult] = []
        doing = None     # what the build process said it was doing last
        for record in records:
            if "doing" in record:
                doing = record["doing"]
            elif "prompts" in record:
                p = record["prompts"]
                results.append(Prompts(tuple((int(i), prompt, messages, source)
                                             for i, prompt, messages, source in p["episodes"]),
                                       p["tools"]))
            elif "refused" in record:
                return [*results, Refusal(record["refused"])]
            elif "done" in record:
                return results
        return [*results, Refusal(self._failure(doing, code))]

    def _failure(self, doing: str | None, code: int | None) -> str:
        """The line for a build that hung (``code`` None) or ended without finishing."""
        if code is None:
            what = doing or "plugins: the build process, which never started building,"
            return (f"{what} did not finish within {self.timeout_s:g} s ({TIMEOUT_KEY}); its "
                    "build process group was killed")
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
        last = self._last_output()
        said = f"; its last output: {last}" if last else ""
        if doing is None:
            return f"plugins: the build process (python -m {MODULE}) ended ({how}){said}"
        return f"{doing} ended its build process ({how}){said}"

    def close(self) -> None:
        """Kill the build process's group and every descendant; idempotent."""
        if self._proc.poll() is None:
            self._keeper.kill_group(self._proc.pid)
            self._proc.wait()
        self._keeper.close()
        for f in self._files:
            f.close()

    def _records(self) -> list[dict[str, Any]]:
        self._out.seek(0)
        records = []
        for line in self._out.read().decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:   # the last line, cut short by a kill
                break
            if isinstance(record, dict):
                records.append(record)
        return records

    def _last_output(self) -> str:
        self._err.seek(0)
        lines = [ln.strip() for ln in self._err.read().decode("utf-8", "replace").splitlines()]
        lines = [ln for ln in lines if ln]
        return one_line(lines[-1], SHOWN_OUTPUT) if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- the build process's side -----------------------------------------------------------------
class _Refused(Exception):
    """A problem found in the build process; its message is the one line to report."""


def _bind(target: Any, kwargs: dict[str, Any], key: str, path: str) -> None:
    """The kwargs fit ``target``'s signature, or a refusal naming the key and class."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C type: nothing to check up front
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise _Refused(f"{key}: {path} rejects its kwargs {sorted(kwargs)}: {exc}") from None


def _takes(target: Any, name: str) -> bool:
    """Whether ``target``'s signature accepts the keyword ``name`` (True when unknowable)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_judge_class(call: PluginCall) -> None:
    """The judge class has ``score`` or ``score_async`` and takes its kwargs."""
    from erlay.supervisor.imports import import_path
    target = import_path(call.path, "judge")
    if isinstance(target, type) and not (callable(getattr(target, "score", None))
                                         or callable(getattr(target, "score_async", None))):
        raise _Refused(f"judge.class: {call.path} does not implement the Judge protocol: "
                       "missing score (or score_async)")
    _bind(target, call.kwargs, "judge.kwargs", call.path)


def check_environment_class(build: EnvironmentBuild) -> None:
    """The environment class takes dataset rows (when it gets them), has the protocol's
    methods and takes its kwargs."""
    from erlay.supervisor.imports import import_path
    path = build.call.path
    target = import_path(path, "environment")
    if build.rows is not None and not _takes(target, "rows"):
        raise _Refused(f"data.train: {path} takes no dataset rows (no rows= parameter); use "
                       f"erlay.environments.dataset:DatasetEnv, or give the class rows= and "
                       f"shuffle= parameters")
    missing = [m for m in ENV_METHODS if not callable(getattr(target, m, None))]
    if missing and isinstance(target, type):
        raise _Refused(f"environment.class: {path} does not implement the Environment "
                       f"protocol: missing {', '.join(missing)}")
    _bind(target, build.call.kwargs, "environment.kwargs", path)


def _construct(loader: Callable[..., Any], call: PluginCall, key: str) -> Any:
    """``loader(path, **kwargs)``; its own protocol check on the built object is refused
    under ``key``, anything the constructor raises as ``... raised T: message``."""
    try:
        return loader(call.path, **call.kwargs)
    except TypeError as exc:
        if _raised_in(exc, loader):     # the loader's check of the built object
            raise _Refused(f"{key}: {exc}") from None
        raise


def _raised_in(exc: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``exc`` was raised by ``function``'s own code (not by something it called)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is getattr(function, "__code__", None)


class _Builder:
    """Serves one request, writing its records to ``out`` (module docstring)."""

    def __init__(self, request: BuildRequest, out: IO[str]) -> None:
        self.request = request
        self.out = out

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    @contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Announce ``what``; anything it raises (a refusal aside) is refused as raised."""
        self.write({"doing": what})
        try:
            yield
        except _Refused:
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's code: any error is bad input
            raise _Refused(f"{what} raised {type(exc).__name__}: {one_line(str(exc))}") \
                from None

    def serve(self) -> None:
        from erlay.environments.base import load_environment
        from erlay.judges.base import load_judge
        judge = self.request.judge
        with self.doing(f"judge: importing {judge.path}"):
            check_judge_class(judge)
        with self.doing(f"judge: {describe(judge)}"):
            _construct(load_judge, judge, "judge.class")
        for build in self.request.environments:
            with self.doing(f"environment: importing {build.call.path}"):
                check_environment_class(build)
            with self.doing(f"environment: {describe(build.call)}"):
                env = _construct(load_environment, build.call, "environment.class")
            self.reset(env, build)

    def reset(self, env: Any, build: EnvironmentBuild) -> None:
        """Reset the build's episodes; send them, then the first reset that failed."""
        path, seed = build.call.path, self.request.seed
        episodes: list[str] = []
        failed = None
        with self.doing(f"environment: {path}.reset of {len(build.resets)} episodes "
                        f"(seed {seed})"):
            tools = _tools(env, path)
            for index in build.resets:
                try:
                    episode = env.reset(index, seed)
                    source = episode.metadata.get("source")
                    episodes.append(json.dumps([index, episode.prompt,
                                                episode.metadata.get("messages"),
                                                source if isinstance(source, str) else None]))
                except Exception as exc:  # noqa: BLE001 - the user's reset: bad input
                    failed = (f"environment.class: {path}.reset({index}, {seed}) failed: "
                              f"{type(exc).__name__}: {one_line(str(exc))}")
                    break
        self.out.write('{"prompts": {"tools": ' + json.dumps(tools) + ', "episodes": ['
                       + ", ".join(episodes) + "]}}\n")
        self.out.flush()
        if failed is not None:
            raise _Refused(failed)


def _tools(env: Any, path: str) -> Any:
    tools = getattr(env, "tools", None)
    try:
        json.dumps(tools)
    except (TypeError, ValueError) as exc:
        raise _Refused(f"environment.class: {path}.tools must be JSON tool schemas, as a chat "
                       f"template takes them: {exc}") from None
    return tools


def main() -> None:
    """The build process: serve the request on stdin, records on stdout (module docstring)."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)     # a plug-in's prints land on stderr, never among the records
    request = pickle.load(sys.stdin.buffer)
    sys.path[:] = list(request.sys_path)
    builder = _Builder(request, out)
    try:
        builder.serve()
    except _Refused as exc:
        builder.write({"refused": str(exc)})
    builder.write({"done": True})
    os._exit(0)


if __name__ == "__main__":
    # Run as a script this module is ``__main__``; the request's classes are the importable
    # module's, so serve through that one.
    from erlay.actors.job.preflight_build import main as _main
    _main()
