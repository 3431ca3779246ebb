"""The GPU lane: three figures on one accelerator, in-process per phase, without Ray.

``bench/gpu/run.sh`` runs this on the device machine (Python 3.12, torch with CUDA,
transformers; no Ray, no vLLM, no network); ``--device cpu --size tiny`` checks it here.
Each phase runs in a subprocess of its own with its own time budget, all under one global
deadline, so a phase that hangs or crashes (a CUDA error poisons its process) costs only its
own figures: it is recorded as ``null`` with its error, listed in ``failures``, and the exit
status is 1.  The phases, and what each figure measures (from what event to what event):

- ``mtp``: the built-in engine's multi-token-prediction speedup.  A built-in policy with MTP
  heads is warm-started (``LearnerCore.sft``, MTP loss on) on a counting language whose
  completions are predictable, then one heavy-tailed batch is decoded with the engine's
  batching core (:class:`~erlay.actors.engine.core.DecodeBatch`, continuous batching, KV
  cache, temperature 1, the engine's default argmax drafts), with k drafts per step while at
  most ``spec_max_concurrency`` requests run (0, the engine's default: at every width).
  ``wall_s`` per k: first admission until the last request finished, the median of
  ``repeats`` decodes interleaved over k.  ``speedup`` = wall at k=0 / wall at
  ``best_k``; ``acceptance`` = accepted / drafted drafts; ``greedy_identical``: greedy
  decoding gives the same tokens at ``best_k`` as at k=0.
- ``checkpoint``: the device-to-host exposed ratio of an asynchronous checkpoint, on
  nvidia-resiliency-ext's persistent worker (:class:`~erlay.actors.learner.checkpoint.
  AsyncCheckpointer`).  The state lives on the device (float32 tensors, ``state_mb``).
  ``exposed_s``: ``save()`` called until ``wait_snapshot()`` returns, called at once (the
  background copy to host with no compute to overlap it, the worst case; the worker
  already running, the previous save committed); ``sync_s``: ``torch.save`` of the
  same device state to a file, call until ``fsync`` returns; ``exposed_ratio`` = median
  exposed / median sync; ``persist_s``: ``save()`` called until ``wait()`` returns (written,
  fsynced, committed); ``restored``: the latest checkpoint loads with checksums verified and
  equals the state.
- ``learner``: learner step throughput of a real architecture, Qwen2 shaped like
  Qwen2-0.5B (``--size 0.5b``; ``tiny`` on CPU), initialised randomly from its config (no
  download), GRPO steps of :class:`~erlay.actors.learner.core.LearnerCore` on a synthetic
  batch.  ``step_s``: a train step, call until it returns with the device synchronised,
  median of the steps after the first (the first is ``first_step_s``); ``tokens_per_s`` =
  the batch's tokens / ``step_s``.  ``shipped``: the second of two steps at the shipped
  0.5B config's minibatch (64 rows of 256 + 512 tokens) under the learner's defaults
  (``micro_batch_tokens`` 16,384, precision bf16-mixed on a GPU): ``peak_gib``
  (``torch.cuda.max_memory_allocated``, reset at the step's start) and ``tokens_per_s``.
- ``colocated``: a learner rank and an engine on one device, in one process (the memory
  hand-off of ``placement.colocate``, docs/scaling.md): the same Qwen2 shape as ``learner``,
  a :class:`~erlay.actors.learner.core.LearnerCore` and an engine-side policy decoding with
  :class:`~erlay.actors.engine.core.DecodeBatch`.  In turn: ``generate`` (half the tokens of
  a batch, its KV cache held), ``free`` (the batch released and the allocator's cache
  emptied, as a sleeping torch engine does), ``train`` (one GRPO step), ``refit`` (the
  learner's weights copied into the engine's parameters in place) and ``generate_again``
  (the released requests prefilled again and finished).  Per stage: ``peak_gib``
  (``torch.cuda.max_memory_allocated``, its peak reset at the stage's start) and
  ``allocated_gib`` after it; ``kv_cache_gib``: what ``free`` handed back.  CUDA only
  figures; on the CPU the memory is null and the stages still run.

Writes one JSON object to ``--out`` (default ``$OUT/gpu_lane.json`` when ``$OUT`` is set,
else ``bench/gpu/out/gpu_lane.json``) and prints the same JSON as the last stdout line.

    python bench/gpu/lane.py                                # CUDA
    python bench/gpu/lane.py --device cpu --size tiny       # the CPU check
    python bench/gpu/lane.py --smoke                        # CI's smoke run: the CPU check
    python bench/gpu/lane.py --phases checkpoint --plant-failure checkpoint   # must fail
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = ("mtp", "checkpoint", "learner", "colocated")
# Seconds per phase, a ceiling (each phase also stops at the global deadline).  They add up
# to less than the deadline: every phase pays its own start (torch, transformers, erlay).
BUDGET_S = {"mtp": 80.0, "checkpoint": 60.0, "learner": 110.0, "colocated": 60.0}
DEADLINE_S = 270.0              # the whole lane; run.sh allows 290 s with the wheels' install
ABSENT = ("ray", "vllm")        # not on the device machine: hidden here too
SITE_ENV = "ERLAY_LANE_SITE"    # where run.sh installed the shipped wheels
PLANT_ENV = "ERLAY_LANE_PLANT"  # a phase that must fail (the lane's own failure check)


# The wheels run.sh installs (bench/gpu/fetch_wheels.sh downloads exactly these), with the
# top-level module each provides: what erlay's lane imports that torch and transformers do
# not bring.  nvidia-resiliency-ext imports psutil and pynvml (from nvidia-ml-py), and
# defusedxml; pydantic (with its three) is erlay's config model, small enough to carry.
# megatron-core is not here: nothing the lane runs imports it (NVRx only names it in a comment).
WHEELS = {"nvidia-resiliency-ext==0.4.1": "nvidia_resiliency_ext", "psutil==7.2.2": "psutil",
          "nvidia-ml-py==13.615.71": "pynvml", "defusedxml==0.7.1": "defusedxml",
          "pydantic==2.14.4": "pydantic", "pydantic-core==2.50.5": "pydantic_core",
          "annotated-types==0.8.0": "annotated_types",
          "typing-inspection==0.4.5": "typing_inspection"}
# What the device machine has besides the standard library: torch (CUDA) and transformers,
# with what they require.  ERLAY_LANE_ALLOW=base hides every other module here, so a CPU run
# proves the lane needs nothing more than this and WHEELS.
DEVICE_BASE = (
    "torch", "torchgen", "functorch", "triton", "nvidia", "cuda", "filelock",
    "typing_extensions", "setuptools", "pkg_resources", "_distutils_hack", "sympy", "mpmath",
    "networkx", "jinja2", "markupsafe", "fsspec", "transformers", "huggingface_hub", "hf_xet",
    "httpx", "httpcore", "httpx2", "httpcore2", "h11", "anyio", "sniffio", "certifi", "idna",
    "truststore", "packaging", "yaml", "tqdm", "numpy", "regex", "safetensors", "tokenizers",
    "typer", "click", "shellingham", "rich", "markdown_it", "mdurl", "pygments",
    "annotated_doc", "requests", "urllib3", "charset_normalizer")
ALLOW_ENV = "ERLAY_LANE_ALLOW"   # "base": DEVICE_BASE and WHEELS only; "base-minus:a,b": less


class HideModules(importlib.abc.MetaPathFinder):
    """Makes modules look absent, as on a machine without them: ``find_spec`` answers None
    for a hidden top-level name (so ``import`` raises ModuleNotFoundError and availability
    checks such as ``importlib.util.find_spec`` say no), and asks the finders it took over
    for every other name."""

    def __init__(self, finders: list[Any], hidden: Callable[[str], bool]) -> None:
        self.finders = finders
        self.hidden = hidden

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if self.hidden(fullname.partition(".")[0]):
            return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args: Any, **kwargs: Any) -> Any:
        """Package metadata (importlib.metadata) as before: only modules are hidden."""
        for finder in self.finders:
            find = getattr(finder, "find_distributions", None)
            if find is not None:
                yield from find(*args, **kwargs)

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def hidden_rule(allow: str | None) -> Callable[[str], bool]:
    """Which top-level names to hide: Ray and vLLM always (the device machine has neither);
    with ``allow`` = ``base``, everything outside the standard library, DEVICE_BASE, WHEELS
    and the lane's own modules; ``base-minus:a,b`` hides a and b as well (a planted gap)."""
    if not allow:
        return lambda name: name in ABSENT
    if allow != "base" and not allow.startswith("base-minus:"):
        raise ValueError(f"{ALLOW_ENV} must be 'base' or 'base-minus:a,b', not {allow!r}")
    minus = set(allow.partition(":")[2].split(",")) - {""}
    ok = (set(sys.stdlib_module_names) | set(DEVICE_BASE) | set(WHEELS.values())
          | {"erlay", "hf_smoke", "lane", "__main__"}) - minus - set(ABSENT)
    # Private names (_sysconfigdata_*, _yaml, C helpers) stay visible: they come with what
    # imports them.
    return lambda name: name not in ok and not name.startswith("_")


def prepare_imports() -> None:
    """Hide Ray and vLLM (and, under ``ERLAY_LANE_ALLOW``, all the device machine lacks);
    append the shipped wheels' directory (after site-packages, so the machine's own copy of
    a package wins); make ``erlay`` importable from the tree."""
    if not any(isinstance(f, HideModules) for f in sys.meta_path):
        sys.meta_path[:] = [HideModules(list(sys.meta_path),
                                        hidden_rule(os.environ.get(ALLOW_ENV)))]
    site = os.environ.get(SITE_ENV)
    if site and site not in sys.path:
        sys.path.append(site)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import hf_smoke
    hf_smoke.import_erlay()


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def spread(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "runs": len(values)}


# ------------------------------------------------------------------------------ mtp
# The counting language: prompt = (BOS, start, length bucket), completion counts up from
# start; predictable, so MTP drafts get accepted once the heads have learnt it.
EOS, FIRST, VOCAB, MAX_LEN = 2, 4, 40, 96
MTP_SHAPES = {"gpu": dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024, batch=64,
                          train_steps=300, max_k=4, repeats=3, spec_max_concurrency=0),
              "tiny": dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, batch=8,
                           train_steps=20, max_k=2, repeats=2, spec_max_concurrency=4)}


def counting_example(rng: Any, length: int) -> tuple[list[int], list[int]]:
    start = rng.randrange(FIRST, VOCAB)
    prompt = [1, start, FIRST + min(length // 3, 35)]
    length = 3 * (length // 3) + start % 3
    body = [FIRST + (start - FIRST + i + 1) % (VOCAB - FIRST) for i in range(max(length, 1))]
    return prompt, [*body, EOS]


def heavy_tailed(rng: Any, n: int) -> list[int]:
    """85% short completions, 15% long: the batch's wall is set by its tail."""
    return [rng.randint(4, 10) if rng.random() < 0.85 else rng.randint(50, 80)
            for _ in range(n)]


def decode(model: Any, requests: list[Any], k: int, max_concurrency: int,
           device: str) -> tuple[float, list[list[int]], int, int]:
    """One batch through DecodeBatch as the engine drives it: (wall s, completions,
    drafted, accepted)."""
    from erlay.actors.engine.core import DecodeBatch, drafts_for_step
    from erlay.actors.engine.core import Sequence as Seq
    seqs = [Seq(r) for r in requests]
    waiting, batch = list(seqs), DecodeBatch(model)
    sync(device)
    t0 = time.perf_counter()
    while waiting or batch.rows:
        room = len(requests) - len(batch)
        if waiting and room > 0:
            batch.admit(waiting[:room])
            waiting = waiting[room:]
        batch.step(drafts_for_step(k, len(batch.rows), max_concurrency))
    sync(device)
    return time.perf_counter() - t0, [s.completion for s in seqs], batch.drafted, \
        batch.accepted


def phase_mtp(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from erlay.actors.engine.api import GenerationRequest
    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.model.policy import PolicyConfig
    shape = MTP_SHAPES["tiny" if args.size == "tiny" else "gpu"]
    cfg = PolicyConfig(vocab_size=VOCAB, d_model=shape["d_model"], n_layers=shape["n_layers"],
                       n_heads=shape["n_heads"], d_ff=shape["d_ff"], max_seq_len=MAX_LEN,
                       mtp_heads=shape["max_k"])
    rng = random.Random(0)
    data = [counting_example(rng, n) for n in heavy_tailed(rng, 2048)]
    learner = LearnerCore(cfg.to_dict(), lr=3e-3, seed=0, torch_threads=args.threads,
                          mtp_loss_weight=1.0, device=args.device)
    t0 = time.perf_counter()
    summary = learner.sft([p for p, _ in data], [c for _, c in data], shape["train_steps"],
                          batch_size=32, lr=3e-3)
    train_s = time.perf_counter() - t0
    model = learner.model.eval()

    def requests(temperature: float) -> list[Any]:
        r = random.Random(1)
        out = []
        for i, n in enumerate(heavy_tailed(r, shape["batch"])):
            prompt, _ = counting_example(r, n)
            out.append(GenerationRequest(f"b{i}", tuple(prompt), MAX_LEN - len(prompt),
                                         seed=i, temperature=temperature, stop_ids=(EOS,)))
        return out

    sampled, conc = requests(1.0), shape["spec_max_concurrency"]
    ks = list(range(shape["max_k"] + 1))
    decode(model, sampled, ks[-1], conc, args.device)            # warm-up, not counted
    walls: dict[int, list[float]] = {k: [] for k in ks}
    made: dict[int, int] = {}
    counts: dict[int, tuple[int, int]] = {}
    for _ in range(shape["repeats"]):
        for k in ks:  # interleaved: drift hits every k alike
            wall, out, drafted, accepted = decode(model, sampled, k, conc, args.device)
            walls[k].append(wall)
            made[k], counts[k] = sum(map(len, out)), (drafted, accepted)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    best = min(ks[1:], key=lambda k: wall[k])
    greedy = requests(0.0)
    plain = decode(model, greedy, 0, conc, args.device)[1]
    drafted, accepted = counts[best]
    return {"speedup": round(wall[0] / wall[best], 3), "best_k": best,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "greedy_identical": decode(model, greedy, best, conc, args.device)[1] == plain,
            "wall_s": {str(k): spread(v) for k, v in walls.items()},
            "tokens_per_s": {str(k): round(made[k] / wall[k], 1) for k in ks},
            "batch": shape["batch"], "spec_max_concurrency": conc,
            "model_params": model.num_parameters(), "train_steps": shape["train_steps"],
            "train_s": round(train_s, 2), "sft_loss_last": round(summary["loss_last"], 4)}


# ------------------------------------------------------------------------ checkpoint
def phase_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from erlay.actors.learner.checkpoint import AsyncCheckpointer, latest, load
    # The staging buffer lives in /dev/shm: a state larger than a third of its free space
    # is cut down to fit, and the JSON says so (state_mb, shm_free_mb).
    shm_free_mb = shutil.disk_usage("/dev/shm").free / 2**20 if os.path.isdir("/dev/shm") \
        else float("inf")
    want_mb = args.ckpt_mb or (512 if args.device.startswith("cuda") else 8)
    state_mb = max(1, int(min(want_mb, shm_free_mb / 3)))
    tensors = 16
    numel = state_mb * 2**20 // 4 // tensors
    gen = torch.Generator(device=args.device).manual_seed(0)
    state = {f"t{i:02d}": torch.randn(numel, generator=gen, device=args.device)
             for i in range(tensors)}
    sync(args.device)
    repeats = args.repeats or 3
    root = Path(tempfile.mkdtemp(prefix="erlay-lane-ckpt-", dir=args.workdir))
    try:
        sync_s = []
        for r in range(repeats):
            path = root / f"sync-{r}.pt"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            sync_s.append(time.perf_counter() - t0)
            path.unlink()
        ckpt = AsyncCheckpointer(root / "async", keep=2)
        try:
            first_s = ckpt.save(0, state)   # starts the worker, maps the staging buffer
            ckpt.wait()
            exposed_s, persist_s = [], []
            for r in range(1, repeats + 1):
                t0 = time.perf_counter()
                exposed_s.append(ckpt.save(r, state) + ckpt.wait_snapshot())
                ckpt.wait()
                persist_s.append(time.perf_counter() - t0)
        finally:
            ckpt.close()
        info = latest(root / "async")
        restored = False
        if info is not None and info.step == repeats:
            loaded, _ = load(info.path)
            restored = all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"exposed_ratio": round(statistics.median(exposed_s) / statistics.median(sync_s), 4),
            "exposed_s": spread(exposed_s), "sync_s": spread(sync_s),
            "persist_s": spread(persist_s), "first_exposed_s": round(first_s, 4),
            "state_mb": state_mb, "wanted_mb": want_mb, "shm_free_mb": round(shm_free_mb),
            "restored": restored}


# --------------------------------------------------------------------------- learner
def phase_learner(args: argparse.Namespace) -> dict[str, Any]:
    import hf_smoke
    import numpy as np
    import torch

    from erlay.actors.learner.core import LearnerCore
    gpu = args.device.startswith("cuda")
    size = args.size or ("0.5b" if gpu else "tiny")
    groups, group_size, plen, clen, steps = (8, 8, 128, 128, 6) if gpu else (2, 4, 8, 8, 3)
    dtype = "bfloat16" if gpu else "float32"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    model_dir = hf_smoke.write_config(Path(tempfile.mkdtemp(prefix="erlay-lane-qwen2-",
                                                            dir=args.workdir)), size)
    spec = {"hf": str(model_dir), "init": "random", "dtype": dtype, "trust_remote_code": False,
            "lora": None, "mtp_heads": 0, "max_seq_len": None}
    core = LearnerCore(spec, lr=1e-5, seed=0, torch_threads=args.threads, device=args.device)
    batch = hf_smoke.synthetic_batch(core, hf_smoke.SIZES[size]["vocab_size"], groups,
                                     group_size, plen, clen, seed=1)
    step_s, losses = [], []
    for _ in range(steps):
        sync(args.device)
        t0 = time.perf_counter()
        metrics = core.train_step(batch)
        sync(args.device)
        step_s.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    steady = statistics.median(step_s[1:])
    tokens = groups * group_size * (plen + clen)
    shipped = shipped_minibatch(args, core, hf_smoke.SIZES[size]["vocab_size"], gpu)
    shutil.rmtree(model_dir, ignore_errors=True)
    return {"shipped": shipped, "step_s": round(steady, 4), "first_step_s": round(step_s[0], 4),
            "step_s_all": [round(s, 4) for s in step_s],
            "tokens_per_s": round(tokens / steady, 1), "batch_tokens": tokens,
            "sequences": groups * group_size, "size": size, "dtype": dtype,
            "model_params": core.model.num_parameters(),
            "loss_finite": bool(np.isfinite(losses).all()),
            "peak_mem_gib": round(hf_smoke.peak_memory_gib(args.device), 2)}


def shipped_minibatch(args: argparse.Namespace, core: Any, vocab: int,
                      gpu: bool) -> dict[str, Any]:
    """Two steps at the shipped 0.5B config's minibatch (64 rows of 256 + 512 tokens, 8
    groups of 8; the learner's default ``micro_batch_tokens`` and precision): the second
    step's ``torch.cuda.max_memory_allocated`` (its peak reset at the step's start; null on
    CPU) and its tokens/s.  On CPU a small batch of the same form."""
    import hf_smoke
    import torch
    groups, group_size, plen, clen = (8, 8, 256, 512) if gpu else (2, 2, 8, 8)
    batch = hf_smoke.synthetic_batch(core, vocab, groups, group_size, plen, clen, seed=2)
    seconds, peak = [], None
    for _ in range(2):
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        sync(args.device)
        t0 = time.perf_counter()
        core.train_step(batch)
        sync(args.device)
        seconds.append(time.perf_counter() - t0)
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if gpu else None
    tokens = groups * group_size * (plen + clen)
    return {"rows": groups * group_size, "tokens": tokens, "peak_gib": peak,
            "step_s": round(seconds[-1], 4), "tokens_per_s": round(tokens / seconds[-1], 1),
            "micro_batch_tokens": core.options.micro_batch_tokens,
            "precision": core.precision}


def phase_colocated(args: argparse.Namespace) -> dict[str, Any]:
    import hf_smoke
    import torch

    from erlay.actors.engine.api import GenerationRequest
    from erlay.actors.engine.core import DecodeBatch
    from erlay.actors.engine.core import Sequence as Seq
    from erlay.actors.engine.dormancy import free_device_cache
    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.model.build import build_policy
    gpu = args.device.startswith("cuda")
    size = args.size or ("0.5b" if gpu else "tiny")
    groups, group_size, plen, clen = (4, 8, 128, 64) if gpu else (2, 2, 8, 8)
    dtype = "bfloat16" if gpu else "float32"
    model_dir = hf_smoke.write_config(Path(tempfile.mkdtemp(prefix="erlay-lane-colo-",
                                                            dir=args.workdir)), size)
    spec = {"hf": str(model_dir), "init": "random", "dtype": dtype, "trust_remote_code": False,
            "lora": None, "mtp_heads": 0, "max_seq_len": None}
    core = LearnerCore(spec, lr=1e-5, seed=0, torch_threads=args.threads, device=args.device)
    vocab = hf_smoke.SIZES[size]["vocab_size"]
    train = hf_smoke.synthetic_batch(core, vocab, groups, group_size, plen, clen, seed=1)
    stages: dict[str, dict[str, float | None]] = {}

    def stage(name: str, work: Callable[[], Any]) -> Any:
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = work()
        sync(args.device)
        stages[name] = {"s": round(time.perf_counter() - t0, 4),
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
                        if gpu else None,
                        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3)
                        if gpu else None}
        return out

    with torch.device(args.device):   # DecodeBatch makes its inputs on the default device
        engine = build_policy(spec, seed=0, for_engine=True).eval()
        seqs = [Seq(GenerationRequest(f"c{i}", tuple(train.prompt_ids[i]), clen, seed=i,
                                      stop_ids=())) for i in range(groups * group_size)]
        batch = DecodeBatch(engine)

        def generate(steps: int) -> None:
            if not batch.rows:
                batch.admit([s for s in seqs if not s.finished])
            for _ in range(steps):
                if batch.rows:
                    batch.step()

        def refit() -> int:
            learned = core.model.state_dict()
            with torch.no_grad():
                served = engine.state_dict()
                for name, tensor in served.items():
                    tensor.copy_(learned[name])
            return len(served)

        stage("generate", lambda: generate(clen // 2))
        before = torch.cuda.memory_allocated() if gpu else 0
        stage("free", lambda: (batch.release(), free_device_cache(gpu)))
        freed = before - torch.cuda.memory_allocated() if gpu else 0
        metrics = stage("train", lambda: core.train_step(train))
        tensors = stage("refit", refit)
        stage("generate_again", lambda: generate(clen))
    shutil.rmtree(model_dir, ignore_errors=True)
    return {"stages": stages, "kv_cache_gib": round(freed / 2**30, 3) if gpu else None,
            "refit_tensors": tensors, "loss": round(float(metrics["loss"]), 4),
            "all_finished": all(s.finished for s in seqs), "size": size, "dtype": dtype,
            "sequences": len(seqs)}


PHASE_FNS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "mtp": phase_mtp, "checkpoint": phase_checkpoint, "learner": phase_learner,
    "colocated": phase_colocated}


def outside_modules() -> list[str]:
    """Top-level modules loaded from outside the standard library and erlay."""
    return sorted({m.split(".")[0] for m in sys.modules}
                  - set(sys.stdlib_module_names) - {"erlay", "hf_smoke", "lane", "__main__"}
                  - {m for m in sys.modules if m.startswith("_")})


def child(args: argparse.Namespace) -> int:
    """Run one phase in this process; its last stdout line is ``{"result"|"error": ...}``."""
    try:
        prepare_imports()
        import torch
        torch.set_num_threads(args.threads)
        if os.environ.get(PLANT_ENV) == args.phase:
            raise RuntimeError(f"planted failure in phase {args.phase} ({PLANT_ENV})")
        out: dict[str, Any] = {"result": PHASE_FNS[args.phase](args)}
        code = 0
    except BaseException as exc:  # every failure becomes the phase's error
        traceback.print_exc()
        out, code = {"error": f"{type(exc).__name__}: {exc}"[:2000]}, 1
    out["modules"] = outside_modules()
    print(json.dumps(out), flush=True)
    return code


def run_child(phase: str, args: argparse.Namespace, budget_s: float
              ) -> tuple[dict[str, Any] | None, str | None, list[str]]:
    """(result, error, modules) of one phase in its own process group, killed whole at its
    budget (the checkpoint worker included)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase,
           "--device", args.device, "--threads", str(args.threads)]
    for flag, value in (("--size", args.size), ("--ckpt-mb", args.ckpt_mb),
                        ("--repeats", args.repeats), ("--workdir", args.workdir)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(budget_s, 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, f"timed out after {budget_s:.0f} s (its budget)", []
    sys.stderr.write(stderr[-4000:])
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    try:
        reply = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return None, f"exited {proc.returncode} without a result: {tail}"[:2000], []
    if "error" in reply or proc.returncode != 0:
        return None, reply.get("error") or f"exited {proc.returncode}", reply.get("modules", [])
    return reply["result"], None, reply.get("modules", [])


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The lane's figures, one level deep (null where their phase failed)."""
    def get(phase: str, key: str) -> Any:
        return (result.get(phase) or {}).get(key)
    return {"mtp_speedup": get("mtp", "speedup"), "mtp_best_k": get("mtp", "best_k"),
            "checkpoint_exposed_ratio": get("checkpoint", "exposed_ratio"),
            "learner_step_s": get("learner", "step_s"),
            "learner_tokens_per_s": get("learner", "tokens_per_s"),
            "learner_shipped_peak_gib": (get("learner", "shipped") or {}).get("peak_gib"),
            "learner_shipped_tokens_per_s":
                (get("learner", "shipped") or {}).get("tokens_per_s"),
            "colocated_kv_cache_gib": get("colocated", "kv_cache_gib")}


def versions() -> dict[str, str | None]:
    from importlib import metadata
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "nvidia-resiliency-ext"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def default_out() -> Path:
    base = os.environ.get("OUT")
    return Path(base) / "gpu_lane.json" if base else HERE / "out" / "gpu_lane.json"


def lane(args: argparse.Namespace) -> int:
    prepare_imports()
    began = time.perf_counter()
    phases = [p for p in (args.phases.split(",") if args.phases else PHASES) if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s): {sorted(unknown)}; known: {list(PHASES)}")
    budgets = {**BUDGET_S, **parse_budgets(args.budget)}
    result: dict[str, Any] = {"device": args.device, "size": args.size or "default",
                              "versions": versions(), "load_avg_1m": [
                                  round(os.getloadavg()[0], 2)]}
    errors: dict[str, str] = {}
    phase_s: dict[str, float] = {}
    modules: set[str] = set()
    for phase in phases:
        left = args.deadline_s - (time.perf_counter() - began)
        t0 = time.perf_counter()
        if left < 5:
            got, error, mods = None, f"not run: the lane's {args.deadline_s:g} s deadline", []
        else:
            got, error, mods = run_child(phase, args, min(budgets[phase], left))
        phase_s[phase] = round(time.perf_counter() - t0, 1)
        result[phase] = got
        modules.update(mods)
        if error is not None:
            errors[phase] = error
    result["load_avg_1m"].append(round(os.getloadavg()[0], 2))
    result.update(figures=headline(result), errors=errors, failures=sorted(errors),
                  phase_s=phase_s, modules=sorted(modules), passed=not errors,
                  wall_s=round(time.perf_counter() - began, 1))
    if args.device.startswith("cuda"):
        result["gpu"] = gpu_name()
    out = Path(args.out) if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result)
    out.write_text(text + "\n")
    for key in ("figures", "errors", "phase_s", "wall_s"):
        print(f"{key}: {result[key]}")
    print(f"written to {out}")
    print(text)
    return 0 if not errors else 1


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (False where torch itself is missing)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_name() -> str | None:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # a name is decoration
        return None


def parse_budgets(text: str | None) -> dict[str, float]:
    """``mtp=60,learner=90`` -> {phase: seconds}."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in PHASES:
            raise SystemExit(f"--budget: unknown phase {name!r}")
        out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--size", choices=["0.5b", "tiny"], default=None,
                        help="learner model shape and phase sizes (default: 0.5b on CUDA, "
                             "tiny on CPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke run: --device cpu --size tiny (with or without CUDA)")
    parser.add_argument("--phases", help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--budget", help="per-phase seconds, e.g. mtp=60,learner=90 "
                                         f"(defaults {BUDGET_S})")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    parser.add_argument("--ckpt-mb", type=int, help="checkpoint state size (default: 512 "
                                                    "on CUDA, 8 on CPU)")
    parser.add_argument("--repeats", type=int, help="checkpoint saves per side (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--workdir", help="where temporary files go (default: the temp dir)")
    parser.add_argument("--out", help="the JSON file (default: $OUT/gpu_lane.json, else "
                                      "bench/gpu/out/gpu_lane.json)")
    parser.add_argument("--plant-failure", choices=PHASES,
                        help="make this phase raise: the lane must then fail, naming it")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child run
    parser.add_argument("--print-wheels", action="store_true",
                        help="print the wheels run.sh installs, one per line, and exit")
    args = parser.parse_args(argv)
    if args.print_wheels:
        print("\n".join(WHEELS))
        return 0
    if args.smoke:
        args.device, args.size = "cpu", "tiny"
    if args.device.startswith("cpu") and args.size is None:
        args.size = "tiny"
    if args.device.startswith("cuda") and not args.phase and not cuda_present():
        # The GPU lane on a machine without one: nothing to measure, and nothing failed.
        print("lane: no GPU present (torch sees no CUDA device); nothing measured")
        print(json.dumps({"gpu": False}))
        return 0
    if args.plant_failure:
        os.environ[PLANT_ENV] = args.plant_failure
    return child(args) if args.phase else lane(args)


if __name__ == "__main__":
    sys.exit(main())
