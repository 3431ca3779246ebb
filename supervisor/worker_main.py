"""The inside of a worker process (:mod:`erlay.supervisor.worker_process`): build one object,
then serve its methods, one call at a time, over the socket its host handed down.

Run as ``python -m erlay.supervisor.worker_main`` with ``ERLAY_WORKER_FD`` naming the
socket.  The wire is :func:`send` / :func:`recv`: a 4-byte big-endian length, then a pickle.

- The first message is ``("init", factory, args, kwargs)``.  The answer is ``("ready",
  info)`` once ``factory(*args, **kwargs)`` returned, or ``("init_failed", summary,
  traceback)`` if it raised, after which the process exits 1.
- ``("call", id, method, args, kwargs)`` runs ``obj.method(*args, **kwargs)`` on the main
  thread (a coroutine is run to its end on this process's event loop) and answers
  ``("reply", id, "ok", value)``, or ``("reply", id, "raised", summary, traceback)`` when the
  method raised or its value could not be pickled.  The served object is erlay's own code
  (it catches what the user's code raises and returns it as a value): an exception that
  escapes it is a crash of the worker, which the host treats as one.
- ``("failpoints", op, name, spec)`` applies :func:`erlay.supervisor.failpoints.control`
  here and answers ``("control", report)``.
- End of file (the host closed the socket, or died) ends the process.

Nothing here has a deadline: the host owns every deadline, and kills this process's group
when one passes.  That is why a call runs on the main thread and nothing else: a call that
freezes the process (a C call holding the GIL, a deadlock) freezes only this worker.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from typing import Any

_HEADER = struct.Struct(">I")
FD_VAR = "ERLAY_WORKER_FD"


def send(sock: socket.socket, message: tuple[Any, ...]) -> None:
    """Write one framed message (blocking)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> tuple[Any, ...] | None:
    """Read one framed message (blocking); None at end of file."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(sock, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return pickle.loads(body)  # type: ignore[no-any-return]


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.obj: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def init(self, factory: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        from erlay.supervisor.imports import import_path
        try:
            self.obj = import_path(factory, "worker")(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the host, then we exit
            send(self.sock, ("init_failed", _summary(exc),
                             "".join(traceback.format_exception(exc))))
            return False
        send(self.sock, ("ready", {"pid": os.getpid(), "class": type(self.obj).__name__}))
        return True

    def call(self, call_id: int, method: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        try:
            value = getattr(self.obj, method)(*args, **kwargs)
            if inspect.isawaitable(value):
                if self.loop is None:
                    self.loop = asyncio.new_event_loop()
                value = self.loop.run_until_complete(_awaited(value))
            data = pickle.dumps(("reply", call_id, "ok", value),
                                protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - the host decides what a raise means
            send(self.sock, ("reply", call_id, "raised", _summary(exc),
                             "".join(traceback.format_exception(exc))))
            return
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def serve(self) -> int:
        from erlay.supervisor import failpoints
        if os.environ.get("ERLAY_TELEMETRY"):
            # Configured now, before ready: lazily, the first call would pay for it.
            from erlay.supervisor import telemetry
            telemetry.tracer()
        first = recv(self.sock)
        if first is None or first[0] != "init" or not self.init(*first[1:]):
            return 1
        while True:
            message = recv(self.sock)
            if message is None:
                return 0
            match message[0]:
                case "call":
                    self.call(*message[1:])
                case "failpoints":
                    send(self.sock, ("control", failpoints.control(*message[1:])))
                case other:
                    raise ValueError(f"unknown message {other!r}")


async def _awaited(value: Any) -> Any:
    return await value


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # so that atexit hooks (telemetry's flush) run on a polite stop


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    sock = socket.socket(fileno=int(os.environ.pop(FD_VAR)))
    try:
        return _Server(sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the host is gone: nobody to answer
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
