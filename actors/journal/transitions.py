"""Rollout transitions: every state change of a rollout, as the coordinator records it.

The coordinator reports each transition to a :class:`TransitionSink` before it acts on the
next one.  A durable journal implements the sink and can rebuild every in-flight rollout from
what it recorded: the dispatch (prompt, sampling seed, policy version), each streamed chunk
(tokens, behaviour logprobs, the version that made them), each tool call and its result under
its idempotency key, each judgement, completion, and the learner step that consumed it.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol


class TransitionKind(enum.Enum):
    DISPATCHED = "dispatched"      # data: episode, prompt_ids, seed, version, group, step
    CHUNK = "chunk"                # data: turn, start, token_ids, logprobs, version
    OBSERVATION = "observation"    # data: turn, token_ids (context the policy did not generate)
    TOOL_CALL = "tool_call"        # data: key, code
    TOOL_RESULT = "tool_result"    # data: key, result
    JUDGED = "judged"              # data: key, judgement
    COMPLETED = "completed"        # data: reward, failure, turns
    CONSUMED = "consumed"          # data: step (the learner step that trained on it)


@dataclass(frozen=True)
class Transition:
    kind: TransitionKind
    rollout_id: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "rollout_id": self.rollout_id, "data": self.data}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Transition:
        return Transition(TransitionKind(data["kind"]), data["rollout_id"], dict(data["data"]))


class TransitionSink(Protocol):
    def record(self, transition: Transition) -> None:
        """Record one transition; returning means it is as durable as the sink promises."""
        ...


class NullTransitions:
    """Records nothing: a job without a journal."""

    def record(self, transition: Transition) -> None:
        return None


class MemoryTransitions:
    """Keeps every transition in memory (tests, diagnostics)."""

    def __init__(self) -> None:
        self.items: list[Transition] = []
        self._counts: collections.Counter[TransitionKind] = collections.Counter()
        self._lock = threading.Lock()

    def record(self, transition: Transition) -> None:
        with self._lock:
            self.items.append(transition)
            self._counts[transition.kind] += 1

    def of(self, kind: TransitionKind) -> list[Transition]:
        """Every transition of ``kind``, in order: a walk over all of them."""
        with self._lock:
            return [t for t in self.items if t.kind is kind]

    def count(self, kind: TransitionKind) -> int:
        """How many transitions of ``kind`` were recorded, without walking them: for a
        watcher that polls while the job runs (``of`` holds the lock that ``record``, on the
        job's hot path, needs, for a walk over every transition)."""
        with self._lock:
            return self._counts[kind]


class TeeTransitions:
    """Records every transition in each sink, in order (a journal and a test's memory)."""

    def __init__(self, *sinks: TransitionSink) -> None:
        self.sinks = sinks

    def record(self, transition: Transition) -> None:
        for sink in self.sinks:
            sink.record(transition)
