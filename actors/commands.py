"""The RL job's ``erlay`` subcommands, registered through the ``erlay.commands`` entry points.

  erlay run CONFIG [key.sub=value ...]   run an RL job (local Ray, or --address / RAY_ADDRESS)
  erlay run --resume RUN_DIR [...]        continue a killed run from its checkpoint and journal
  erlay run --dry-run CONFIG [...]        each role's predicted memory; starts nothing
  erlay journal inspect RUN_DIR           rollouts by state; --rollout ID for one's history
  erlay status [--watch | --json]         the live tree of a running job
  erlay report RUN_DIR                    a Markdown report with plots of a finished or
                                          crashed run
  erlay export RUN_DIR OUT_DIR            a checkpoint as a Hugging Face model directory
         [--step N] [--adapter]           (merged weights, or the LoRA adapter alone)

Importing this module is cheap: each command imports what it runs inside :meth:`run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from erlay.actors.rundir import RunDir


@dataclass(frozen=True)
class RunCommand:
    """``erlay run``: 0 when every configured step trained; 1 when the job failed at run
    time (a domain failed, the root escalated, a plug-in kept failing, the job stalled);
    2 for a bad config or plug-in, a ``run.run_dir`` that is not new or empty, or a role
    predicted not to fit ``placement.gpu_memory_gib``, found before anything started.
    ``--dry-run`` prints each role's memory estimate and starts nothing (0, or 2 as above).
    The first line is the run directory's absolute path; the last names
    the domain and the cause."""

    name: str = "run"
    help: str = "run an RL job from a YAML config"
    takes_overrides: bool = True

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", nargs="?", help="YAML job config, e.g. configs/cpu.yaml")
        parser.add_argument("overrides", nargs="*", help="overrides such as learner.lr=3e-4")
        parser.add_argument("--address", help="Ray cluster to attach to (default: RAY_ADDRESS, "
                            "else a local loopback Ray)")
        parser.add_argument("--no-progress", action="store_true", help="no live progress bar: "
                            "one log line per RL step instead (step, reward, tokens/s, "
                            "restarts), for cluster logs")
        parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR "
                            "(killed, even by SIGKILL) from its last checkpoint and its "
                            "journal; CONFIG is then the run's own config.yaml, and overrides "
                            "still apply")
        parser.add_argument("--dry-run", action="store_true", help="print each role's "
                            "predicted memory and the device it lands on, refuse (exit 2) a "
                            "placement that cannot fit placement.gpu_memory_gib, and start "
                            "nothing")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.actors.config import ConfigError, load_config
        from erlay.actors.rundir import RunDir
        from erlay.supervisor.errors import ErlayError
        overrides = list(args.overrides)
        config = args.config
        if args.dry_run and not args.resume:
            return self._dry_run(config, overrides)
        if args.resume:
            if config is not None and "=" in config:  # `run --resume DIR a.b=1`
                overrides.insert(0, config)
            elif config is not None:
                print("erlay: --resume takes the run's own config.yaml; give overrides only",
                      file=sys.stderr)
                return 2
            try:
                run_dir = self._open_for_resume(args.resume, overrides)
            except (FileNotFoundError, FileExistsError, ErlayError) as exc:
                print(f"erlay: cannot resume: {exc}", file=sys.stderr)
                return 2
            config = run_dir.config
        elif config is None:
            print("erlay: run needs a CONFIG (or --resume RUN_DIR)", file=sys.stderr)
            return 2
        if args.address:
            overrides.append(f"ray.address={args.address}")
        from erlay.actors.job.remote_runs import prepare_remote
        from erlay.actors.rundir import RunDirError, remote_storage, run_location
        from erlay.actors.storage.remote import StorageError
        try:
            cfg = load_config(config, overrides)
            if not args.resume:  # a run_dir in use: said before the slower checks
                run_location(cfg.run.storage, cfg.run.run_dir)
                url = None if cfg.run.run_dir else remote_storage(cfg.run.storage, os.environ)
                if url is not None:   # a missing bucket, refused credentials: said now
                    prepare_remote(url)
            if cfg.placement.gpu_memory_gib is not None:   # a placement that cannot fit
                from erlay.actors.job.memory_model import plan
                plan(cfg)
            from erlay.actors.job.preflight import preflight
            preflight(cfg)
        except (ConfigError, RunDirError, StorageError) as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        if not args.resume:
            try:
                run_dir = RunDir.create_for(cfg.run.name, cfg.run.storage, cfg.run.run_dir,
                                            staging=cfg.run.staging)
            except (RunDirError, StorageError, OSError) as exc:  # taken meanwhile; not writable
                print(f"erlay: cannot create the run directory: {exc}", file=sys.stderr)
                return 2
        # The first line of the job's log (``ray job logs`` included): where everything goes.
        print(f"erlay: {'resuming' if args.resume else 'run directory'} {run_dir.location}"
              + (f" (working copy {run_dir.path})" if run_dir.remote else ""), flush=True)
        self._warn_if_in_ray_working_dir(run_dir.path.absolute())
        from erlay.actors.job import Job
        if args.no_progress:  # the per-step lines take the bar's place, on stderr
            import logging
            logging.getLogger("erlay.progress").setLevel(logging.INFO)
        job = Job(cfg, run_dir)
        result = job.run(progress=not args.no_progress,
                         on_start=lambda tree: print(tree.render(), flush=True))
        print(run_dir.summary.read_text(encoding="utf-8"))
        if result.status != "finished":
            where = f" in {result.offender}" if result.offender else ""
            print(f"erlay: job failed{where}: {result.reason}", file=sys.stderr)
            return 1
        print(f"erlay: finished: {cfg.run.steps} steps trained; {run_dir.location}")
        return 0

    @staticmethod
    def _dry_run(config: str | None, overrides: list[str]) -> int:
        """``--dry-run``: the memory plan (:mod:`erlay.actors.job.memory_model`), printed; 2
        for a bad config or a role that cannot fit its GPU.  No Ray, no model weights."""
        from erlay.actors.config import ConfigError, load_config
        from erlay.actors.job.memory_model import plan, render
        if config is None:
            print("erlay: run --dry-run needs a CONFIG", file=sys.stderr)
            return 2
        try:
            cfg = load_config(config, overrides)
            print(render(cfg, plan(cfg)))
        except ConfigError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        return 0

    @staticmethod
    def _open_for_resume(where: str, overrides: list[str]) -> RunDir:
        """The run to continue: a local run directory, or a remote one fetched into a fresh
        local copy (under ``run.staging`` when an override gives it)."""
        from erlay.actors.rundir import RunDir
        from erlay.actors.storage.remote import is_remote
        if not is_remote(where):
            return RunDir.open(where)
        from erlay.actors.job.remote_runs import resume_remote
        staging = next((o.partition("=")[2] for o in overrides
                        if o.startswith("run.staging=")), None)
        run_dir, fetched = resume_remote(where, staging)
        print(f"erlay: fetched {fetched.files} files ({fetched.bytes / 1e6:.1f} MB) from {where}"
              + (f"; resuming from the checkpoint of step {fetched.checkpoint}"
                 if fetched.checkpoint is not None else "; no usable checkpoint: from step 0")
              + (f"; retired the remote checkpoints of steps {list(fetched.skipped_checkpoints)}"
                 " (their journal records were lost)" if fetched.skipped_checkpoints else ""),
              flush=True)
        return run_dir

    @staticmethod
    def _warn_if_in_ray_working_dir(path: Path) -> None:
        from erlay.actors.rundir import in_ray_working_dir
        if in_ray_working_dir(path, Path.cwd()):
            print("erlay: warning: the run directory is inside Ray's temporary copy of the "
                  "working directory, which Ray deletes with the job; give run.storage (or "
                  "ERLAY_STORAGE) an absolute path", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class JournalCommand:
    """``erlay journal inspect``: 0 shown, 2 when RUN_DIR holds no readable journal."""

    name: str = "journal"
    help: str = "read a run's rollout journal"
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="journal_command", required=True)
        inspect = sub.add_parser("inspect", help="rollouts by state, or one rollout's full "
                                 "history")
        inspect.add_argument("run_dir", help="the run directory (it holds journal/)")
        inspect.add_argument("--rollout", help="show this rollout's full history")
        inspect.add_argument("--state", choices=["in_flight", "completed", "consumed"],
                             help="list the rollouts in this state")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.actors.journal.inspection import (
            inspect_rollout,
            inspect_summary,
            list_rollouts,
        )
        from erlay.supervisor.errors import ErlayError
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


@dataclass(frozen=True)
class StatusCommand:
    """``erlay status``: see :func:`erlay.actors.observe.status.cli_status`."""

    name: str = "status"
    help: str = "the live tree of a running job (read-only; joins no Ray job)"
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                            help="the run directory of the job to show (it records the "
                            "job's cluster and Ray job id)")
        parser.add_argument("--job", "--run", dest="job", metavar="NAME_OR_ID",
                            help="the run's name or id, or the Ray job or submission id, "
                            "when several erlay jobs run on the cluster")
        parser.add_argument("--address", help="Ray cluster of the job: its GCS (HEAD:6379) "
                            "or its dashboard (http://HEAD:8265) (default: RAY_ADDRESS, "
                            "else the local Ray this machine started last)")
        parser.add_argument("--watch", action="store_true", help="refresh in place until the "
                            "job ends (exit 0) or the cluster goes away (exit 1)")
        parser.add_argument("--interval", type=float, default=1.0,
                            help="seconds between refreshes with --watch (default 1)")
        parser.add_argument("--json", action="store_true", help="the same content as JSON, "
                            "one object (per refresh), for scripts")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.actors.observe.status import cli_status
        return cli_status(args)


@dataclass(frozen=True)
class ReportCommand:
    """``erlay report``: see :func:`erlay.actors.observe.report.cli_report`."""

    name: str = "report"
    help: str = "write a Markdown report with plots of a run (finished or crashed)"
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_dir", help="the run directory, or its object-store URL "
                            "(s3://...)")
        parser.add_argument("--out", help="where to write report.md and its plots (default: "
                            "RUN_DIR/report, uploaded there for a remote run)")

    def run(self, args: argparse.Namespace) -> int:
        from erlay.actors.observe.report import cli_report
        from erlay.actors.storage.remote import StorageError, is_remote
        if not is_remote(args.run_dir):
            return cli_report(args)
        # A run on an object store: reported from a fresh copy, and the report goes back
        # under the run (RUN/report/) unless --out names a local place.
        from erlay.actors.job.remote_runs import fetched, upload_tree
        from erlay.actors.storage.remote import join
        url = args.run_dir
        try:
            with fetched(url, checkpoint="none") as local:
                out = Path(args.out) if args.out else local / "report"
                code = cli_report(argparse.Namespace(**{**vars(args), "run_dir": str(local),
                                                        "out": str(out)}))
                if code == 0 and not args.out:
                    upload_tree(out, join(url, "report"))
                    print(f"erlay: report uploaded to {join(url, 'report', 'report.md')}")
                return code
        except StorageError as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2


@dataclass(frozen=True)
class ExportCommand:
    """``erlay export``: 0 written; 2 when the run directory, the step or the adapter is
    missing (see :func:`erlay.actors.job.export.export_run`).  Ray is not needed."""

    name: str = "export"
    help: str = "write a run's checkpoint as a Hugging Face model directory"
    takes_overrides: bool = False

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_dir", help="the run directory (it holds config.yaml and "
                            "checkpoints/), or its object-store URL (s3://...)")
        parser.add_argument("out_dir", help="where to write the model directory (a local "
                            "path or an object-store URL)")
        parser.add_argument("--step", type=int, help="the checkpoint of this step (default: "
                            "the newest committed one)")
        parser.add_argument("--adapter", action="store_true", help="write the LoRA adapter "
                            "alone (peft's adapter_config.json and adapter_model.safetensors) "
                            "instead of the merged model")

    def run(self, args: argparse.Namespace) -> int:
        import contextlib
        import tempfile

        from erlay.actors.job.export import ExportError, export_run
        from erlay.actors.job.remote_runs import fetched, upload_tree
        from erlay.actors.storage.remote import StorageError, is_remote
        try:
            # A run on an object store: its config and the checkpoint, fetched; an OUT_DIR
            # on one: written locally, then uploaded.
            with (fetched(args.run_dir, checkpoint="newest", step=args.step, journal=False)
                  if is_remote(args.run_dir) else contextlib.nullcontext(args.run_dir)) \
                    as run_dir, tempfile.TemporaryDirectory(prefix="erlay-export-") as tmp:
                out = Path(tmp) / "model" if is_remote(args.out_dir) else args.out_dir
                done = export_run(run_dir, out, step=args.step, adapter=args.adapter)
                if is_remote(args.out_dir):
                    upload_tree(done.out, args.out_dir)
        except (ExportError, StorageError) as exc:
            print(f"erlay: {exc}", file=sys.stderr)
            return 2
        print(f"erlay: exported step {done.step} ({done.kind}) to "
              f"{args.out_dir if is_remote(args.out_dir) else done.out}")
        return 0


RUN = RunCommand()
JOURNAL = JournalCommand()
STATUS = StatusCommand()
REPORT = ReportCommand()
EXPORT = ExportCommand()
