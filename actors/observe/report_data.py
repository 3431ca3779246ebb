"""The reading half of ``erlay report``: a run directory, parsed and analysed, no I/O beyond
reading it and no figures.

:func:`load_run` parses what a run directory holds into :class:`RunData`, turning every
missing or damaged file into a note instead of an error (a torn last JSONL line is skipped
and counted); :func:`analyze` derives the failures and what they cost
(:mod:`erlay.actors.observe.attribution`).  :mod:`erlay.actors.observe.report` draws and
writes the report from these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from erlay.actors.observe.attribution import (
    AttributionRow,
    Failure,
    StepWindow,
    TimeLost,
    attribution_rows,
    domain_rows,
    failures_from_events,
    job_start,
    step_windows,
    time_lost,
)
from erlay.actors.rundir import RunDir
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.events import EventKind, SupervisorEvent

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.md")


class NotARunDir(ErlayError):
    """The path given to ``erlay report`` is not an erlay run directory."""


# ------------------------------------------------------------------------------- reading
@dataclass
class JsonlRead:
    """The objects of a JSONL file; ``skipped`` lines did not parse, ``torn`` if the last
    of them was an unterminated last line (a writer died mid-line)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    torn: bool = False


def read_jsonl(path: Path) -> JsonlRead:
    """Every JSON object line of ``path``, streaming; other lines are counted, not raised."""
    out = JsonlRead()
    last_bad = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                out.records.append(value)
                last_bad = ""
            elif line.strip():
                out.skipped += 1
                last_bad = line
    out.torn = bool(last_bad) and not last_bad.endswith("\n")
    return out


def _skip_note(name: str, read: JsonlRead) -> str | None:
    if not read.skipped:
        return None
    if read.torn and read.skipped == 1:
        return f"{name}: the last line is torn (its writer died mid-line); skipped."
    return f"{name}: {read.skipped} unreadable line(s) skipped" + (
        ", the last one torn (its writer died mid-line)." if read.torn else ".")


@dataclass
class RunData:
    """What a run directory holds, parsed, and ``notes`` on what is missing or damaged."""

    path: Path
    metrics: list[dict[str, Any]]
    rl: list[dict[str, Any]]          # phase "rl" records with a numeric time, in file order
    events: list[SupervisorEvent]
    gen_latencies: list[float]        # seconds, from "generate" spans
    status: str | None                # from summary.md; None if there is none
    detail: str | None
    planned_steps: int | None
    recorded_start: float | None      # chaos-report.json started_at
    notes: list[str] = field(default_factory=list)


def check_run_dir(path: Path) -> None:
    """Raise :class:`NotARunDir` naming what is wrong unless ``path`` is a run directory."""
    if not path.exists():
        raise NotARunDir(f"{path} does not exist")
    if not path.is_dir():
        raise NotARunDir(f"{path} is not a directory")
    if any((path / name).is_file() for name in RUN_MARKERS):
        return
    runs = sorted(p.name for p in path.iterdir()
                  if p.is_dir() and any((p / n).is_file() for n in RUN_MARKERS))
    hint = f"; run directories in it: {', '.join(runs[:3])}" if runs else ""
    raise NotARunDir(f"{path} is not an erlay run directory (no {', '.join(RUN_MARKERS)})"
                     f"{hint}")


def is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _summary_fields(text: str) -> tuple[str | None, str | None]:
    status = re.search(r"^- status: \*\*(.+?)\*\*", text, re.MULTILINE)
    detail = re.search(r"^- detail: (.+)$", text, re.MULTILINE)
    return (status.group(1) if status else None, detail.group(1) if detail else None)


def _planned_steps(config: Path) -> int | None:
    try:
        steps = (yaml.safe_load(config.read_text(encoding="utf-8")) or {})["run"]["steps"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) else None


def _read_events(run: RunDir, notes: list[str]) -> list[SupervisorEvent]:
    if not run.events.is_file():
        notes.append("no events.jsonl: failures, recovery times and time lost cannot be "
                     "attributed.")
        return []
    read = read_jsonl(run.events)
    events, bad = [], 0
    for record in read.records:
        try:
            events.append(SupervisorEvent.from_dict(record))
        except (KeyError, ValueError, TypeError):
            bad += 1
    if note := _skip_note("events.jsonl", read):
        notes.append(note)
    if bad:
        notes.append(f"events.jsonl: {bad} line(s) that are not supervisor events skipped.")
    return events


def _read_latencies(path: Path, notes: list[str]) -> list[float]:
    files = sorted((path / "telemetry").glob("spans-*.jsonl"))
    if not files:
        notes.append("no telemetry/spans-*.jsonl: the generation-latency distribution falls "
                     "back to the per-step figures of metrics.jsonl.")
        return []
    out, skipped = [], 0
    for spans in files:
        read = read_jsonl(spans)
        skipped += read.skipped
        out += [s["end"] - s["start"] for s in read.records if s.get("name") == "generate"
                and is_num(s.get("start")) and is_num(s.get("end"))
                and 0 < s["start"] <= s["end"]]  # an unset start is written as 0
    if skipped:
        notes.append(f"telemetry: {skipped} unreadable span line(s) skipped.")
    return out


def load_run(path: Path) -> RunData:
    """Parse the run directory at ``path`` (checked with :func:`check_run_dir`)."""
    check_run_dir(path)
    path = path.resolve()
    run = RunDir(path)
    notes: list[str] = []
    metrics: list[dict[str, Any]] = []
    if not run.metrics.is_file():
        notes.append("no metrics.jsonl: no reward, throughput or goodput figures.")
    else:
        read = read_jsonl(run.metrics)
        metrics = read.records
        if note := _skip_note("metrics.jsonl", read):
            notes.append(note)
        if not metrics:
            notes.append("metrics.jsonl holds no records: no reward, throughput or goodput "
                         "figures.")
    rl = [m for m in metrics if m.get("phase") == "rl" and is_num(m.get("time"))]
    if metrics and not rl:
        notes.append("metrics.jsonl holds no RL step: the run ended before its first one.")
    status = detail = None
    if run.summary.is_file():
        status, detail = _summary_fields(run.summary.read_text(encoding="utf-8",
                                                               errors="replace"))
    else:
        notes.append("no summary.md: the driver did not finish (it crashed, was killed, or "
                     "is still running); the report covers what was written before.")
    recorded = None
    chaos = path / "chaos-report.json"
    if chaos.is_file():
        try:
            value = json.loads(chaos.read_text(encoding="utf-8")).get("started_at")
            recorded = float(value) if is_num(value) else None
        except (json.JSONDecodeError, AttributeError):
            notes.append("chaos-report.json is unreadable; ignored.")
    return RunData(path, metrics, rl, _read_events(run, notes), _read_latencies(path, notes),
                   status, detail, _planned_steps(run.config), recorded, notes)


# ------------------------------------------------------------------------------ analysis
@dataclass(frozen=True)
class Analysis:
    """The run's failures and what they cost, in job-relative time where ``start`` is set."""

    start: float | None
    start_source: str
    windows: list[StepWindow]
    failures: list[Failure]
    lost: TimeLost
    rows: list[AttributionRow]
    domains: list[AttributionRow]
    escalations: int

    def at(self, unix: float) -> float:
        """Seconds since the job start (0 when the start is unknown)."""
        return unix - self.start if self.start is not None else 0.0


def analyze(data: RunData) -> Analysis:
    start, source = job_start(data.metrics, data.events, data.recorded_start)
    windows = step_windows(data.rl, start)
    failures = failures_from_events(data.events)
    lost = time_lost(failures, windows, start)
    escalations = sum(e.context is EventKind.ESCALATION for e in data.events)
    return Analysis(start, source, windows, failures, lost,
                    attribution_rows(failures, lost), domain_rows(failures, lost),
                    escalations)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation."""
    import numpy as np
    return float(np.percentile(values, q))
