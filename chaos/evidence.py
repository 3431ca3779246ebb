"""A run directory's durable evidence, read into a :class:`RunObservation`: what
``erlay verify`` judges, and what ``erlay chaos run`` judges its record invariants on.

Only files, never a process: the journal (its newest usable snapshot and the segments after
it, opened read-only), the learner's ledger, the committed checkpoints with their manifests,
``events.jsonl``, ``metrics.jsonl``, ``config.yaml`` and ``summary.md``.  A run may still be
writing them: a torn last line or a torn journal tail is what was past the last write, and
goes into ``notes``; a file the run deletes while it is read (journal retention, checkpoint
retention) is read again.  Damaged evidence (a corrupt journal or ledger) never raises here:
the observation says what is wrong, and the invariants that need it fail saying so.  Only
the two config sections the invariants read are validated (``rollout`` and
``supervision``), so a run verifies on a machine without its plug-ins.  Nothing here judges
(:mod:`erlay.chaos.invariants` does) and nothing is modified.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from erlay.actors.config import ConfigError, JobConfig, RolloutSection, SupervisionSection
from erlay.actors.journal.format import (
    SEGMENT_FILE,
    JournalCorrupt,
    RecoveryReport,
    numbered_files,
    read_segment,
    recover,
)
from erlay.actors.journal.state import JournalState
from erlay.actors.journal.transitions import Transition, TransitionKind
from erlay.actors.learner.checkpoint.format import (
    SHARDED,
    CheckpointInvalid,
    list_checkpoints,
    load,
    read_manifest,
    verify_files,
)
from erlay.actors.learner.ledger import read_ledger
from erlay.actors.rundir import RunDir
from erlay.chaos.observation import RunObservation
from erlay.supervisor.events import read_events

DOMAINS = ("learner", "generation", "sandbox", "judge", "environment", "rollout")
_STATUS = re.compile(r"^- status: \*\*(\w+)\*\*", re.MULTILINE)
_READ_TRIES = 3   # a live run may delete what was listed a moment before (retention)
S = TypeVar("S", RolloutSection, SupervisionSection)


class NotARunDir(ValueError):
    """The path is not an erlay run directory (no ``config.yaml``)."""


@dataclass(frozen=True)
class JournalEvidence:
    """The journal on disk: the state recovered read-only (everything it keeps for good),
    the transitions of every segment still on disk (retention keeps those after the older
    kept snapshot), in order, and what recovery found."""

    state: JournalState
    stream: list[Transition]
    report: RecoveryReport


def read_journal(directory: Path) -> JournalEvidence | None:
    """The journal under ``directory``, or None when there is none.  Raises
    :class:`JournalCorrupt` for damage a crash cannot explain."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    for attempt in range(_READ_TRIES):
        try:
            recovered = recover(directory, read_only=True)
            segments = numbered_files(directory, SEGMENT_FILE)
            stream = [t for n in sorted(segments)
                      for _, _, t in read_segment(segments[n].read_bytes()).records]
            return JournalEvidence(recovered.state, stream, recovered.report)
        except (JournalCorrupt, FileNotFoundError):
            if attempt + 1 == _READ_TRIES:
                raise
            time.sleep(0.2)   # a snapshot's retention ran between listing and reading
    raise AssertionError("unreachable")


def checkpoint_problems(root: Path) -> list[tuple[int, str | None]]:
    """``(step, problem)`` of every checkpoint under ``root`` that looks committed (a
    complete manifest, files of the listed sizes); ``problem`` is None when its content
    hashes verify and it loads (a sharded one, which needs its ranks to load: its hashes
    verify), else why not.  One that retention deletes while it is read is left out."""
    out: list[tuple[int, str | None]] = []
    for info in list_checkpoints(root):
        try:
            if info.layout == SHARDED:
                verify_files(info.path, read_manifest(info.path, info.step))
            else:
                load(info.path, verify=True)
        except (CheckpointInvalid, OSError, RuntimeError, ValueError) as exc:
            if info.path.exists():
                out.append((info.step, str(exc)))
        else:
            out.append((info.step, None))
    return out


def _torn(path: Path) -> str | None:
    """A note when ``path``'s last line is partial (being written, or cut by a crash)."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return None
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return None
    return f"{path.name}: a partial last line (past the last write) was not read"


def run_status(run_dir: RunDir) -> str:
    """How the run ended, by its ``summary.md``: ``finished``, ``failed``, or ``unended``
    (no summary: still running, or killed before it could write one)."""
    if not run_dir.summary.exists():
        return "unended"
    m = _STATUS.search(run_dir.summary.read_text(encoding="utf-8"))
    status = m.group(1) if m else "unended"
    return status if status in ("finished", "failed") else "unended"


def run_settings(config: Path) -> tuple[RolloutSection, SupervisionSection]:
    """The two sections of a run's ``config.yaml`` the invariants read (the staleness bound,
    the restart intensities), validated alone: the rest (plug-in classes, model and data
    paths) need not resolve on the machine that verifies.  Raises :class:`ConfigError`."""
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{config}: not readable YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config}: expected a mapping of sections")
    return (_section(config, data, "rollout", RolloutSection),
            _section(config, data, "supervision", SupervisionSection))


def _section(config: Path, data: dict[str, Any], name: str, model: type[S]) -> S:
    try:
        return model.model_validate(data.get(name) or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join([name, *(str(p) for p in first["loc"])])
        raise ConfigError(f"{config}: {where}: {first['msg']}") from None


def _journal_evidence(directory: Path) -> tuple[JournalEvidence | None, str | None]:
    """The journal, or None and why it cannot be used."""
    try:
        journal = read_journal(directory)
    except JournalCorrupt as exc:
        return None, str(exc)
    if journal is None:
        return None, "the run has no journal"
    if not journal.state.complete:
        return None, (f"{directory} was written by an erlay that did not keep every "
                      "consumption and transition count in its snapshots")
    return journal, None


def observe_dir(path: Path | str, cfg: JobConfig | None = None) -> RunObservation:
    """The durable evidence of the run directory ``path``.  The staleness bound and restart
    intensities come from ``cfg`` when given, else from the run's own ``config.yaml``
    (:func:`run_settings`).  Raises :class:`NotARunDir`, and :class:`ConfigError` for a
    ``config.yaml`` whose ``rollout`` or ``supervision`` section is invalid."""
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise NotARunDir(f"{path} is not an erlay run directory (no config.yaml)")
    run_dir = RunDir(path)
    rollout, sup = (cfg.rollout, cfg.supervision) if cfg else run_settings(run_dir.config)
    notes = [n for p in (run_dir.metrics, run_dir.events, run_dir.ledger)
             if (n := _torn(p)) is not None]
    events = read_events(run_dir.events) if run_dir.events.exists() else []
    metrics = run_dir.read_metrics()
    journal, journal_problem = _journal_evidence(run_dir.journal)
    consumed: list[tuple[str, int]] = []
    dispatched: set[str] = set()
    filtered: set[str] = set()
    tools: list[tuple[str, str, object]] = []
    judged: list[tuple[str, object]] = []
    kinds: dict[str, int] = {}
    anomalies: dict[str, int] = {}
    if journal is not None:
        state = journal.state
        consumed = [*state.consumed.items(),
                    *((rid, s) for rid, steps in state.consumed_again.items() for s in steps)]
        dispatched = set(state.consumed) | set(state.rollouts)
        filtered = set(state.filtered)
        kinds, anomalies = dict(state.kinds), dict(state.anomalies)
        for t in journal.stream:
            if t.kind in (TransitionKind.TOOL_CALL, TransitionKind.TOOL_RESULT):
                tools.append(("call" if t.kind is TransitionKind.TOOL_CALL else "result",
                              str(t.data.get("key")), t.data.get("result")))
            elif t.kind is TransitionKind.JUDGED:
                judged.append((str(t.data.get("key")), t.data.get("judgement")))
        if journal.report.truncated_bytes:
            notes.append(f"journal: {journal.report.truncated_bytes} byte(s) past the last "
                         f"whole record of {journal.report.truncated_segment} were not read")
    intensity = {"erlay": (sup.root.intensity, sup.root.period)}
    for domain in DOMAINS:
        flags = getattr(sup, domain)
        intensity[f"erlay/{domain}"] = (flags.intensity, flags.period)
    try:
        ledger = read_ledger(run_dir.ledger) if run_dir.ledger.exists() else None
        ledger_problem = None if ledger is not None else "the run has no learner ledger"
    except ValueError as exc:   # a line other than the last is not a record
        ledger, ledger_problem = None, f"the learner ledger is unreadable: {exc}"
    last = {int(m["step"]): m for m in metrics if m.get("phase") == "rl"}   # by step
    return RunObservation(
        events=events, metrics=metrics, consumed_transitions=consumed,
        dispatched_ids=dispatched, filtered_ids=filtered, tool_events=tools, judgements=judged,
        journal_found=journal is not None, journal_problem=journal_problem,
        journal_kinds=kinds, journal_anomalies=anomalies,
        notes=notes, judge_failed=sum(int(m.get("judge_failed", 0)) for m in last.values()),
        ledger=ledger, ledger_problem=ledger_problem,
        checkpoints=checkpoint_problems(run_dir.checkpoints),
        steps_trained=len(last), max_staleness=rollout.max_staleness,
        intensity=intensity, status=run_status(run_dir))
