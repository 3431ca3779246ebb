"""The learner's own durable record of what it trained on: ``ledger.jsonl`` in the run dir.

The rollout coordinator's journal says which rollouts were *consumed*; the ledger is the
independent evidence of what the *learner* did with them, written by the learner (rank 0)
after each optimiser step, fsynced before ``train_step`` returns.  The chaos invariants
compare the two as multisets, so a rollout trained twice cannot collapse into one.

Records, one JSON object per line:

- ``{"event": "start", "step": s, "restored": bool, "time": t}``: an incarnation of the
  learner began at step ``s`` (0, or the step of the checkpoint it restored).  Whatever an
  earlier incarnation recorded for steps ``>= s`` died with that incarnation's weights: the
  steps are trained again, and only the later records count (:func:`effective_steps`).
- ``{"step": n, "version": v, "trained": [[rollout_id, min_version], ...], "masked": [ids],
  "time": t}``: step ``n`` was trained by a learner at policy version ``v``; ``trained``
  holds every sample with at least one token in the loss, in the batch's order, with the
  oldest policy version among its tokens (-1 when no policy made any), ``masked`` the
  samples fed with every token masked out (stale, judge failed, user code failed).  Both
  are lists, one entry per row fed: a rollout fed twice shows twice.  (Ledgers written
  before held ``trained`` as a dict keyed by rollout id; they are still read.)

A torn last line (a crash mid-write) is ignored; any other undecodable line raises.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LedgerStep:
    """One effective ledger step."""

    step: int
    version: int
    trained: tuple[tuple[str, int], ...] = ()   # (rollout id, oldest version), per row
    masked: tuple[str, ...] = ()

    @property
    def fed(self) -> list[str]:
        """Every rollout id the step fed, trained or masked, once per row."""
        return [*(rid for rid, _ in self.trained), *self.masked]


class LearnerLedger:
    """Appends ledger records to ``path``, each flushed and fsynced before returning."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "time": time.time()}, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def started(self, step: int, restored: bool) -> None:
        self._append({"event": "start", "step": int(step), "restored": bool(restored)})

    def trained(self, step: int, version: int, rollout_ids: Sequence[str],
                versions: Sequence[Sequence[int]],
                loss_mask: Sequence[Sequence[bool]] | None) -> None:
        """Record step ``step`` trained at ``version`` on the batch's rows (every row, a
        repeated rollout id included: the invariants must see it)."""
        trained: list[list[Any]] = []
        masked: list[str] = []
        for i, rid in enumerate(rollout_ids):
            mask = loss_mask[i] if loss_mask is not None else [True] * len(versions[i])
            if any(mask):
                made = [v for v in versions[i] if v >= 0]
                trained.append([rid, min(made) if made else -1])
            else:
                masked.append(rid)
        self._append({"step": int(step), "version": int(version), "trained": trained,
                      "masked": masked})


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """Every record of the ledger at ``path``, in order; [] when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # torn by a crash mid-write: the step it described is trained again
            raise ValueError(f"{path}:{i + 1}: not a ledger record: {line[:80]!r}") from None
    return out


def effective_steps(records: Iterable[Mapping[str, Any]]) -> list[LedgerStep]:
    """The steps whose updates survive in the learner's timeline, in training order.

    A ``start`` record at step ``s`` drops every earlier record of a step ``>= s``; a step
    recorded twice with no ``start`` between is kept twice (that is a duplicate the
    exactly-once invariant must see, never collapsed here)."""
    kept: list[LedgerStep] = []
    for rec in records:
        if rec.get("event") == "start":
            begin = int(rec["step"])
            kept = [s for s in kept if s.step < begin]
            continue
        kept.append(LedgerStep(int(rec["step"]), int(rec["version"]),
                               _trained_rows(rec["trained"]),
                               tuple(str(r) for r in rec.get("masked", ()))))
    return kept


def _trained_rows(trained: Any) -> tuple[tuple[str, int], ...]:
    """A record's ``trained``: a list of [rollout id, version] pairs, or (ledgers written
    before) a dict of them.  Raises TypeError/ValueError on anything else."""
    pairs = list(trained.items()) if isinstance(trained, dict) else trained
    if not isinstance(pairs, list):
        raise TypeError(f"'trained' is a {type(trained).__name__}, not a list of pairs")
    out = []
    for pair in pairs:
        rid, version = pair   # ValueError when it is not a pair
        out.append((str(rid), int(version)))
    return tuple(out)
