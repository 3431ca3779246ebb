"""The `erlay` command line.

Subcommands:
  erlay demo            a local supervision tree surviving kills (what the README runs)

Every invocation first checks that erlay's packages are erlay's own (see
:mod:`actors.install_check`) and exits with status 2, naming the culprit, if not.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from actors.install_check import ADVICE, check_install

VERSION = "0.1.0"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erlay", description="Fault-tolerant RL post-training "
                                     "on Ray as a tree of OTP-style supervisors.")
    parser.add_argument("--version", action="version", version=f"erlay {VERSION}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log supervisor events")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a local supervision tree that survives kills")
    demo.add_argument("--kills", type=int, default=8, help="faults to inject (default 8)")
    demo.add_argument("--interval", type=float, default=0.5,
                      help="seconds between faults (default 0.5)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    problems = check_install()
    if problems:
        for problem in problems:
            print(f"erlay: {problem}", file=sys.stderr)
        print(f"erlay: {ADVICE}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("erlay.supervisor").setLevel(logging.ERROR)
    match args.command:
        case "demo":
            from supervisor.demo import run_demo
            return run_demo(kills=args.kills, interval_s=args.interval)
    return 2


if __name__ == "__main__":
    sys.exit(main())
