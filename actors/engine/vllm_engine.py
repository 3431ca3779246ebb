"""The ``vllm`` generation engine: vLLM's async engine as a supervised actor child.

Run it as ``ChildSpec("engine", ActorStart(VllmEngine, args=(model_config,), kwargs={...},
ready_timeout_s=...), deadlines={"decode_step": ...})``.  It implements
:class:`erlay.actors.engine.api.EngineProtocol`, like
:class:`erlay.actors.engine.torch_engine.TorchEngine`.

The model, always starting from the weights the learner starts from:

- **an HF model** (``model_config`` has ``hf``, see :mod:`erlay.actors.model.build`): vLLM
  serves that directory itself when it has weights and the job loads them (``init:
  pretrained``).  With ``init: random``, a directory without weights, or an
  ``initial_state``, the engine builds the same seeded policy the learner builds and serves
  it from a staged copy (:func:`erlay.actors.model.export.write_served_dir`).  Weight updates
  carry the HF model's own names (``HFPolicy.engine_state``: LoRA merged in), which vLLM's
  ``load_weights`` takes as they are; erlay's ``mtp.*`` draft heads are dropped.
- **the built-in model**: erlay's policy, written as a Hugging Face GPT-2 directory (see
  :mod:`erlay.actors.model.hf_export`) from ``initial_state`` or from the same seeded
  initialisation the learner uses; its weight updates are renamed to GPT-2's names.
  ``model_dir`` serves an existing GPT-2 directory instead (the built-in model only).

Prompts are token ids (``skip_tokenizer_init``): erlay tokenizes.  ``speculative_config`` is
vLLM's, passed through as it is: n-gram drafting, or an architecture's native MTP layers
(``{"method": "mtp", ...}`` for DeepSeek-V3, Qwen3-Next, ...), which vLLM loads from the
served directory; weight updates do not reach those layers (the learner's HF model has none),
so their drafts age as the policy trains, which costs acceptance, never correctness.

Contracts (beyond :mod:`erlay.actors.engine.api`):

- **Processes.**  ``erlay_ready`` makes the actor the leader of its own process group before
  vLLM spawns its EngineCore and workers, which inherit the group, the declared environment
  and the host token (:class:`erlay.supervisor.procs.OwnGroup`).  ``erlay_terminate`` shuts vLLM
  down and kills whatever is left of the group; if the actor is killed instead, the reaper
  kills the group.  Nothing outlives the child.
- **Sampling.**  Each request is sampled with vLLM's per-request seed, derived from the
  request's ``seed`` and the completion position it starts at.  Behaviour logprobs are vLLM's
  ``processed_logprobs`` (after temperature): the distribution sampled from, which is what the
  learner scores.  Stopping follows ``stop_ids`` only (``ignore_eos``), and the stop token is
  part of the output, as in the torch engine.
- **Weight updates** go through vLLM's worker-extension route: the state is checked against
  the served shapes, staged as a safetensors file on the node (``/dev/shm`` where present),
  and loaded in place by :class:`erlay.actors.engine.vllm_worker.ErlayWorkerExtension` through
  ``collective_rpc``.  While it loads, running requests are cut (their tokens so far are
  flushed, tagged with the old version) and continued from their prefix under the new
  version, so no chunk mixes versions; the prefix cache is reset, since it holds keys and
  values of the old weights.
- **Resumption is not token-identical.**  vLLM gives no (rollout, position)-seeded sampling,
  so a continuation from a prefix samples different tokens than an uninterrupted run would,
  though from the same distribution.  The rollout journal records where each continuation
  began (``continued_at`` on its first chunk).
- **Hangs** are seen through decode progress: one tick per output vLLM streams back.  A wedged
  EngineCore stops the ticks and the supervisor's ``decode_step`` deadline fires; vLLM's own
  health check is not consulted.
- **Failure.**  If the EngineCore dies, every held request fails with
  :class:`~erlay.actors.engine.api.EngineFailed` and ``erlay_wait`` returns an error exit, so the
  supervisor restarts the engine.  Every call into vLLM has a timeout (``rpc_timeout_s``); a
  start that fails or runs past ``ready_timeout_s`` is a start failure, which counts against
  the restart intensity.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from erlay.actors.engine import staging, vllm_cpu
from erlay.actors.engine.api import (
    EngineAsleep,
    EngineFailed,
    EngineStats,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    TokenChunk,
    drain_chunks,
)
from erlay.actors.engine.boot import BootTimeline, process_started
from erlay.actors.engine.core import validate_request
from erlay.actors.engine.core_watch import ExitWatch, core_processes, engine_core_pid
from erlay.actors.engine.dormancy import Dormancy, wake_tags
from erlay.actors.engine.vllm_served import engine_kwargs, prepare_builtin, prepare_hf
from erlay.actors.engine.vllm_warmup import warm_up
from erlay.actors.model.build import is_hf
from erlay.supervisor.procs import OwnGroup
from erlay.supervisor.progress import Progress
from erlay.supervisor.reason import ExitKind, ExitReason

if TYPE_CHECKING:
    from erlay.actors.model.refit import Refit

log = logging.getLogger("erlay.engine")

def segment_seed(seed: int, start: int) -> int:
    """vLLM's seed for a request that samples from completion position ``start`` on."""
    return zlib.crc32(f"{seed}:{start}".encode()) & 0x7FFFFFFF


@dataclass
class _Request:
    """One protocol request and the vLLM requests ("segments") that serve it in turn."""

    request: GenerationRequest
    queue: asyncio.Queue[TokenChunk | BaseException]
    generated: list[int] = field(default_factory=list)     # beyond prefix_ids
    segment: str | None = None                              # the vLLM request id now
    cut: bool = False                                       # cut by a weight update
    aborted: bool = False                                   # aborted by a caller
    done: bool = False
    prefill_unreported: int = 0   # prefilled, not yet on a chunk (TokenChunk.prefill_tokens)
    timing: dict[str, float] | None = None   # TokenChunk.timing, until the first chunk


class VllmEngine:
    """Async Ray actor class run by the supervisor as an ActorStart child (see the module
    docstring).  The constructor only records the configuration; vLLM starts in
    ``erlay_ready``, so a failed start is a start failure the supervisor counts."""

    def __init__(self, model_config: dict[str, Any], *, max_batch: int = 64,
                 initial_state: dict[str, Any] | None = None, version: int = 0,
                 seed: int = 0, model_dir: str | None = None,
                 speculative_config: dict[str, Any] | None = None,
                 engine_args: dict[str, Any] | None = None, rpc_timeout_s: float = 60.0,
                 torch_threads: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        # BootTimeline: this module imports nothing heavy (vLLM is imported by its engine's
        # start, counted in model_built), so its imports are marked as taking no time.
        self.boot = BootTimeline()
        if (started := process_started()) is not None:
            self.boot.mark("process_started", started)
        for stage in ("imports_started", "imports_done", "init_started"):
            self.boot.mark(stage)
        self.model_config = dict(model_config)
        self._hf = is_hf(self.model_config)
        if self._hf and model_dir is not None:
            raise ValueError("model_dir serves the built-in model's GPT-2 directory; an HF "
                             "model is served from its own directory (model.hf)")
        self._vocab = 0   # known once started
        self.max_batch = max_batch
        self.seed = seed
        self.model_dir = model_dir
        self.speculative_config = speculative_config
        self.engine_args = dict(engine_args or {})
        self.rpc_timeout_s = rpc_timeout_s
        self.torch_threads = torch_threads
        self._initial_state = initial_state
        self._version = int(version)
        self.progress = Progress()
        self.group = OwnGroup()
        self._llm: Any = None
        self._stage: str | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._optional: frozenset[str] = frozenset()   # tied names a refit sends once
        self._requests: dict[str, _Request] = {}
        self._open = asyncio.Event()      # closed while weights load
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._dormancy = Dormancy()       # colocated placement: sleep / wake_up
        self._awake = asyncio.Event()     # cleared while asleep: held requests wait
        self._awake.set()
        self._refit_mark: int | None = None   # weight_updates at a level-2 sleep
        self._failed = asyncio.Event()
        self._failure: EngineFailed | None = None
        self._watch: asyncio.Task[None] | None = None
        self._core_watch: ExitWatch | None = None
        self._segments = 0
        self._greedy_only = False
        self._on_cpu = False
        self._kv_sized_by_user = False
        self._counters = {"tokens_generated": 0, "requests_submitted": 0,
                          "requests_finished": 0, "requests_aborted": 0, "waves": 0,
                          "decode_steps": 0, "weight_updates": 0, "max_batch_size": 0}

    # ------------------------------------------------------------------ supervisor hooks
    async def erlay_ready(self) -> None:
        """Start vLLM in this actor's own process group; raises if it cannot start."""
        if self._llm is not None:
            return
        self.group.adopt()
        if self.torch_threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(self.torch_threads))
        # Defaults for a node the engine shares (set them in node.env to change them): a
        # small CPU KV cache (vllm_cpu); no pinning of OpenMP threads, which vLLM would put
        # on core 0 for every engine of the node; vLLM's own sockets on loopback, since its
        # processes all run on this node.
        self._kv_sized_by_user = vllm_cpu.set_kv_env_default()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self._on_cpu = on_cpu = await asyncio.to_thread(vllm_cpu.on_cpu)
        if on_cpu:
            # vLLM torch.compiles small sampler helpers on first use: on CPU that is 5-15 s of
            # inductor and g++ in every engine start (its cache does not apply), for kernels
            # that are cheap eager at CPU batch sizes.  Eager on CPU; GPUs keep the compile,
            # done by the warm-up below.
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        # Named after this process: the next engine to start on the node removes it if this
        # one dies too hard to run erlay_terminate (staging).  In a thread: removing a dead
        # engine's model copy can take a while, and this loop answers the supervisor.
        await asyncio.to_thread(staging.sweep)
        self._stage = tempfile.mkdtemp(prefix=staging.owner_prefix(),
                                       dir=staging.staging_root())
        where = os.path.join(self._stage, "model")
        if self._hf:
            served = await asyncio.to_thread(prepare_hf, self.model_config, seed=self.seed,
                                             initial_state=self._initial_state, stage=where)
        else:
            served = await asyncio.to_thread(prepare_builtin, self.model_config,
                                             seed=self.seed, stage=where,
                                             initial_state=self._initial_state,
                                             model_dir=self.model_dir)
        self._shapes, self._vocab, self._optional = served.shapes, served.vocab, served.optional
        self._llm = await asyncio.to_thread(self._start_vllm, served.path)
        self.boot.mark("model_built")
        loop = asyncio.get_running_loop()
        # The EngineCore's exit fails every stream on the loop's next turn (core_watch);
        # the poll below stays for a vLLM that does not expose its processes.
        self._core_watch = ExitWatch(loop, core_processes(self._llm), self._core_exited)
        self._watch = loop.create_task(self._watch_engine(), name="vllm-watch")
        # vllm-cpu 0.32.0's speculative decoding samples from a corrupted distribution at
        # temperature > 0 (its CPU expand kernel leaves the rejection sampler's per-token
        # temperatures uninitialised); greedy speculation is correct.  Refuse, not degrade.
        self._greedy_only = bool(self.speculative_config) and on_cpu
        # Before the supervisor sees it ready: vLLM compiles its sampler on the first batch
        # (seconds), which would stall the rollouts a restarted engine takes over.
        began = time.monotonic()
        await warm_up(self._llm, self._vocab, greedy=self._greedy_only)
        log.info("vLLM engine warmed up in %.1f s", time.monotonic() - began)
        self.boot.mark("warmed")
        # vLLM, torch and the model make a heap of ~700k long-lived objects, and each full
        # collection walks all of them: a pause of 0.5-1 s of this event loop (which serves
        # every stream, and the heartbeat) whenever streaming's garbage triggers one.
        # Frozen, they are skipped (vLLM's API server does the same after its start).
        gc.collect()
        gc.freeze()

    async def erlay_wait(self) -> dict[str, Any]:
        """Returns (an error exit) once vLLM's engine has died."""
        await self._failed.wait()
        return ExitReason(ExitKind.ERROR, str(self._failure)).to_dict()

    async def erlay_terminate(self) -> None:
        """End every stream with an abort, shut vLLM down, kill what is left of the group."""
        for req in list(self._requests.values()):
            if not req.done:
                req.done = True
                req.queue.put_nowait(self._final(req, FinishReason.ABORT))
        if self._watch is not None:
            self._watch.cancel()
        if self._core_watch is not None:
            self._core_watch.close()   # the shutdown below ends the EngineCore on purpose
        if self._llm is not None:
            # Briefly, so vLLM can release its shared-memory queues; the supervisor's shutdown
            # timeout (15 s in the job) must cover it, and the group kill below is the
            # guarantee either way.
            try:
                await asyncio.wait_for(asyncio.to_thread(self._llm.shutdown, 3.0), 5.0)
            except Exception:
                log.warning("vLLM did not shut down cleanly", exc_info=True)
        self.group.kill_members()
        if self._stage:
            shutil.rmtree(self._stage, ignore_errors=True)

    # ----------------------------------------------------------------------- protocol
    async def generate(self, request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Stream TokenChunk dicts for one GenerationRequest dict (see EngineProtocol)."""
        async for items in self.generate_many([request]):
            for item in items:
                yield item

    async def generate_many(self, requests: list[dict[str, Any]]
                            ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """Stream the chunks of many requests through one call (see TorchEngine's)."""
        parsed = [GenerationRequest.from_dict(r) for r in requests]
        for request in parsed:
            self._validate(request)
        shared: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        reqs = [self._submit(request, shared) for request in parsed]
        tasks = [asyncio.create_task(self._serve(req)) for req in reqs]
        try:
            async for out in drain_chunks(shared, len(reqs)):
                yield out
        finally:
            for req in reqs:
                if not req.done:
                    await self._abort(req)
            for task in tasks:
                task.cancel()
            for req in reqs:
                self._requests.pop(req.request.request_id, None)
            self._set_phase()

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id``; its stream ends with ``finish_reason="abort"``."""
        req = self._requests.get(request_id)
        if req is None or req.done:
            return False
        await self._abort(req)
        return True

    async def update_weights(self, refit: Refit) -> int:
        """Serve ``refit`` (HF names for an HF model, LoRA merged in; erlay's for the built-in
        one) as its version; returns the version served.

        Checked first; then each bucket is fetched (under ``rpc_timeout_s``) and staged as a
        safetensors file in the serving dtype, one bucket in memory at a time, while the
        engine still serves; only once every bucket is staged are running requests cut and
        the files loaded in one ``reload_weights``.  A failed fetch (RefitUnavailable) leaves
        the served model and its version untouched."""
        from erlay.actors.engine.refit_load import check_refs, fetch_bucket, release_pages
        from erlay.actors.model.refit import check_shapes  # torch: not at import (boot)

        self._raise_if_failed()
        version = refit.version
        check_refs(refit)
        check_shapes(self._shapes, refit.manifest, optional=self._optional,
                     ignored=("mtp.",))   # erlay's draft heads: not served
        async with self._update_lock:
            self.progress.begin("weight_update", work=f"v{version}")
            paths: list[str] = []
            try:
                for i, bucket in enumerate(refit.manifest.buckets):
                    buffer = await fetch_bucket(refit, i, self.rpc_timeout_s)
                    path = os.path.join(self._stage or staging.staging_root(),
                                        f"weights-v{version}-{i}.st")
                    if await asyncio.to_thread(staging.stage_bucket, path, bucket, buffer,
                                               self._hf):
                        paths.append(path)
                    release_pages(buffer)   # staged: its pages leave this process (refit_load)
                    del buffer
                self._open.clear()
                cut = [r for r in self._requests.values() if r.segment and not r.done]
                for req in cut:
                    req.cut = True
                if cut:
                    await self._rpc(self._llm.abort([r.segment for r in cut]), "abort")
                await self._rpc(self._llm.collective_rpc(
                    "erlay_load_weights", args=(paths,), timeout=self.rpc_timeout_s),
                    "weight load")
                await self._rpc(self._llm.reset_prefix_cache(), "prefix cache reset")
                if version < self._version:
                    log.warning("weights v%d replace newer v%d", version, self._version)
                self._version = int(version)
                self._counters["weight_updates"] += 1
                self.boot.mark("first_weights")
            finally:
                for path in paths:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                self._open.set()
                self._set_phase()
        return self._version

    async def version(self) -> int:
        return self._version

    async def boot_timeline(self) -> dict[str, float]:
        """This process's :class:`~erlay.actors.engine.boot.BootTimeline` marks so far (no
        ``first_admitted``: vLLM schedules the requests itself)."""
        return self.boot.to_dict()

    async def stats(self) -> dict[str, Any]:
        c = self._counters
        running = sum(1 for r in self._requests.values() if r.segment and not r.done)
        return EngineStats(
            version=self._version, running=running,
            pending=sum(1 for r in self._requests.values() if not r.done) - running,
            max_batch=self.max_batch,
            mean_batch_size=round(c["tokens_generated"] / c["decode_steps"], 3)
            if c["decode_steps"] else 0.0, sleeps=self._dormancy.sleeps,
            wakes=self._dormancy.wakes, **c).to_dict()

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """EngineProtocol.sleep through vLLM's sleep mode (a colocated job starts its
        engines with ``enable_sleep_mode``; CUDA only): ``level`` 1 offloads the weights to
        host memory and drops the KV cache, 2 drops both.  At 2 the engine refuses requests
        until a refit lands, since its weights are garbage until then.  Held requests are
        cut as a refit cuts them and continue from their prefix after the wake."""
        self._raise_if_failed()
        if self._dormancy.asleep:
            return self._dormancy.report()
        self._dormancy.fall_asleep(level)
        self._awake.clear()
        self._set_phase()   # asleep is idle: no decode deadline
        cut = [r for r in self._requests.values() if r.segment and not r.done]
        for req in cut:
            req.cut = True
        try:
            if cut:
                await self._rpc(self._llm.abort([r.segment for r in cut]), "abort")
            await self._rpc(self._llm.sleep(level), f"sleep (level {level})")
        except BaseException:
            self._dormancy.wake(wake_tags(None))   # still awake: serve on
            self._awake.set()
            raise
        finally:
            self._dormancy.released()
        if level == 2:
            self._refit_mark = self._counters["weight_updates"]
        return self._dormancy.report()

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """EngineProtocol.wake_up through vLLM's: ``["weights"]`` before a refit (at level
        2 their memory comes back empty for it), ``["kv_cache"]`` after; then it serves."""
        self._raise_if_failed()
        wanted = wake_tags(tags)
        if self._dormancy.asleep:
            await self._rpc(self._llm.wake_up(sorted(wanted)), "wake-up")
        if self._dormancy.wake(wanted):
            self._awake.set()
            self._set_phase()
        return self._dormancy.report()

    async def processes(self, keys: list[str] | None = None) -> dict[str, Any]:
        """This actor's pid and process group, and vLLM's worker processes with theirs and
        the named environment variables (a diagnostic; how tests find the EngineCore)."""
        self._raise_if_failed()
        workers = list(await self._rpc(self._llm.collective_rpc(
            "erlay_process", args=(list(keys or []),), timeout=self.rpc_timeout_s), "probe"))
        return {"pid": os.getpid(), "pgid": os.getpgid(0), "workers": workers,
                "engine_core": engine_core_pid(workers)}

    async def group_members(self) -> list[int]:
        """Every other live process of this child's group: what a stop would kill."""
        return self.group.members()

    # ----------------------------------------------------------------------- internals
    def _start_vllm(self, model_dir: str) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = engine_kwargs(self.model_config, model_dir, max_batch=self.max_batch,
                               seed=self.seed, speculative_config=self.speculative_config,
                               engine_args=self.engine_args, on_cpu=self._on_cpu,
                               kv_sized_by_user=self._kv_sized_by_user)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def _validate(self, request: GenerationRequest) -> None:
        self._raise_if_failed()
        self._dormancy.refuse(request.request_id)
        if self._refit_mark is not None:
            if self._refit_mark == self._counters["weight_updates"]:
                raise EngineAsleep(f"request {request.request_id}: the weights were dropped "
                                   "at sleep level 2 and no refit has replaced them yet")
            self._refit_mark = None
        validate_request(request, self._vocab,
                         int(self.model_config.get("max_seq_len", 96)))
        if request.request_id in self._requests:
            raise InvalidRequest(f"request {request.request_id} is already being generated")
        if self._greedy_only and request.temperature > 0:
            raise InvalidRequest(
                f"request {request.request_id}: temperature {request.temperature} with "
                "speculative decoding on vllm-cpu, whose speculative sampler is broken at "
                "temperature > 0 (README, 'Generation on vLLM'); use temperature 0 or turn "
                "engine.vllm.speculative_config off")

    def _submit(self, request: GenerationRequest,
                queue: asyncio.Queue[TokenChunk | BaseException]) -> _Request:
        req = _Request(request, queue, timing={"received": time.monotonic()})
        self._requests[request.request_id] = req
        self._counters["requests_submitted"] += 1
        self.boot.mark("first_request")
        return req

    async def _serve(self, req: _Request) -> None:
        """Run ``req`` as one or more vLLM requests until it finishes; put its chunks."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        r = req.request
        try:
            if r.prefix_ids and r.prefix_ids[-1] in r.stop_ids:
                req.done = True   # resumed after its stop token: nothing left to generate
                req.queue.put_nowait(self._final(req, FinishReason.STOP))
                return
            while not req.done:
                await self._open.wait()
                await self._awake.wait()
                version = self._version
                start = len(r.prefix_ids) + len(req.generated)
                self._segments += 1
                req.segment, req.cut = f"{r.request_id}#{self._segments}", False
                params = SamplingParams(
                    max_tokens=r.max_new_tokens - len(req.generated),
                    temperature=r.temperature, seed=segment_seed(r.seed, start), logprobs=0,
                    stop_token_ids=list(r.stop_ids), ignore_eos=True, detokenize=False,
                    skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
                context = list(r.context_ids) + req.generated
                prompt = TokensPrompt(prompt_token_ids=context)
                self._counters["waves"] += 1
                self._set_phase()
                if req.timing is not None:
                    req.timing.setdefault("admitted", time.monotonic())
                tokens: list[int] = []
                logprobs: list[float] = []
                reason: str | None = None
                first = True
                async for out in self._llm.generate(prompt, params, req.segment):
                    self.progress.tick()
                    if first:   # the segment's prefill is done: what it computed, vLLM says
                        first = False
                        if req.timing is not None:
                            req.timing.setdefault("prefilled", time.monotonic())
                        req.prefill_unreported += len(context) - int(out.num_cached_tokens or 0)
                    self._counters["decode_steps"] += 1
                    completion = out.outputs[0]
                    for tid, lps in zip(completion.token_ids, completion.logprobs or (),
                                        strict=False):
                        tokens.append(int(tid))
                        logprobs.append(float(lps[tid].logprob))
                    if out.finished:
                        reason = completion.finish_reason
                    elif len(tokens) >= r.chunk_tokens:
                        self._emit(req, tokens, logprobs, version)
                        tokens, logprobs = [], []
                if reason == "abort" and req.cut and not req.aborted:
                    self._emit(req, tokens, logprobs, version)    # continue under new weights
                    continue
                finish = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(
                    str(reason), FinishReason.ABORT)
                self._emit(req, tokens, logprobs, version, finish)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine is dead or the request failed
            failure = self._engine_failure(exc)
            req.done = True
            req.queue.put_nowait(failure)
        finally:
            req.segment = None

    def _emit(self, req: _Request, tokens: list[int], logprobs: list[float], version: int,
              finish: FinishReason | None = None) -> None:
        if not tokens and finish is None:
            return
        start = len(req.request.prefix_ids) + len(req.generated)
        req.generated += tokens
        self._counters["tokens_generated"] += len(tokens)
        if finish is not None:
            req.done = True
            key = "requests_aborted" if finish is FinishReason.ABORT else "requests_finished"
            self._counters[key] += 1
        req.queue.put_nowait(TokenChunk(req.request.request_id, start, tuple(tokens),
                                        tuple(logprobs), version, finish is not None,
                                        None if finish is None else str(finish),
                                        prefill_tokens=req.prefill_unreported,
                                        timing=self._timing(req)))
        req.prefill_unreported = 0

    def _final(self, req: _Request, finish: FinishReason) -> TokenChunk:
        start = len(req.request.prefix_ids) + len(req.generated)
        prefill, req.prefill_unreported = req.prefill_unreported, 0
        return TokenChunk(req.request.request_id, start, (), (), self._version, True,
                          str(finish), prefill_tokens=prefill, timing=self._timing(req))

    @staticmethod
    def _timing(req: _Request) -> dict[str, float] | None:
        """The request's TokenChunk.timing for its first chunk, None for the rest."""
        if req.timing is None:
            return None
        timing, req.timing = {**req.timing, "sent": time.monotonic()}, None
        return timing

    async def _abort(self, req: _Request) -> None:
        req.aborted = True
        if req.segment is not None:
            await self._rpc(self._llm.abort(req.segment), "abort")
        elif not req.done:   # waiting for a weight update: end it here
            req.done = True
            self._counters["requests_aborted"] += 1
            req.queue.put_nowait(self._final(req, FinishReason.ABORT))

    async def _rpc(self, call: Any, what: str) -> Any:
        """Await a call into vLLM.  Once vLLM's engine has died, any failure of it is
        :class:`EngineFailed` (the engine fails, as when a stream finds it dead), so a caller
        such as a weight push sees a gone engine, not vLLM's own error."""
        try:
            return await asyncio.wait_for(call, self.rpc_timeout_s)
        except TimeoutError:
            raise self._fail(EngineFailed(f"vLLM {what} did not answer within "
                                          f"{self.rpc_timeout_s:g} s")) from None
        except Exception as exc:
            failure = self._engine_failure(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _engine_failure(self, exc: BaseException) -> BaseException:
        if self._llm is not None and self._llm.errored:
            return self._fail(EngineFailed(f"vLLM's engine died: {exc}"))
        return exc

    def _fail(self, failure: EngineFailed) -> EngineFailed:
        if self._failure is None:
            failure.failed_at = time.monotonic()
            self._failure = failure
            log.error("%s", failure)
            for req in self._requests.values():
                if not req.done:
                    req.done = True
                    req.queue.put_nowait(failure)
            self._failed.set()
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _core_exited(self) -> None:
        self._fail(EngineFailed("vLLM's EngineCore process exited"))
        # Its workers outlive it (on CPU they run on until the supervisor's terminate, about
        # a second here) and take the CPU the engines that serve the failed-over rollouts
        # need: nothing in the group can serve again, so end them now.
        self.group.kill_members()

    async def _watch_engine(self) -> None:
        """Notice an EngineCore death while no request is open (vLLM marks itself errored
        when its engine process goes away)."""
        while self._failure is None:
            if self._llm.errored:
                self._fail(EngineFailed(f"vLLM's engine died: {self._llm.dead_error}"))
                return
            await asyncio.sleep(0.5)

    def _set_phase(self) -> None:
        if self._update_lock.locked():
            return
        # Asleep is idle: a held request waits for the wake-up, under no decode deadline.
        active = 0 if self._dormancy.asleep else sum(1 for r in self._requests.values()
                                                     if not r.done)
        self._counters["max_batch_size"] = max(self._counters["max_batch_size"], active)
        if active:
            self.progress.begin("decode_step", work=f"{active} requests")
        else:
            self.progress.end()
