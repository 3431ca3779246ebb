"""Rollout transitions: every state change of a rollout, as the coordinator records it.

The coordinator reports each transition to a :class:`TransitionSink` before it acts on the
next one.  A durable journal implements the sink and can rebuild every in-flight rollout from
what it recorded: the dispatch (prompt, sampling seed, policy version), each streamed chunk
(tokens, behaviour logprobs, the version that made them), each tool call and its result under
its idempotency key, each judgement, completion, and the learner step that consumed it.
"""

from __future__ import annotations

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
        self._lock = threading.Lock()

    def record(self, transition: Transition) -> None:
        with self._lock:
            self.items.append(transition)

    def of(self, kind: TransitionKind) -> list[Transition]:
        with self._lock:
            return [t for t in self.items if t.kind is kind]


class TeeTransitions:
    """Records every transition in each sink, in order (a journal and a test's memory)."""

    def __init__(self, *sinks: TransitionSink) -> None:
        self.sinks = sinks

    def record(self, transition: Transition) -> None:
        for sink in self.sinks:
            sink.record(transition)
