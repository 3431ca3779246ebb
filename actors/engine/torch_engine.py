"""The built-in ``torch`` generation engine: an async Ray actor run as a supervised child.

Run it as ``ChildSpec("engine", ActorStart(TorchEngine, kwargs={...}),
deadlines={"decode_step": ...})``.  It implements :class:`erlay.actors.engine.api.EngineProtocol`.

One decode loop (an asyncio task, started by the first call that needs it) owns the model and
the :class:`~erlay.actors.engine.core.DecodeBatch`.  Between two steps it applies, in order: a
pending weight update, aborts, and admission of waiting requests (continuous batching, up to
``max_batch`` running).  Each forward pass runs in a worker thread, so the actor's event loop
keeps answering progress polls, aborts and weight updates while the model computes.

Contracts:

- **Streaming**: ``generate`` is an async generator; Ray 2.60 streams such methods without any
  decorator (``num_returns="streaming"`` is the default for generator methods).  A request the
  engine cannot serve fails on the caller's first ``await ref`` with
  :class:`~erlay.actors.engine.api.InvalidRequest` (a ValueError).  A ``generate`` call that is
  cancelled in the actor, or whose generator is closed early, aborts its request.
- **Weight updates** (a :class:`~erlay.actors.model.refit.Refit`): checked and every bucket
  fetched (each under ``refit_bucket_timeout_s``) before it is queued, so one that fails
  leaves the old version and weights; then copied into the parameters in place between
  steps (:mod:`~erlay.actors.engine.refit_load`); a failure mid-copy fails the engine.
  LoRA adapters stay unmerged: a refit moves them alone.  Every token not yet streamed is
  flushed first, tagged with the old version, so no chunk mixes versions.  Running requests are then
  prefilled again under the new weights instead of reusing the old KV cache: the tokens after
  the update are exactly what a resume from the streamed prefix would produce on any engine
  serving the new version, which keeps the replay invariant.  Updates queued during one step
  collapse into the newest.
- **Progress**: ``begin("decode_step", work="<n> requests")`` while holding requests, one tick
  per step (prefill included), ``begin("weight_update")`` during a load, ``end()`` when idle.
  A wedged forward pass stops the ticks, and the supervisor's deadline fires.
- **Concurrency**: every open ``generate`` stream holds one of the actor's concurrent calls
  (Ray's default for async actors is 1000), and progress polls need one too; a caller that
  keeps more streams open per engine should raise ``max_concurrency`` in the ActorStart
  options.
- **Failure**: if the decode loop raises, every held request fails with
  :class:`~erlay.actors.engine.api.EngineFailed`, later calls are refused, and ``erlay_wait``
  returns an error exit so the supervisor restarts the engine (let it crash).
- **KV hand-off** (``kv_handoff``: the run's node-local directory and the node's byte budget;
  :mod:`erlay.actors.engine.kv_saver`): after each step, in the step's worker thread and
  before their chunks stream, the requests with a ``kv_key`` whose chunk is due have their
  new cache positions saved in the node's slab (after admission, their whole context); a
  request admitted with a ``kv_key`` whose cache another engine on the node saved at the
  served version resumes from it, prefilling only what it lacks, and its first chunk says
  which path it took (``TokenChunk.kv_handoff``).  A request's slot is freed when it
  finishes or its caller aborts it; a polite shutdown keeps the slab for adopters.  If the
  slab cannot be made (no such directory, a dtype it cannot hold) the engine says so once
  and decodes without it.
- **Fault injection**: the failpoints ``generation.decode_step`` (each step, in its phase) and
  ``generation.weight_update`` (before a load) of :mod:`erlay.supervisor.failpoints`.  A ``raise``
  fails the decode loop as above; a ``hang`` stalls only the decode loop, so the actor still
  answers while its progress stops, as a wedged engine does.
"""

from __future__ import annotations

import time

_IMPORTS_STARTED = time.time()   # the engine's own imports (torch, the model): BootTimeline

import asyncio
import dataclasses
import gc
import logging
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from erlay.actors.engine.api import (
    EngineFailed,
    EngineStats,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    TokenChunk,
    drain_chunks,
)
from erlay.actors.engine.boot import BootTimeline, process_started
from erlay.actors.engine.core import (
    DecodeBatch,
    Sequence,
    drafts_for_step,
    run_to_completion,
    validate_request,
)
from erlay.actors.engine.dormancy import Dormancy, free_device_cache, wake_tags
from erlay.actors.engine.kv_saver import KVHandoff
from erlay.actors.engine.refit_load import (
    DEFAULT_BUCKET_TIMEOUT_S,
    check_state,
    fetch_buckets,
    load_state,
    release_pages,
    release_range,
)
from erlay.actors.engine.tail import TailWindow
from erlay.actors.model.build import Policy, build_policy
from erlay.actors.model.refit import (
    Refit,
    RefitManifest,
    check_manifest,
    copy_bucket,
    refit_targets,
)
from erlay.supervisor import failpoints, telemetry
from erlay.supervisor.failpoints import afailpoint
from erlay.supervisor.progress import Progress
from erlay.supervisor.reason import ExitKind, ExitReason

log = logging.getLogger("erlay.engine")
_IMPORTS_DONE = time.time()


@dataclass
class _Stream:
    """A request's sequence and the queue its ``generate`` call reads chunks from."""

    seq: Sequence
    queue: asyncio.Queue[TokenChunk | BaseException] = field(default_factory=asyncio.Queue)
    span: Any = None   # engine.generate, from admission to the last chunk
    # TokenChunk.timing, until the first chunk carries it
    timing: dict[str, float] | None = field(default_factory=dict)


@dataclass
class _Counters:
    tokens_generated: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    waves: int = 0
    decode_steps: int = 0
    weight_updates: int = 0
    max_batch_size: int = 0


def _handoff(model: Policy, options: dict[str, Any] | None, slots: int) -> KVHandoff | None:
    """The engine's KV hand-off from ``options`` (``dir``: the run's node-local directory,
    ``budget_bytes``), or None: off, or it cannot work here (said once; decoding goes on)."""
    if not options:
        return None
    node = "local"
    try:
        import ray
        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray: one node
        pass
    try:
        # Twice the batch: a finished request keeps its slot one step longer (_step).
        return KVHandoff(model, Path(options["dir"]) / node, int(options["budget_bytes"]),
                         2 * slots)
    except (OSError, ValueError) as exc:
        log.warning("KV hand-off is off for this engine: %s", exc)
        return None


def warm_up(model: Policy) -> None:
    """One throwaway request (a prefill and a few decode steps): the first forward of a new
    process allocates and initialises what every later one reuses, and that belongs in the
    engine's start-up, not in the first rollout it serves.  Sampling is a pure function of
    each request's seed and positions, so this changes nothing any request produces."""
    prompt = tuple(range(1, min(4, model.cfg.max_seq_len - 2) + 1))
    run_to_completion(model, [GenerationRequest("warm-up", prompt, max_new_tokens=2, seed=0,
                                                 stop_ids=())])


class TorchEngine:
    """Async Ray actor class (all public methods async) run by the supervisor as an ActorStart
    child.  See the module docstring for the contracts."""

    def __init__(self, model_config: dict[str, Any], *, max_batch: int = 64,
                 torch_threads: int = 1, initial_state: dict[str, Any] | None = None,
                 version: int = 0, seed: int = 0, spec_k: int = 0,
                 spec_max_concurrency: int = 0, spec_verify: str = "coupled",
                 spec_draft: str = "argmax", kv_handoff: dict[str, Any] | None = None,
                 refit_bucket_timeout_s: float = DEFAULT_BUCKET_TIMEOUT_S) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if spec_k and not model_config.get("mtp_heads"):
            raise ValueError(f"spec_k {spec_k} needs a policy with MTP heads (mtp_heads > 0)")
        if spec_verify not in ("coupled", "rejection"):
            raise ValueError(f"spec_verify must be coupled or rejection, got {spec_verify!r}")
        if spec_draft not in ("argmax", "sample"):
            raise ValueError(f"spec_draft must be argmax or sample, got {spec_draft!r}")
        # Self-speculative decoding: draft spec_k tokens with the MTP heads (spec_draft: each
        # head's argmax, or a draw from it), but only while at most spec_max_concurrency
        # requests run (0: always).  At high concurrency a decode step is already busy, so a
        # wide verification step costs about k + 1 plain ones on a CPU; whether it still
        # pays depends on acceptance (docs/generation.md, tail-aware scheduling).
        self.spec_k, self.spec_max_concurrency = spec_k, spec_max_concurrency
        self.spec_verify, self.spec_draft = spec_verify, spec_draft
        self._tail = TailWindow()
        self.boot = BootTimeline()
        if (started := process_started()) is not None:
            self.boot.mark("process_started", started)
        self.boot.mark("imports_started", _IMPORTS_STARTED)
        self.boot.mark("imports_done", _IMPORTS_DONE)
        self.boot.mark("init_started")
        # Explicit, because the engine shares a couple of cores with everything else.
        torch.set_num_threads(torch_threads)
        # Not for_engine: a LoRA policy keeps its peft adapters unmerged, so a refit moves
        # the adapters alone (refit_tensors).
        self.model = build_policy(model_config, seed=seed).eval()
        self.config = self.model.cfg
        self._targets, self._aliases = refit_targets(self.model)
        self.refit_bucket_timeout_s = refit_bucket_timeout_s
        if initial_state is not None:
            check_state(self.model, initial_state)
            load_state(self.model, initial_state)
        self.boot.mark("model_built")
        warm_up(self.model)   # DecodeBatch runs under inference mode itself
        self.boot.mark("warmed")
        self.max_batch = max_batch
        self.progress = Progress()
        self._version = int(version)
        self._batch = DecodeBatch(self.model)
        self._pending: deque[Sequence] = deque()
        self._streams: dict[str, _Stream] = {}
        self._update: tuple[RefitManifest, list[np.ndarray]] | None = None
        self._update_waiters: list[asyncio.Future[int]] = []
        self._dormancy = Dormancy()   # colocated placement: sleep / wake_up
        self._wake = asyncio.Event()
        self._failed = asyncio.Event()
        self._failure: EngineFailed | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._phase: tuple[str, str | None] | None = None
        self._counters = _Counters()
        self._handoff = _handoff(self.model, kv_handoff, max_batch)
        self._kv_drop: list[Sequence] = []   # aborted while pending: freed between steps
        self._kv_done: list[Sequence] = []   # finished in the last step: freed in the next
        self._decode_seconds = 0.0           # wall time in decode steps (tail_report)
        self._reported = (0.0, 0.0)          # decode and save seconds at the last report
        # Torch and the model are long-lived: frozen, the collector's full passes skip them
        # instead of pausing the decode loop's event loop for each (see VllmEngine).
        gc.collect()
        gc.freeze()

    # ----------------------------------------------------------------------- protocol
    async def generate(self, request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Stream TokenChunk dicts for one GenerationRequest dict (see EngineProtocol)."""
        stream = self._submit(GenerationRequest.from_dict(request))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item.to_dict()
                if item.finished:
                    return
        finally:
            if not stream.seq.closed:
                # The consumer went away (cancelled, or the generator was closed early).
                self._abort(stream)

    async def generate_many(self, requests: list[dict[str, Any]]
                            ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """Stream the chunks of many requests through one call: each item is a list of
        TokenChunk dicts, in order within each request, until every request has finished.

        The requests decode in the same batch either way; this only saves a Ray call and a
        stream per request, which dominates the cost of short rollouts.  Every request is
        validated before any is admitted, so an invalid one fails the call and starts none.
        """
        parsed = [GenerationRequest.from_dict(r) for r in requests]
        for request in parsed:
            validate_request(request, self.config.vocab_size, self.config.max_seq_len)
        shared: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        streams = [self._submit(request, shared) for request in parsed]
        try:
            async for out in drain_chunks(shared, len(streams)):
                yield out
        finally:
            for stream in streams:
                if not stream.seq.closed:
                    self._abort(stream)

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` at the next step; False if the engine does not hold it."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self._abort(stream)
        return True

    async def update_weights(self, refit: Refit) -> int:
        """Serve ``refit`` as its version from the next step on; returns the version served.

        Checked and fetched whole before it is queued (module docstring): WeightsMismatch or
        RefitUnavailable leave the engine on its old version and weights."""
        self._raise_if_failed()
        manifest = refit.manifest
        check_manifest(self.model, manifest)
        buffers = await fetch_buckets(refit, self.refit_bucket_timeout_s)
        self._raise_if_failed()   # it may have failed while the buckets came
        if manifest.version < self._version:
            log.warning("weights v%d replace newer v%d", manifest.version, self._version)
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._update = (manifest, buffers)
        self._update_waiters.append(waiter)
        self._ensure_loop()
        self._wake.set()
        return await waiter

    async def version(self) -> int:
        return self._version

    async def boot_timeline(self) -> dict[str, float]:
        """This process's :class:`~erlay.actors.engine.boot.BootTimeline` marks so far."""
        return self.boot.to_dict()

    async def tail_report(self) -> dict[str, Any]:
        """The generation-length tail and the concurrency during it, since the last call
        (see :class:`erlay.actors.engine.tail.TailWindow`); the window starts afresh."""
        batch = self._batch
        report = self._tail.report(drafted=batch.drafted, accepted=batch.accepted)
        self._tail = TailWindow(batch.drafted, batch.accepted)
        # Decode wall time, and the part of it spent saving KV caches for hand-off.
        saved = self._handoff.save_seconds if self._handoff is not None else 0.0
        report["decode_s"] = round(self._decode_seconds - self._reported[0], 4)
        report["kv_save_s"] = round(saved - self._reported[1], 4)
        self._reported = (self._decode_seconds, saved)
        if self._handoff is not None:
            report["kv_handoff"] = self._handoff.stats()
        return report

    async def stats(self) -> dict[str, Any]:
        c = self._counters
        return EngineStats(
            version=self._version, tokens_generated=c.tokens_generated,
            requests_submitted=c.requests_submitted, requests_finished=c.requests_finished,
            requests_aborted=c.requests_aborted, waves=c.waves, decode_steps=c.decode_steps,
            weight_updates=c.weight_updates, running=len(self._batch),
            pending=len(self._pending), max_batch=self.max_batch,
            max_batch_size=c.max_batch_size,
            mean_batch_size=round(c.tokens_generated / c.decode_steps, 3)
            if c.decode_steps else 0.0, sleeps=self._dormancy.sleeps,
            wakes=self._dormancy.wakes).to_dict()

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the decoding memory back (EngineProtocol.sleep): between two decode steps
        the batch's KV cache and its per-row logits and hidden states are dropped and, on
        CUDA, the allocator's free blocks returned.  ``level`` is vLLM's; this engine keeps
        its weights at either (they are what the refit copies into).  Requests it held wait,
        flushed, at the head of its queue and are prefilled again after the wake: sampling
        is seeded by position, so their tokens are those of an unbroken run.  Returns once
        the cache is gone, with ``cache_bytes`` (0)."""
        self._raise_if_failed()
        waiter = self._dormancy.fall_asleep(level)
        self._ensure_loop()
        self._wake.set()
        await waiter
        return self._dormancy.report(cache_bytes=self._cache_bytes())

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Serve again once ``tags`` bring the KV cache back (EngineProtocol.wake_up;
        ``["weights"]`` alone changes nothing here: they never left).  The cache is built
        by the next admission, as for any new batch."""
        self._raise_if_failed()
        if self._dormancy.wake(wake_tags(tags)):
            self._wake.set()
        return self._dormancy.report(cache_bytes=self._cache_bytes())

    def _cache_bytes(self) -> int:
        """Bytes of the decoding batch's KV cache and per-row state now."""
        batch = self._batch
        if not batch.rows:
            return 0
        keys, values, mask, hidden, _ = batch.kv_views()
        return sum(t.numel() * t.element_size() for t in (*keys, *values, mask, hidden))

    # ------------------------------------------------------------------ supervisor hooks
    async def erlay_wait(self) -> dict[str, Any]:
        """Returns (an error exit) only if the decode loop died; see the module docstring."""
        await self._failed.wait()
        return ExitReason(ExitKind.ERROR, str(self._failure)).to_dict()

    def erlay_terminate(self) -> None:
        """Polite shutdown: end every stream with an abort chunk, then stop the decode loop."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(stream.seq.final_abort_chunk(self._version))
        self._streams.clear()
        self._pending.clear()
        if self._loop_task is not None:
            self._loop_task.cancel()

    # --------------------------------------------------------------------- submission
    def _submit(self, request: GenerationRequest,
                queue: asyncio.Queue[TokenChunk | BaseException] | None = None) -> _Stream:
        self._raise_if_failed()
        self._dormancy.refuse(request.request_id)
        validate_request(request, self.config.vocab_size, self.config.max_seq_len)
        if request.request_id in self._streams:
            raise InvalidRequest(f"request {request.request_id} is already being generated")
        if failpoints.keyed("generation.long_tail", str(request.seed)):
            # Chaos: this rollout's completion runs to the end of its budget (its stop tokens
            # ignored), on whichever engine continues it.
            request = dataclasses.replace(request, stop_ids=())
        stream = _Stream(Sequence(request)) if queue is None else \
            _Stream(Sequence(request), queue=queue)
        stream.timing = {"received": time.monotonic()}
        self.boot.mark("first_request")
        if request.trace:
            stream.span = telemetry.start_span(
                "engine.generate", parent=request.trace, request_id=request.request_id,
                prefix_tokens=len(request.prefix_ids), policy_version=self._version)
        self._streams[request.request_id] = stream
        self._counters.requests_submitted += 1
        if stream.seq.finished:  # resumed after its stop token: nothing left to generate
            self._publish(stream.seq)
            return stream
        self._pending.append(stream.seq)
        self._ensure_loop()
        self._wake.set()
        return stream

    def _abort(self, stream: _Stream) -> None:
        seq = stream.seq
        if seq in self._pending:
            self._pending.remove(seq)
            seq.finish(FinishReason.ABORT)
            self._kv_drop.append(seq)   # a slot of its own if a weight update requeued it
            self._publish(seq)
        else:
            # In the batch: a worker thread may be stepping it, so only the loop may finish it.
            seq.abort_requested = True
            self._wake.set()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    # --------------------------------------------------------------------- decode loop
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._decode_loop(), name="torch-engine-decode")

    async def _decode_loop(self) -> None:
        try:
            while True:
                if self._update is not None:
                    await self._apply_update()
                self._apply_aborts()
                if self._dormancy.asleep:
                    await self._doze()
                    continue
                if not self._batch.rows and not self._pending:
                    self._set_phase(None)
                    if self._update is None:
                        self._wake.clear()
                        await self._wake.wait()
                    continue
                await self._decode_step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # top-level loop: log, fail the requests, exit
            log.exception("torch engine decode loop failed")
            self._fail(exc)

    async def _decode_step(self) -> None:
        batch = self._batch
        room = self.max_batch - len(batch)
        admitted = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
        self._set_phase("decode_step", f"{len(batch) + len(admitted) + len(self._pending)} "
                                       "requests")
        await afailpoint("generation.decode_step")
        began = time.monotonic()
        if admitted:
            self.boot.mark("first_admitted")
            self._stamp(admitted, "admitted")
            await asyncio.to_thread(self._admit, admitted)
            self._stamp(admitted, "prefilled")
            self._counters.waves += 1
            self.progress.tick()
        rows = list(batch.rows)
        self._counters.max_batch_size = max(self._counters.max_batch_size, len(rows))
        k = drafts_for_step(self.spec_k, len(rows), self.spec_max_concurrency)
        before = sum(seq.generated for seq in rows)
        await asyncio.to_thread(self._step, k)
        self._decode_seconds += time.monotonic() - began
        made = sum(seq.generated for seq in rows) - before
        self._counters.decode_steps += 1
        self._counters.tokens_generated += made
        self._tail.step(len(rows), made, k)
        for seq in rows:
            if seq.finished:
                self._tail.finished(seq.generated)
        self.progress.tick()
        for seq in rows:
            self._publish(seq)

    def _admit(self, seqs: list[Sequence]) -> None:
        """Admit ``seqs`` to the batch (worker thread), from saved KV caches where a failed
        engine left them (:mod:`erlay.actors.engine.kv_saver`)."""
        handoff = self._handoff
        adopted = handoff.adopt(seqs, self._version) if handoff is not None else None
        self._batch.admit(seqs, adopted)
        if handoff is not None:
            handoff.save(self._batch, self._version, admitted=seqs)

    def _step(self, k: int) -> None:
        """One decode step (worker thread), then the KV hand-off's save of the requests
        whose chunks are due, before the loop streams them."""
        handoff = self._handoff
        if handoff is not None:
            # Freed one step late: a finished request's last chunk is streamed after this
            # step, and if the engine dies before its caller has it, the turn resumes here.
            for seq in self._kv_done:
                handoff.finished(seq)
        finished = self._batch.step(k, self.spec_verify,  # type: ignore[arg-type]
                                    self.spec_draft)
        if handoff is not None:
            self._kv_done = finished
            if self._batch.rows:
                handoff.save(self._batch, self._version)

    def _apply_aborts(self) -> None:
        if self._handoff is not None and self._kv_drop:
            for seq in self._kv_drop:
                self._handoff.finished(seq)
        self._kv_drop.clear()
        aborted = [s for s in self._batch.rows if s.abort_requested]
        if not aborted:
            return
        for seq in aborted:
            seq.finish(FinishReason.ABORT)
            if self._handoff is not None:
                self._handoff.finished(seq)
        self._batch.drop_finished()
        for seq in aborted:
            self._publish(seq)

    async def _doze(self) -> None:
        """The loop while asleep.  A sleep call waiting: release the batch (its requests,
        flushed, back to the head of the queue), free the device memory, answer the call.
        Then wait for a wake-up, a weight update or a new sleep call."""
        if self._dormancy.due:
            for seq in self._batch.rows:
                self._publish(seq, flush=True)
            self._pending.extendleft(reversed(self._batch.release()))
            self._batch.fed = None
            on_cuda = next(self.model.parameters()).is_cuda
            await asyncio.to_thread(free_device_cache, on_cuda)
            self._dormancy.released()
        self._set_phase(None)   # asleep is idle: no decode deadline runs
        if self._dormancy.asleep and self._update is None and not self._dormancy.due:
            self._wake.clear()
            await self._wake.wait()

    async def _apply_update(self) -> None:
        assert self._update is not None
        # Flush first: everything sampled so far belongs to the old version.
        for seq in self._batch.rows:
            self._publish(seq, flush=True)
        manifest, buffers = self._update
        version = manifest.version
        waiters, self._update_waiters = self._update_waiters, []
        self._update = None
        self._set_phase("weight_update", f"v{version}")
        try:
            await afailpoint("generation.weight_update")
            await asyncio.to_thread(self._copy_in, manifest, buffers)
        except BaseException as exc:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            raise
        self._version = version
        self._counters.weight_updates += 1
        self.boot.mark("first_weights")
        if self._handoff is not None:
            self._handoff.weights_loaded(version)
        # Prefill the running requests again under the new weights (module docstring).
        self._pending.extendleft(reversed(self._batch.release()))
        log.info("torch engine serves v%d", version)
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(version)

    def _copy_in(self, manifest: RefitManifest, buffers: list[np.ndarray]) -> None:
        """Phase 2 of a refit (worker thread): each fetched bucket into the parameters in
        place.  A failure here propagates to the decode loop, which fails the engine."""
        for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
            # Each chunk's pages handed back once copied: one chunk resident at a time.
            copy_bucket(self._targets, self._aliases, bucket, buffer, release=release_range)
            release_pages(buffer)   # the pages the chunks' edges shared

    def _publish(self, seq: Sequence, *, flush: bool = False) -> None:
        """Hand ``seq``'s due chunk to its stream; forget the stream once it finished."""
        chunk = seq.take_chunk(self._version, flush=flush)
        stream = self._streams.get(seq.request_id)
        if chunk is None or stream is None or stream.seq is not seq:
            return
        if stream.timing is not None:   # the request's first chunk
            chunk = dataclasses.replace(chunk, timing={**stream.timing,
                                                       "sent": time.monotonic()})
            stream.timing = None
        stream.queue.put_nowait(chunk)
        if chunk.finished:
            if stream.span is not None:
                stream.span.set_attribute("erlay.finish_reason", str(chunk.finish_reason))
                stream.span.set_attribute("erlay.tokens", seq.generated)
                stream.span.end()
            del self._streams[seq.request_id]
            if chunk.finish_reason == FinishReason.ABORT:
                self._counters.requests_aborted += 1
            else:
                self._counters.requests_finished += 1

    def _stamp(self, seqs: list[Sequence], event: str) -> None:
        """Record ``event`` in the timing of the requests not yet streamed (once: a
        re-admission after a weight update keeps the first)."""
        now = time.monotonic()
        for seq in seqs:
            stream = self._streams.get(seq.request_id)
            if stream is not None and stream.timing is not None:
                stream.timing.setdefault(event, now)

    def _set_phase(self, phase: str | None, work: str | None = None) -> None:
        # begin() bumps the counter, so only call it when the phase or the work changes.
        if phase is None:
            if self._phase is not None:
                self.progress.end()
            self._phase = None
        elif self._phase != (phase, work):
            self.progress.begin(phase, work)
            self._phase = (phase, work)

    def _fail(self, exc: BaseException) -> None:
        self._failure = EngineFailed(f"decode loop failed: {type(exc).__name__}: {exc}")
        for stream in self._streams.values():
            stream.queue.put_nowait(self._failure)
        self._streams.clear()
        self._pending.clear()
        for waiter in self._update_waiters:
            if not waiter.done():
                waiter.set_exception(self._failure)
        self._update_waiters = []
        self._dormancy.fail(self._failure)
        self._set_phase(None)
        self._failed.set()
