"""The generation engine protocol: what the rollout side sends an engine and what streams back.

Every backend (the built-in ``torch`` engine, vLLM) speaks this protocol, so the rollout
coordinator and the journal never care which one serves them.  Everything here is plain data
and Ray-free; the dicts produced by ``to_dict`` are what crosses the Ray boundary and what the
journal records.

Contracts that every backend keeps:

- A stream for one request is a sequence of :class:`TokenChunk` dicts whose ``start`` fields
  are contiguous (``start`` of the first is ``len(prefix_ids)``) and whose last chunk, and only
  that one, has ``finished=True``.
- Each chunk was produced by exactly one policy ``version``; a weight update never lands in the
  middle of a chunk.
- ``max_new_tokens`` counts the tokens this request generates *beyond* ``prefix_ids``, so a
  resumed request asks for the remaining budget (the rollout runner does exactly that).  The
  whole sequence, ``prompt_ids + prefix_ids`` plus ``max_new_tokens``, must fit in the model's
  context (``max_seq_len``), because the learner scores the finished sequence in one pass.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from erlay.actors.model.errors import WeightsMismatch as WeightsMismatch  # re-exported
from erlay.supervisor.errors import ErlayError


class FinishReason(enum.StrEnum):
    """Why a stream ended.  A StrEnum, so it compares equal to the plain strings on the wire."""

    STOP = "stop"        # sampled one of ``stop_ids`` (the stop token is part of the output)
    LENGTH = "length"    # generated ``max_new_tokens``
    ABORT = "abort"      # aborted by a caller, by the consumer going away, or by shutdown


class InvalidRequest(ErlayError, ValueError):
    """A generation request is malformed; raised at submission, before any work is done.

    A ValueError too, so callers that only know the spec ("a clear ValueError") can catch it.
    """


class ContextTooLong(InvalidRequest):
    """``prompt_ids + prefix_ids`` plus ``max_new_tokens`` does not fit in ``max_seq_len``."""

    def __init__(self, request_id: str, context_len: int, max_new_tokens: int,
                 max_seq_len: int) -> None:
        self.request_id = request_id
        self.context_len = context_len
        self.max_new_tokens = max_new_tokens
        self.max_seq_len = max_seq_len
        super().__init__(f"request {request_id}: context of {context_len} tokens (prompt + "
                         f"prefix) plus max_new_tokens {max_new_tokens} = "
                         f"{context_len + max_new_tokens} exceeds the model's max_seq_len "
                         f"{max_seq_len}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries inside RayTaskError; the default reduce would call
        # __init__ with the message only.
        return (type(self), (self.request_id, self.context_len, self.max_new_tokens,
                             self.max_seq_len))


class RefitUnavailable(ErlayError):
    """A refit's bucket could not be fetched (its object lost or freed, its owner gone, or
    no answer within the per-bucket deadline); nothing was loaded and the engine keeps the
    version it served."""


class EngineFailed(ErlayError):
    """The engine's decode loop died; every request it held ends with this error and the
    engine reports itself exited to its supervisor.

    ``failed_at``: when the engine declared itself failed, on its node's
    ``time.monotonic()``, where the engine records it (None otherwise: the torch engine's
    actor dies with its loop).  It travels with the error (an exception pickles its
    ``__dict__``), so a caller on the same node can tell detection from delivery.  Through
    Ray the caller gets a ``RayTaskError`` that is also an ``EngineFailed`` but whose own
    ``failed_at`` is this class default: the value is on its ``.cause``
    (:func:`erlay.actors.job.domains.engine_failed_at` reads it)."""

    failed_at: float | None = None


class EngineAsleep(ErlayError):
    """The engine is asleep (its KV cache given up for a colocated learner's step, see
    :meth:`EngineProtocol.sleep`) and refuses new requests until it wakes.  Not a failure of
    the engine: the rollout side reads it as a refusal and asks again later or elsewhere
    (:class:`erlay.actors.job.domains.EngineRequestFailed`).  Requests it held when it fell
    asleep are kept and continue after the wake."""


def _number(value: Any, kind: type[int] | type[float], what: str) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{what} must be a number, got {value!r}") from None


def _ints(values: Any, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{what} must be a sequence of token ids, got {values!r}") from None


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to generate.  Lists are accepted and stored as tuples.

    ``seed`` and the completion position fully determine the sampling noise (see
    :mod:`erlay.actors.model.sampling`), so the same request on any engine with the same weights
    yields the same tokens, and a request resumed with ``prefix_ids`` continues token-for-token.
    """

    request_id: str               # e.g. "r-000123/t0" (rollout id + turn)
    prompt_ids: tuple[int, ...]   # full context so far (prompt, earlier turns, tool outputs)
    max_new_tokens: int           # tokens to generate beyond prefix_ids
    seed: int                     # sampling seed of this completion
    temperature: float = 1.0      # 0 = greedy
    prefix_ids: tuple[int, ...] = ()  # tokens of THIS completion already generated (resume)
    stop_ids: tuple[int, ...] = (2,)  # EOS by default; also stop on any id listed
    chunk_tokens: int = 8         # emit a chunk at least every this many tokens
    # The caller's name for this work, the same on every attempt at it: an engine with KV
    # hand-off saves the request's cache under it, and one that takes the request over
    # (with the tokens received as prefix_ids) loads that cache (engine.kv_handoff).
    kv_key: str | None = None
    trace: dict[str, str] | None = field(default=None, compare=False)  # W3C trace context

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "prefix_ids", "stop_ids"):
            object.__setattr__(self, name, _ints(getattr(self, name), name))
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got "
                                 f"{self.request_id!r}")
        for name, kind in (("max_new_tokens", int), ("chunk_tokens", int), ("seed", int),
                           ("temperature", float)):
            object.__setattr__(self, name, _number(getattr(self, name), kind, name))
        if not self.prompt_ids and not self.prefix_ids:
            raise InvalidRequest(f"request {self.request_id}: empty context (no prompt_ids "
                                 "and no prefix_ids); a completion needs something to follow")
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"request {self.request_id}: max_new_tokens must be >= 1, "
                                 f"got {self.max_new_tokens}")
        if self.chunk_tokens < 1:
            raise InvalidRequest(f"request {self.request_id}: chunk_tokens must be >= 1, "
                                 f"got {self.chunk_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"request {self.request_id}: temperature must be finite and "
                                 f">= 0, got {self.temperature}")

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What the next token is conditioned on: the prompt, then the completion so far."""
        return self.prompt_ids + self.prefix_ids

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("prompt_ids", "prefix_ids", "stop_ids"):
            data[name] = list(data[name])
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> GenerationRequest:
        """Inverse of :meth:`to_dict`; unknown keys are refused (a typo must not be ignored)."""
        names = {f.name for f in fields(GenerationRequest)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidRequest(f"unknown request field(s) {unknown}; expected some of "
                                 f"{sorted(names)}")
        try:
            return GenerationRequest(**data)
        except TypeError as exc:  # a required field is missing
            raise InvalidRequest(f"malformed request: {exc}") from None


@dataclass(frozen=True)
class TokenChunk:
    """A piece of one request's stream, all produced by one policy version.

    ``prefill_tokens`` is bookkeeping, not content (equality ignores it): the context tokens
    (``prompt_ids + prefix_ids``, and any tokens generated before a re-prefill) the engine
    computed in prefill for this request since its previous chunk, less what a prefix cache
    already held.  A request's first chunk carries its admission's prefill; a later chunk
    carries a prefill again only after a weight update made the engine prefill it anew.  It
    is how a caller learns what a resumed request cost the engine that took it over.

    ``timing`` is bookkeeping too, on a request's first chunk only: the engine's
    ``time.monotonic()`` when it ``received`` the request, ``admitted`` it to a decode batch
    (or handed it to its backend), finished its ``prefilled`` pass (the first token sampled,
    for backends that do both in one step), and ``sent`` this chunk.  Monotonic clocks are
    per machine, so these compare with the caller's only on the same node; a backend may
    leave it None.  It is how the replay bench splits a resume into stages.

    ``kv_handoff`` is bookkeeping, on the first chunk of a request that came with a ``kv_key``
    and a prefix to an engine with KV hand-off: how its cache was restored, one of
    :data:`erlay.actors.engine.kv_handoff.REASONS` (``adopted``/``partial``: from the cache a
    failed engine saved; otherwise why it was prefilled again).
    """

    request_id: str
    start: int                    # completion position of token_ids[0]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]   # behaviour logprob of each token (see model.sampling)
    version: int                  # policy version whose weights produced these tokens
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason value when finished
    prefill_tokens: int = field(default=0, compare=False)
    timing: dict[str, float] | None = field(default=None, compare=False)
    kv_handoff: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"chunk of {self.request_id}: {len(self.token_ids)} tokens but "
                             f"{len(self.logprobs)} logprobs")
        if self.finished != (self.finish_reason is not None):
            raise ValueError(f"chunk of {self.request_id}: finished={self.finished} with "
                             f"finish_reason={self.finish_reason!r}")
        if self.finish_reason is not None:
            object.__setattr__(self, "finish_reason", str(FinishReason(self.finish_reason)))

    @property
    def end(self) -> int:
        """Completion position just past this chunk: the next chunk's ``start``."""
        return self.start + len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["token_ids"] = list(self.token_ids)
        data["logprobs"] = list(self.logprobs)
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> TokenChunk:
        return TokenChunk(**data)


@dataclass(frozen=True)
class EngineStats:
    """Counters an engine reports through ``stats()`` (as a dict).

    ``requests_finished`` counts streams that ended with ``stop`` or ``length``;
    ``requests_aborted`` those that ended with ``abort``.  ``waves`` counts prefill passes (a
    group of requests admitted together, including re-prefills after a weight update);
    ``decode_steps`` counts batched steps, each generating one token per running request.
    """

    version: int
    tokens_generated: int
    requests_submitted: int
    requests_finished: int
    requests_aborted: int
    waves: int
    decode_steps: int
    weight_updates: int
    running: int                  # requests in the decoding batch now
    pending: int                  # requests waiting for a slot now
    max_batch: int                # configured limit
    max_batch_size: int           # largest batch decoded so far
    mean_batch_size: float        # tokens_generated per decode step
    sleeps: int = 0               # sleep() calls that put the engine to sleep
    wakes: int = 0                # wake_up() calls that made it whole again

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def drain_chunks(queue: asyncio.Queue[TokenChunk | BaseException],
                       streams: int) -> AsyncIterator[list[dict[str, Any]]]:
    """Yield the chunk dicts ``streams`` requests put on one shared ``queue``, batched as
    they arrive, until every request has put its finished chunk: what ``generate_many``
    streams.  An exception put on the queue is raised."""
    while streams:
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        out = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            out.append(item.to_dict())
            streams -= item.finished
        yield out


@runtime_checkable
class EngineProtocol(Protocol):
    """What a generation engine actor offers.  All methods are called through Ray.

    ``generate`` is an async generator method: Ray streams it, and the caller iterates
    ``async for ref in engine.generate.remote(request_dict): chunk = await ref``.  A request
    that cannot be served (:class:`InvalidRequest`) fails on the first ``await ref``.
    """

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream :class:`TokenChunk` dicts for a :class:`GenerationRequest` dict; the last
        has ``finished=True``."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` at the next step; its stream ends with ``finish_reason="abort"``.
        False when the engine holds no such request."""
        ...

    async def update_weights(self, refit: Any) -> int:
        """Serve ``refit`` (an :class:`erlay.actors.model.refit.Refit`: a manifest and one
        object-store ref per bucket) as its version from the next step on; returns the version
        now served.  The manifest is checked and every bucket fetched (each under a deadline)
        before anything is written: a refit that fails raises (:class:`WeightsMismatch`,
        :class:`RefitUnavailable`) and leaves the engine on its old version."""
        ...

    async def version(self) -> int:
        """The policy version served now."""
        ...

    async def stats(self) -> dict[str, Any]:
        """An :class:`EngineStats` dict."""
        ...

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the device memory back for a colocated learner's step: the KV cache always,
        at vLLM ``level`` 1 the weights too (offloaded to host memory), at ``level`` 2 the
        weights discarded (the next refit must replace them all).  Held requests are kept
        (continued after the wake, prefilled again); new ones fail with
        :class:`EngineAsleep`.  Idempotent; returns ``{"asleep": True, ...}``."""
        ...

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take the memory back: ``["weights"]`` first (so a refit has parameters to load
        into), then ``["kv_cache"]`` after the refit; ``None`` is both.  The engine serves
        again once both are back.  Idempotent; returns ``{"asleep": bool, ...}``."""
        ...
