"""Text views of a run's rollout journal, for ``erlay journal inspect RUN_DIR``.

Every function opens ``RUN_DIR/journal`` read-only: inspection recovers the same state a
writer would, reports a torn tail, and never truncates, removes or locks anything, so it is
safe on a run that is still writing (a record being written shows up as a torn tail).
Functions return text; the CLI prints it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from erlay.actors.journal.state import JournalState, RolloutRecord, RolloutState
from erlay.actors.journal.store import Journal, JournalNotFound, list_files
from erlay.supervisor.errors import ErlayError

JOURNAL_DIR = "journal"


class RolloutNotFound(ErlayError):
    """The journal holds no rollout with the requested id."""


def journal_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / JOURNAL_DIR


def _open(run_dir: Path | str) -> Journal:
    path = journal_dir(run_dir)
    if not path.is_dir():
        raise JournalNotFound(f"{run_dir} has no journal (expected the directory {path})")
    return Journal.open(path, read_only=True, snapshot_every=None)


def _short(value: Any, limit: int = 96) -> str:
    text = json.dumps(value, separators=(",", ":"), default=repr)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def inspect_summary(run_dir: Path | str) -> str:
    """Rollout counts by state, anomalies, files with sizes, and the recovery report."""
    journal = _open(run_dir)
    state = journal.state
    counts = state.by_state()
    lines = [f"journal {journal.directory}",
             "rollouts: " + ", ".join(f"{name} {n}" for name, n in counts.items()),
             f"records: {state.applied}"]
    if state.anomalies:
        lines.append(f"anomalies: {state.anomaly_count}")
        lines += [f"  {n:>6}  {reason}" for reason, n in sorted(state.anomalies.items())]
    else:
        lines.append("anomalies: none")
    lines.append("files:")
    lines += [f"  {name:<28} {size:>12,} B" for name, size in list_files(journal.directory)]
    lines.append(f"recovery: {journal.recovery.describe()}")
    return "\n".join(lines) + "\n"


def list_rollouts(run_dir: Path | str, state: str | RolloutState) -> str:
    """One line per rollout in ``state`` (``in_flight``, ``completed`` or ``consumed``).

    Raises ValueError naming the valid states for anything else."""
    try:
        wanted = RolloutState(state)
    except ValueError:
        choices = ", ".join(s.value for s in RolloutState)
        raise ValueError(f"unknown rollout state {state!r}; expected one of {choices}") from None
    journal = _open(run_dir)
    ids = journal.state.ids_in(wanted)
    lines = [f"{len(ids)} rollout(s) {wanted.value}"]
    for rid in ids:
        lines.append("  " + _one_line(journal.state, rid))
    return "\n".join(lines) + "\n"


def _one_line(state: JournalState, rollout_id: str) -> str:
    record = state.rollout(rollout_id)
    if record is None:
        return f"{rollout_id}  consumed by step {state.consumed[rollout_id]} (compacted)"
    tokens = sum(len(c.get("token_ids", [])) for c in record.chunks)
    versions = sorted({c.get("version") for c in record.chunks}, key=str)
    text = (f"{rollout_id}  step {record.dispatched.get('step')}  {len(record.chunks)} "
            f"chunk(s), {tokens} token(s), versions {versions}, {len(record.tool_calls)} "
            f"tool call(s)")
    if record.pending_tool_calls():
        text += f" ({len(record.pending_tool_calls())} pending)"
    if record.completed is not None:
        text += f", reward {record.completed.get('reward')}"
    if record.consumed_step is not None:
        text += f", consumed by step {record.consumed_step}"
    return text


def inspect_rollout(run_dir: Path | str, rollout_id: str) -> str:
    """The rollout's full history in the order it was recorded.

    A consumed rollout whose record was compacted at a snapshot shows only its step.
    Raises RolloutNotFound if the journal never saw ``rollout_id``."""
    journal = _open(run_dir)
    state = journal.state
    record = state.rollout(rollout_id)
    if record is None:
        if rollout_id in state.consumed:
            return (f"rollout {rollout_id}: consumed by step {state.consumed[rollout_id]}; "
                    "its history was compacted at a snapshot\n")
        raise RolloutNotFound(f"no rollout {rollout_id!r} in journal {journal.directory}")
    lines = [f"rollout {rollout_id}: {record.state.value}"]
    lines += [f"  {kind:<12}{_history_line(record, kind, ref)}" for kind, ref in record.history]
    pending = record.pending_tool_calls()
    if pending:
        lines.append(f"  pending tool calls: {', '.join(pending)}")
    return "\n".join(lines) + "\n"


def _history_line(record: RolloutRecord, kind: str, ref: int | str | None) -> str:
    match kind:
        case "dispatched":
            d = record.dispatched
            return (f"step {d.get('step')} group {d.get('group')} episode "
                    f"{d.get('episode_index')} seed {d.get('seed')} version {d.get('version')} "
                    f"prompt {len(d.get('prompt_ids', []))} token(s)")
        case "chunk" if isinstance(ref, int):
            c = record.chunks[ref]
            ids = list(c.get("token_ids", []))
            return (f"turn {c.get('turn')} start {c.get('start')} {len(ids)} token(s) "
                    f"version {c.get('version')} {_short(ids, 60)}")
        case "observation" if isinstance(ref, int):
            o = record.observations[ref]
            return f"turn {o.get('turn')} {len(o.get('token_ids', []))} token(s)"
        case "tool_call" if isinstance(ref, str):
            return f"{ref} code {_short(record.tool_calls[ref])}"
        case "tool_result" if isinstance(ref, str):
            return f"{ref} {_short(record.tool_results[ref])}"
        case "judged" if isinstance(ref, str):
            return f"{ref} {_short(record.judgements[ref])}"
        case "completed":
            return _short(record.completed)
        case "consumed":
            return f"by step {record.consumed_step}"
        case _:
            return f"(unrecognized history entry {kind} {ref!r})"
