"""The ``erlay`` command: a dispatcher that knows no subcommand.

Every subcommand comes from the entry-point group ``erlay.commands``: each entry point names
a :class:`Command` object, registered by the package that owns the command (``run``,
``journal``, ``status``, ``report`` by :mod:`erlay.actors.commands`; ``chaos`` and ``verify`` by
:mod:`erlay.chaos.commands`; ``topology`` by :mod:`erlay.supervisor.node.commands`).  This
module imports none of them by name, so it sits on the lowest floor and the arrows of the
house still point down (``docs/design.md``).

Contract of a command module: importing it is cheap (argparse set-up only; heavy imports
happen inside :meth:`Command.run`), and :meth:`Command.run` returns the process exit code.
Exit codes are erlay's everywhere: 0 success, 1 failure at run time, 2 bad input (a config,
a plug-in, an argument) found before anything started.

May import: nothing outside erlay.supervisor.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

GROUP = "erlay.commands"


@runtime_checkable
class Command(Protocol):
    """One ``erlay`` subcommand.

    ``takes_overrides``: extra ``key=value`` words anywhere on the line are appended to
    ``args.overrides`` (argparse alone cannot take positionals after options)."""

    name: str
    help: str
    takes_overrides: bool

    def configure(self, parser: argparse.ArgumentParser) -> None:
        """Add this command's arguments to its subparser."""

    def run(self, args: argparse.Namespace) -> int:
        """Run the command; return the process exit code."""


class CommandLoadError(Exception):
    """An entry point of ``erlay.commands`` does not load or is not a :class:`Command`."""


def version() -> str:
    """erlay's installed version, or ``unknown`` outside an install."""
    try:
        return importlib.metadata.version("erlay")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_commands() -> dict[str, Command]:
    """The registered commands by name, sorted.  Raises :class:`CommandLoadError` naming the
    entry point that fails, so a broken plug-in is one clear line, not a traceback."""
    commands: dict[str, Command] = {}
    for entry in importlib.metadata.entry_points(group=GROUP):
        try:
            command = entry.load()
        except Exception as exc:  # a plug-in's import error: reported by name, exit 2
            raise CommandLoadError(f"command '{entry.name}' ({entry.value}) does not load: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(command, Command):
            raise CommandLoadError(f"command '{entry.name}' ({entry.value}) is not a Command "
                                   "(needs name, help, takes_overrides, configure, run)")
        commands[entry.name] = command
    return dict(sorted(commands.items()))


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    """The ``erlay`` parser with one subparser per registered command."""
    parser = argparse.ArgumentParser(prog="erlay", description="Fault-tolerant RL post-training "
                                     "on Ray as a tree of OTP-style supervisors.")
    parser.add_argument("--version", action="version", version=f"erlay {version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log supervisor events")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in commands.items():
        command.configure(sub.add_parser(name, help=command.help,
                                         description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``erlay`` console script.

    ``erlay ... | head``: when the reader leaves, every command (and ``--help``) ends
    quietly with 0, as a program that stops writing once its reader has what it wanted: no
    BrokenPipe traceback, no "Exception ignored" at exit."""
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again
        # (the recipe of Python's signal docs; SIGPIPE stays ignored, because Ray's sockets
        # must not kill us).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _dispatch(argv: Sequence[str] | None) -> int:
    try:
        try:
            commands = load_commands()
        except CommandLoadError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        if not commands:
            print("erlay: no commands are registered (entry-point group 'erlay.commands'); "
                  "erlay's install is incomplete: reinstall it with pip", file=sys.stderr)
            return 2
        parser = build_parser(commands)
        args, extra = parser.parse_known_args(argv)
        command = commands[args.command]
        if extra:
            if not command.takes_overrides or any("=" not in e or e.startswith("-")
                                                  for e in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*getattr(args, "overrides", []), *extra]
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if not args.verbose:
            logging.getLogger("erlay.supervisor").setLevel(logging.ERROR)
        return command.run(args)
    finally:
        # Flushed here, not at interpreter exit (argparse's --help exits too): a
        # block-buffered stdout (a pipe) meets a reader that left only at this flush, and
        # the exit-time flush would print "Exception ignored ... BrokenPipeError", exit 120.
        sys.stdout.flush()
