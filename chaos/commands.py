"""``erlay chaos``, registered through the ``erlay.commands`` entry points.

  erlay chaos list                 the scenarios shipped in configs/chaos/
  erlay chaos run SCENARIO         run a scenario, check its invariants, write its report
  erlay chaos run --all [--smoke]  every shipped scenario (or the CI smoke subset), one
                                   after another, then a table of their verdicts
  erlay chaos selftest [--keep DIR] prove every invariant can fail: a clean run passes
                                   each, 24 planted bugs fail theirs (no Ray, seconds)
  erlay verify RUN_DIR [--json]    the record invariants of any run directory, from its
                                   files alone (no Ray; a live run too)

Importing this module is cheap: the runner (and Ray) load inside the commands' ``run``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChaosCommand:
    """``erlay chaos``: 0 when every expectation of the scenario holds, 1 when one does not,
    2 for a bad scenario before anything started."""

    name: str = "chaos"
    help: str = "prove the job survives faults: run chaos scenarios"
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="chaos_command", required=True)
        sub.add_parser("list", help="the scenarios in configs/chaos/")
        selftest = sub.add_parser("selftest", help="prove every invariant can fail: a clean "
                                  "run must pass each, a planted violation must fail it")
        selftest.add_argument("--keep", help="write the clean and planted runs here and keep "
                              "them (default: a temporary directory, removed)")
        run = sub.add_parser("run", help="run a scenario, check its invariants and write "
                             "chaos-report.json/.md")
        run.add_argument("scenario", nargs="?", help="a scenario name (configs/chaos/NAME.yaml) "
                         "or a path")
        run.add_argument("--all", action="store_true", help="run every shipped scenario")
        run.add_argument("--smoke", action="store_true", help="with --all: only the CI smoke "
                         "subset")
        run.add_argument("--config", help="run this job config instead of the scenario's "
                         "(the scenario's overrides still apply)")
        run.add_argument("--out", help="parent directory of the runs (default runs/chaos)")
        run.add_argument("--no-baselines", action="store_true", help="skip the fault-free "
                         "and job-restart runs (the invariants that need them are skipped)")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.chaos.scenario import ScenarioError, list_scenarios, load_scenario
        if args.chaos_command == "selftest":
            from erlay.chaos.selftest import passed, run_selftest
            result = run_selftest(Path(args.keep) if args.keep else None)
            return 0 if passed(result) else 1
        if args.chaos_command == "list":
            for name, description, smoke in list_scenarios():
                print(f"{name:28s} {'[smoke] ' if smoke else ''}{description}")
            return 0
        if args.all == (args.scenario is not None):
            print("erlay: chaos run takes a SCENARIO or --all", file=sys.stderr)
            return 2
        if args.all:
            from erlay.chaos.suite import run_all
            return run_all(smoke_only=args.smoke, with_baselines=not args.no_baselines,
                           parent=Path(args.out) if args.out else None)
        try:
            scenario = load_scenario(args.scenario)
        except ScenarioError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        from erlay.chaos.runner import run_scenario
        result = run_scenario(scenario, config=Path(args.config) if args.config else None,
                              parent=Path(args.out) if args.out else None,
                              say=lambda line: print(line, flush=True),
                              with_baselines=not args.no_baselines)
        for verdict in result.verdicts:
            print(f"  {verdict.status:4s}  {verdict.name}: {verdict.detail}")
        print(f"erlay: chaos report {result.report_paths[1]}")
        failed = [v.name for v in result.verdicts if v.ok is False]
        print(f"erlay: chaos {scenario.name}: "
              + ("PASS" if result.ok else f"FAIL ({', '.join(failed)}); run "
                 f"{result.run.status}: {result.run.reason}"[:400]))
        return 0 if result.ok else 1


@dataclass(frozen=True)
class VerifyCommand:
    """``erlay verify RUN_DIR [--json]``: the record invariants of any run directory, from
    its durable files (:mod:`erlay.chaos.verify`).  0: every applicable invariant holds; 1:
    one fails or cannot be checked (a corrupt or missing journal, say); 2: not a run
    directory, or its config.yaml's rollout or supervision section is invalid."""

    name: str = "verify"
    help: str = ("check a run directory's records: every rollout trained exactly once, none "
                 "lost, checkpoints intact (no Ray; a live run too)")
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_dir", help="the run directory (holds config.yaml), or its "
                            "object-store URL (s3://...)")
        parser.add_argument("--json", action="store_true", help="print only the JSON "
                            "object, with every invariant's detail")

    def run(self, args: argparse.Namespace) -> int:
        import contextlib
        import json

        from erlay.actors.config import ConfigError
        from erlay.actors.job.remote_runs import fetched
        from erlay.actors.storage.remote import StorageError, is_remote
        from erlay.chaos.evidence import NotARunDir
        from erlay.chaos.verify import render, verify
        try:
            # A run on an object store is verified from a fresh copy of everything it holds.
            with (fetched(args.run_dir, checkpoint="all") if is_remote(args.run_dir)
                  else contextlib.nullcontext(args.run_dir)) as run_dir:
                result = verify(run_dir)
        except (NotARunDir, ConfigError, StorageError) as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            render(result)
        return 0 if result.ok else 1


CHAOS = ChaosCommand()
VERIFY = VerifyCommand()
