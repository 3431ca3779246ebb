"""The `erlay` command line.

Subcommands:
  erlay run CONFIG [key.sub=value ...]   run an RL job (local Ray, or --address / RAY_ADDRESS)
  erlay run --resume RUN_DIR [...]        continue a killed run from its checkpoint and journal
  erlay journal inspect RUN_DIR           rollouts by state; --rollout ID for one's history
  erlay chaos list | run SCENARIO         fault-injection scenarios and their invariants
  erlay status [--watch | --json]         the live tree of a running job
  erlay report RUN_DIR                    a Markdown report with plots of a finished or
                                          crashed run
  erlay topology [--ray-start-args]       this node's GPUs, NVLink domain and NUMA map
  erlay demo                              a local supervision tree surviving kills

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
    run = sub.add_parser("run", help="run an RL job from a YAML config")
    run.add_argument("config", nargs="?", help="YAML job config, e.g. configs/cpu.yaml")
    run.add_argument("overrides", nargs="*", help="overrides such as learner.lr=3e-4")
    run.add_argument("--address", help="Ray cluster to attach to (default: RAY_ADDRESS, "
                     "else a local loopback Ray)")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (killed, "
                     "even by SIGKILL) from its last checkpoint and its journal; CONFIG is "
                     "then the run's own config.yaml, and overrides still apply")
    journal = sub.add_parser("journal", help="read a run's rollout journal")
    journal_sub = journal.add_subparsers(dest="journal_command", required=True)
    inspect = journal_sub.add_parser("inspect", help="rollouts by state, or one rollout's "
                                     "full history")
    inspect.add_argument("run_dir", help="the run directory (it holds journal/)")
    inspect.add_argument("--rollout", help="show this rollout's full history")
    inspect.add_argument("--state", choices=["in_flight", "completed", "consumed"],
                         help="list the rollouts in this state")
    chaos = sub.add_parser("chaos", help="prove the job survives faults: run chaos scenarios")
    chaos_sub = chaos.add_subparsers(dest="chaos_command", required=True)
    chaos_sub.add_parser("list", help="the scenarios in configs/chaos/")
    chaos_run = chaos_sub.add_parser("run", help="run a scenario, check its invariants and "
                                     "write chaos-report.json/.md")
    chaos_run.add_argument("scenario", help="a scenario name (configs/chaos/NAME.yaml) or a "
                           "path")
    chaos_run.add_argument("--config", help="run this job config instead of the scenario's "
                           "(the scenario's overrides still apply)")
    chaos_run.add_argument("--out", help="parent directory of the runs (default runs/chaos)")
    chaos_run.add_argument("--no-baselines", action="store_true", help="skip the fault-free "
                           "and job-restart runs (the invariants that need them are skipped)")
    status = sub.add_parser("status", help="the live tree of a running job (read-only)")
    status.add_argument("--address", help="Ray cluster of the job (default: RAY_ADDRESS, "
                        "else the local Ray this machine started last)")
    status.add_argument("--run", help="the run's name, when several jobs run on the cluster")
    status.add_argument("--watch", action="store_true", help="refresh in place until the "
                        "job ends or Ctrl-C")
    status.add_argument("--interval", type=float, default=1.0,
                        help="seconds between refreshes with --watch (default 1)")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    report = sub.add_parser("report", help="write a Markdown report with plots of a run "
                            "(finished or crashed)")
    report.add_argument("run_dir", help="the run directory")
    report.add_argument("--out", help="where to write report.md and its plots (default: "
                        "RUN_DIR/report)")
    topo = sub.add_parser("topology", help="this node's GPUs, NVLink domain, CPU/NUMA "
                          "affinity, and the `ray start` arguments that register them")
    topo.add_argument("--ray-start-args", action="store_true", help="print only the "
                      "arguments to add to `ray start` (shell-quoted)")
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
    parser = _parser()
    # Overrides may come after options (`run cfg.yaml --no-progress a.b=1`), which argparse's
    # positional handling does not allow; collect them from the leftovers instead.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "run" or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("erlay.supervisor").setLevel(logging.ERROR)
    match args.command:
        case "run":
            return _run(args)
        case "journal":
            return _journal(args)
        case "chaos":
            return _chaos(args)
        case "status":
            from actors.status import cli_status
            return cli_status(args)
        case "report":
            from actors.report import cli_report
            return cli_report(args)
        case "topology":
            return _topology(args)
        case "demo":
            from supervisor.demo import run_demo
            return run_demo(kills=args.kills, interval_s=args.interval)
    return 2


def _run(args: argparse.Namespace) -> int:
    from actors.config import ConfigError, load_config
    from actors.rundir import RunDir
    overrides = list(args.overrides)
    config = args.config
    if args.resume:
        if config is not None and "=" in config:  # `run --resume DIR a.b=1`
            overrides.insert(0, config)
        elif config is not None:
            print("erlay: --resume takes the run's own config.yaml; give overrides only",
                  file=sys.stderr)
            return 2
        try:
            run_dir = RunDir.open(args.resume)
        except FileNotFoundError as exc:
            print(f"erlay: cannot resume: {exc}", file=sys.stderr)
            return 2
        config = run_dir.config
    elif config is None:
        print("erlay: run needs a CONFIG (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    if args.address:
        overrides.append(f"ray.address={args.address}")
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(f"erlay: {exc}", file=sys.stderr)
        return 2
    from actors.job import Job
    if not args.resume:
        run_dir = RunDir.create(cfg.run.run_dir, cfg.run.name)
    print(f"erlay: {'resuming' if args.resume else 'run directory'} {run_dir.path}")
    job = Job(cfg, run_dir)
    result = job.run(progress=not args.no_progress,
                     on_start=lambda tree: print(tree.render(), flush=True))
    print(run_dir.summary.read_text(encoding="utf-8"))
    if result.status != "finished":
        print(f"erlay: job failed: {result.reason}", file=sys.stderr)
        return 1
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from chaos.scenario import ScenarioError, list_scenarios, load_scenario
    if args.chaos_command == "list":
        for name, description, smoke in list_scenarios():
            print(f"{name:28s} {'[smoke] ' if smoke else ''}{description}")
        return 0
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"erlay: {exc}", file=sys.stderr)
        return 2
    from pathlib import Path

    from chaos.runner import run_scenario
    result = run_scenario(scenario, config=Path(args.config) if args.config else None,
                          parent=Path(args.out) if args.out else None,
                          say=lambda line: print(line, flush=True),
                          with_baselines=not args.no_baselines)
    for verdict in result.verdicts:
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[verdict.ok]
        print(f"  {mark}  {verdict.name}: {verdict.detail}")
    print(f"erlay: chaos report {result.report_paths[1]}")
    return 0 if result.ok else 1


def _topology(args: argparse.Namespace) -> int:
    import json
    import shlex

    from supervisor.topology import TopologyError, affinity_map, discover, ray_start_args
    try:
        topology = discover()
    except TopologyError as exc:
        print(f"erlay: {exc}", file=sys.stderr)
        return 2
    if args.ray_start_args:
        print(shlex.join(ray_start_args(topology)))
        return 0
    print(f"host {topology.hostname}: {len(topology.gpus)} GPU(s), NVLink domain "
          f"{topology.nvlink_domain or '-'}, topology address {topology.topo_addr}")
    for gpu, entry in affinity_map(topology).items():
        print(f"  GPU {gpu}: {json.dumps(entry)}")
    print("ray start " + shlex.join(ray_start_args(topology)))
    return 0


def _journal(args: argparse.Namespace) -> int:
    from actors.journal_inspect import inspect_rollout, inspect_summary, list_rollouts
    from supervisor.errors import ErlayError
    try:
        if args.rollout:
            print(inspect_rollout(args.run_dir, args.rollout))
        elif args.state:
            print(list_rollouts(args.run_dir, args.state))
        else:
            print(inspect_summary(args.run_dir))
    except ErlayError as exc:
        print(f"erlay: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
