"""The run directory: everything a run leaves behind, readable after a crash.

Where it goes (:meth:`RunDir.create_for`): exactly ``run.run_dir`` when set; else
``<storage>/<name>-<YYYYmmdd-HHMMSS>``, with ``storage`` from ``run.storage``, else
``$ERLAY_STORAGE``, else ``~/erlay-runs``: a stable place outside Ray's temporary directories,
which ``ray job submit``'s copy of the working directory is one of.

    <storage>/<name>-<YYYYmmdd-HHMMSS>/     (or run.run_dir)
        config.yaml      the resolved configuration
        metrics.jsonl    one object per warm start / RL step, flushed as written
        events.jsonl     every supervisor event (starts, exits, restarts, escalations)
        summary.md       status, reward, throughput, restarts by domain
        reward_curve.png the reward per step
        telemetry/       OpenTelemetry spans (one spans-*.jsonl per process) and the
                         driver's metrics, with the default file exporter
        journal/, checkpoints/   the rollout journal and the learner's checkpoints
        report/          ``erlay report``'s Markdown and plots, when asked for

May import: erlay.supervisor, erlay.actors.observe.goodput (pure: goodput's one definition),
erlay.actors.observe.timing (pure: wall, outage and RL time across --resume).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from erlay.actors.observe.goodput import not_trained, trained_tokens
from erlay.actors.observe.timing import RunTiming, run_timing, split_segments
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.events import EventKind, read_events

STORAGE_ENV = "ERLAY_STORAGE"
DEFAULT_STORAGE = "~/erlay-runs"


class RunDirError(ErlayError):
    """The configured run directory cannot be used; the message says why and what to set."""


def expand_path(raw: str, env: Mapping[str, str], cwd: Path) -> Path:
    """``raw`` as an absolute path: ``~`` is ``env['HOME']``, a relative path is under
    ``cwd``.  Not resolved: a symlinked shared mount keeps the name the user gave."""
    if raw == "~" or raw.startswith("~/"):
        home = env.get("HOME") or str(Path.home())
        raw = home + raw[1:]
    path = Path(raw)
    return path if path.is_absolute() else cwd / path


def storage_root(storage: str | None, env: Mapping[str, str], cwd: Path) -> Path:
    """The directory auto-named run directories go under: ``storage``, else
    ``env[ERLAY_STORAGE]``, else ``~/erlay-runs``.  Raises :class:`RunDirError` for a remote
    URL (``s3://``, ``gs://``), which only the environment variable can still carry here:
    ``run.storage`` itself is checked when the config loads."""
    raw = storage or env.get(STORAGE_ENV) or DEFAULT_STORAGE
    if "://" in raw:
        source = "run.storage" if storage else STORAGE_ENV
        raise RunDirError(f"{source}={raw}: remote storage is not supported yet; give a local "
                          "or shared-filesystem directory")
    return expand_path(raw, env, cwd)


def check_exact(path: Path) -> None:
    """``path`` may become one run's directory: it does not exist, or is an empty directory.
    Otherwise :class:`RunDirError` says what to do instead (resume the run it holds, or name
    the parent of auto-named runs with ``run.storage``, what ``run.run_dir`` used to be)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise RunDirError(f"run.run_dir {path} exists and is not a directory")
    if (path / "config.yaml").is_file():
        raise RunDirError(f"run.run_dir {path} already holds a run; continue it with "
                          f"`erlay run --resume {path}`, or give a new directory")
    if any(path.iterdir()):
        raise RunDirError(f"run.run_dir {path} is not empty; run.run_dir names one run's "
                          f"directory exactly. For a parent of auto-named run directories, "
                          f"set run.storage={path}")


def run_location(storage: str | None, run_dir: str | None,
                 env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> tuple[Path, bool]:
    """Where a run's directory goes, checked, nothing created: ``(path, True)`` for the
    exact ``run_dir``, ``(parent, False)`` for an auto-named one under the storage root.
    ``env`` and ``cwd`` default to the process's.  Raises :class:`RunDirError` for a
    ``run_dir`` that is not new or empty, and for a remote ``ERLAY_STORAGE``."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if run_dir:
        path = expand_path(run_dir, env, cwd)
        check_exact(path)
        return path, True
    return storage_root(storage, env, cwd), False


def in_ray_working_dir(path: Path, cwd: Path) -> bool:
    """Whether ``path`` lies in Ray's temporary copy of a job's working directory (``cwd``
    under ``.../runtime_resources/working_dir_files/``), which Ray deletes with the job."""
    if "working_dir_files" not in cwd.parts:
        return False
    return path == cwd or cwd in path.parents


def reward_window(values: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean of the first and of the last ``fraction`` of ``values`` (at least one each)."""
    if not values:
        return 0.0, 0.0
    k = max(1, round(len(values) * fraction))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @staticmethod
    def create(parent: str | Path, name: str) -> RunDir:
        """A new ``<parent>/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when taken).  The
        directory is claimed by an exclusive mkdir, so two jobs starting in the same second
        on a shared storage each get their own."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(parent) / f"{name}-{stamp}"
        Path(parent).mkdir(parents=True, exist_ok=True)
        path, n = base, 1
        while True:
            try:
                path.mkdir()
                return RunDir(path)
            except FileExistsError:
                n += 1
                path = Path(f"{base}-{n}")

    @staticmethod
    def create_for(name: str, storage: str | None = None, run_dir: str | None = None,
                   env: Mapping[str, str] | None = None, cwd: Path | None = None) -> RunDir:
        """The run directory a config asks for (``run.name``, ``run.storage``,
        ``run.run_dir``), created, with an absolute path.  ``env`` and ``cwd`` default to the
        process's.  Raises :class:`RunDirError` as :func:`run_location` does."""
        path, exact = run_location(storage, run_dir, env, cwd)
        return RunDir(path) if exact else RunDir.create(path, name)

    @staticmethod
    def open(path: str | Path) -> RunDir:
        """An existing run directory, to resume.  Raises FileNotFoundError naming what is
        missing.  A torn last line of ``metrics.jsonl`` or ``events.jsonl`` (the driver died
        mid-write) is cut, so the resumed run's lines follow whole ones."""
        run = Path(path)
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"{run} is not an erlay run directory (no config.yaml)")
        rd = RunDir(run)
        for jsonl in (rd.metrics, rd.events):
            data = jsonl.read_bytes() if jsonl.exists() else b""
            if data and not data.endswith(b"\n"):
                with open(jsonl, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        return rd

    @property
    def journal(self) -> Path:
        return self.path / "journal"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def ledger(self) -> Path:
        """The learner's record of what it trained (:mod:`erlay.actors.learner.ledger`)."""
        return self.path / "ledger.jsonl"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.md"

    @property
    def reward_plot(self) -> Path:
        return self.path / "reward_curve.png"

    def append_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str)
        with self._lock, open(self.metrics, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
        return out

    def rl_steps(self) -> list[dict[str, Any]]:
        return [m for m in self.read_metrics() if m.get("phase") == "rl"]

    def plot_rewards(self) -> Path | None:
        steps = self.rl_steps()
        if not steps:
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        judged = [m for m in steps if m.get("reward_mean") is not None]
        ax.plot([m["step"] for m in judged], [m["reward_mean"] for m in judged], lw=1.2)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean reward")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(self.path.name, fontsize=9)
        fig.tight_layout()
        fig.savefig(self.reward_plot, dpi=110)
        plt.close(fig)
        return self.reward_plot

    def write_summary(self, status: str, wall_s: float, detail: str = "",
                      started_at: float | None = None) -> str:
        """Write summary.md as the driver that started at ``started_at`` (unix; the
        ``started_at`` of its metrics records) ends after ``wall_s`` seconds.  After a
        ``--resume`` the wall time is the whole run's, outages included, and the throughput
        is over the RL time of every driver run (:mod:`erlay.actors.observe.timing`)."""
        records = self.read_metrics()
        steps = [m for m in records if m.get("phase") == "rl"]
        timing = run_timing(records, wall_s, started_at)
        # The mean reward of judged samples: a step whose every sample failed has none.
        rewards = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
        start, end = reward_window(rewards)
        samples = sum(m["samples"] for m in steps)
        tokens = sum(m["gen_tokens"] for m in steps)
        dropped = not_trained(steps)
        events = read_events(self.events) if self.events.exists() else []
        restarts = Counter(_domain(e.supervisor) for e in events
                           if e.context is EventKind.RESTART)
        lines = [f"# {self.path.name}", "", f"- status: **{status}**"]
        if detail:
            lines.append(f"- detail: {detail}")
        lines += [f"- RL steps: {len(steps)}", *_time_lines(timing),
                  f"- reward: {start:.3f} (first 10% of steps) -> {end:.3f} (last 10%)",
                  f"- samples: {samples}" + _rate(samples, timing.rl_s, "/s"),
                  f"- generated tokens: {tokens}" + _rate(tokens, timing.rl_s, " tokens/s"),
                  f"- trained tokens: {trained_tokens(steps)} (each RL step once)",
                  f"- samples not trained: {sum(dropped.values())} ("
                  + ", ".join(f"{kind} {n}" for kind, n in dropped.items()) + ")",
                  f"- poison inputs: {_last_per_step(steps, 'poison')} (calls that killed "
                  "their worker twice, not tried again)",
                  f"- sandbox calls: {_sandbox_calls(records)}",
                  f"- restarts: {sum(restarts.values())}"]
        if restarts:
            lines += ["", "| domain | restarts |", "|---|---|"]
            lines += [f"| {d} | {n} |" for d, n in restarts.most_common()]
        if self.reward_plot.exists():
            lines += ["", "![reward curve](reward_curve.png)"]
        text = "\n".join(line for line in lines if line is not None) + "\n"
        self.summary.write_text(text, encoding="utf-8")
        return text


def _time_lines(timing: RunTiming) -> list[str]:
    """Wall time (the whole run's, across resumes), the outage, and the RL time."""
    wall = f"- wall time: {timing.wall_s:.1f} s"
    if not timing.resumed:
        return [wall, f"- RL time: {timing.rl_s:.1f} s (the sum of the RL step windows)"]
    runs = ", ".join(f"{s.wall_s:.1f} s" for s in timing.segments)
    return [wall + f" ({len(timing.segments)} driver runs: {runs}; and the outage)",
            f"- time lost to the outage: {timing.outage_s:.1f} s (from the last record "
            f"before each --resume to the resumed driver's start; {timing.resumed} "
            "resume(s))",
            f"- RL time: {timing.rl_s:.1f} s (the sum of the RL step windows of every "
            "driver run)"]


def _last_per_step(steps: list[dict[str, Any]], key: str) -> int:
    """``key`` summed over the RL steps, each step's last record counted once."""
    by_step = {int(m["step"]): int(m.get(key) or 0) for m in steps if "step" in m}
    return sum(by_step.values())


def _sandbox_calls(records: list[dict[str, Any]]) -> int:
    """Each driver run counts its sandbox calls from 0: the last RL record of each."""
    total = 0
    for segment in split_segments(records):
        rl = [m for m in segment if m.get("phase") == "rl"]
        total += int(rl[-1].get("sandbox_calls") or 0) if rl else 0
    return total


def _rate(count: float, rl_s: float, unit: str) -> str:
    return f" ({count / rl_s:.1f}{unit} over the RL time)" if rl_s > 0 else ""


def _domain(supervisor_path: str) -> str:
    parts = supervisor_path.split("/")
    return parts[1] if len(parts) > 1 else parts[0]
