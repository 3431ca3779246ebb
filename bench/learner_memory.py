"""Benchmark of the learner's memory at a real model's shape: what one step costs above the
resident training state, at minibatches of 4k, 16k and 64k tokens and a fixed micro-batch,
and whether micro-batched gradients equal one pass's.

The model is Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 key-value heads, MLP
4864, vocabulary 151,936, tied embeddings: 494,032,768 parameters), built from a
``transformers.Qwen2Config`` with random weights (nothing is downloaded), fp32 on the CPU,
AdamW.  Each measurement is its own fresh process (``--child``), so peaks never mix:

1. build a :class:`~erlay.actors.learner.core.LearnerCore` (``micro_batch_tokens``, fp32) and
   take a warm-up step on a small batch, which allocates the gradients and AdamW's moments;
2. ``resident_bytes``: the parameters, gradients and optimiser state then held (tensor
   bytes); the process's RSS then (``VmRSS``, freed memory returned with ``malloc_trim``;
   the child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed so large buffers are unmapped when
   freed) is the baseline;
3. ``echo 5 > /proc/self/clear_refs`` resets the high-water mark, one step runs on ``N``
   tokens (rows of ``--row`` tokens, prompt plus completion, groups of 8 with mixed rewards),
   and ``peak_above_resident = VmHWM - baseline``; ``RssAnon`` is also sampled every 5 ms
   during the step (its maximum above its baseline is in the table).  The step zeroes the
   gradients first (``set_to_none``) and makes them again in its backward, so the figure is
   the step's activations, logits chunks and transients, net of the gradients' brief absence.

Full depth at 64k tokens takes too long on two cores, so the minibatch sweep runs at
``--depth`` layers (same width and vocabulary; ``"depth"`` in the JSON says which ran for
each N) and full depth runs at 16k (``full_depth_16k_peak_rss_bytes``, the process's whole
peak RSS, against the 16 GiB target on this 24 GB machine).  ``peak_growth`` =
``peak_above_resident[65536] / peak_above_resident[4096]``, both at the sweep's depth.
Activation bytes per micro-batch token come from the two depths at the same micro-batch:
``per_layer = (peak_full - peak_sweep) / (layers_full - layers_sweep) / micro_batch_tokens``
(``activation_bytes_per_token_layer``), and the rest of a micro-batch's peak
(embeddings, final norm, logits chunks) is ``head_bytes``: what
:mod:`erlay.actors.job.memory_model` predicts from.

``grad_max_rel_diff``: on a tiny fp32 Qwen2, per objective (``grpo`` with ``kl_coef`` 0.05
against a perturbed reference, the others without), one step's gradients with micro-batches
(a budget that makes at least 3) against one pass (an unbounded budget), on rows of varied
lengths with masked-out tokens, a row with none trained (as DAPO's filtered rows), and an
invalid row: ``max over parameters of max|g_micro - g_one| / max|g_one|`` (parameters whose
one-pass gradient is all zero are left out; target 1e-5).  Gradients are read from
``p.grad`` after ``train_step`` (the next minibatch would zero them), with no clipping.

Refit figures come from ``bench/refit_probe.py``'s ``measure_refit()`` at the full shape
(bytes moved must equal parameters x 2, bf16; the engine's peak RSS at most 1.1x its steady
RSS).  A full run that skips a figure (``--full-tokens 0``, ``--no-refit``) misses its target.

Prints a table, then one JSON line: ``resident_bytes``, ``peak_above_resident_bytes``,
``peak_growth``, ``depth``, ``full_depth_16k_peak_rss_bytes``, ``bytes_per_micro_batch_token``,
``activation_bytes_per_token_layer``, ``head_bytes``, ``step_s``, ``grad_max_rel_diff``, the
refit keys, ``runs``, ``threads``, ``load``, ``targets_met``.  Exits 1 when a target is missed
(the smoke run checks the gradients only: its sizes are too small for memory targets).

    python bench/learner_memory.py [--repeats 3] [--micro 4096] [--row 512] [--depth 2]
    python bench/learner_memory.py --smoke     # a tiny shape, seconds (CI)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

SIZES = (4096, 16384, 65536)
GIB = 2**30
PEAK_GROWTH_TARGET = 1.15        # 16x the tokens, at most 1.15x the peak above resident
FULL_DEPTH_PEAK_TARGET = 16 * GIB
GRAD_REL_TARGET = 1e-5
REFIT_PEAK_TARGET = 1.1         # the engine's peak RSS during a refit over its steady RSS
GROUP = 8


@dataclass(frozen=True)
class Shape:
    """A Qwen2 shape: what the learner is built from."""

    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    ffn: int = 4864
    vocab: int = 151936
    tied: bool = True

    def config(self, layers: int | None = None) -> Any:
        from transformers import Qwen2Config
        return Qwen2Config(vocab_size=self.vocab, hidden_size=self.hidden,
                           intermediate_size=self.ffn,
                           num_hidden_layers=self.layers if layers is None else layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           tie_word_embeddings=self.tied, max_position_embeddings=32768,
                           rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)


QWEN2_05B = Shape()
SMOKE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=2048)


# ---------------------------------------------------------------------------- the child
def status_kib(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024
    return out


class AnonSampler:
    """The maximum ``RssAnon`` seen every ``period_s`` while running (a thread)."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s, self.peak = period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("RssAnon")["RssAnon"])
            self._stop.wait(self.period_s)


def trim() -> None:
    """Return freed heap memory to the system, so RSS is what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def synthetic_batch(tokens: int, row: int, prompt: int, vocab: int, seed: int) -> Any:
    """A TrainBatch of ``tokens // row`` rows (``prompt`` + ``row - prompt`` tokens), groups
    of :data:`GROUP` with mixed rewards, behaviour logprobs near a random model's."""
    import math
    import random

    from erlay.actors.learner.core import TrainBatch
    rng = random.Random(seed)
    rows = max(GROUP, tokens // row // GROUP * GROUP)
    completion = row - prompt
    near = -math.log(vocab)
    return TrainBatch(
        prompt_ids=[[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(rows)],
        completion_ids=[[rng.randrange(3, vocab) for _ in range(completion)]
                        for _ in range(rows)],
        behaviour_logprobs=[[near + rng.uniform(-0.05, 0.05) for _ in range(completion)]
                            for _ in range(rows)],
        versions=[[0] * completion for _ in range(rows)],
        rewards=[float(i % 3 == 0) + rng.uniform(0, 0.1) for i in range(rows)],
        group_size=GROUP, rollout_ids=[f"r{seed}-{i}" for i in range(rows)])


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement (module docstring, steps 1-3) in this fresh process."""
    import torch

    from erlay.actors.learner.core import LearnerCore
    shape = Shape(**spec["shape"])
    with tempfile.TemporaryDirectory() as tmp:
        shape.config(spec["depth"]).save_pretrained(tmp)
        core = LearnerCore({"hf": tmp, "init": "random", "dtype": "float32",
                            "max_seq_len": spec["row"]},
                           lr=1e-6, max_grad_norm=1.0, torch_threads=spec["threads"],
                           micro_batch_tokens=spec["micro"], precision=spec["precision"],
                           activation_checkpointing=spec["checkpointing"])
    core.train_step(synthetic_batch(GROUP * 16, 16, 8, shape.vocab, seed=1))   # warm-up
    params = [p for p in core.model.parameters()]
    resident = sum(p.numel() * p.element_size() for p in params) + sum(
        p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None) + sum(
        v.numel() * v.element_size() for s in core.optimizer.state.values()
        for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    batch = synthetic_batch(spec["tokens"], spec["row"], spec["prompt"], shape.vocab, seed=2)
    trim()
    before = status_kib("VmRSS", "RssAnon")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    with AnonSampler() as sampler:
        started = time.perf_counter()
        metrics = core.train_step(batch)
        step_s = time.perf_counter() - started
    after = status_kib("VmHWM", "VmRSS", "RssAnon")
    return {"tokens": spec["tokens"], "depth": spec["depth"], "resident_bytes": resident,
            "params": sum(p.numel() for p in params), "rss_before_bytes": before["VmRSS"],
            "peak_rss_bytes": after["VmHWM"],
            "peak_above_resident_bytes": after["VmHWM"] - before["VmRSS"],
            "anon_peak_above_bytes": max(sampler.peak, after["RssAnon"]) - before["RssAnon"],
            "step_s": step_s, "grad_norm": metrics.get("grad_norm")}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter; its last stdout line is the result."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": str(spec["threads"])}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"learner_memory: a measurement failed (exit {done.returncode}): "
                         f"{spec}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------- gradient parity
def parity_batch(vocab: int, max_len: int) -> Any:
    """Two groups of 4 rows of varied lengths, some tokens masked out, one row with no
    trained token, one invalid row: what micro-batching must not change."""
    import random

    from erlay.actors.learner.core import TrainBatch
    rng = random.Random(5)
    rows = 8
    lens = [max(2, max_len - 3 * i) for i in range(rows)]
    prompts = [[rng.randrange(3, vocab) for _ in range(3 + i % 4)] for i in range(rows)]
    comps = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
    masks = [[not (i % 3 == 1 and 2 <= t < 5) for t in range(n)] for i, n in enumerate(lens)]
    masks[5] = [False] * lens[5]                     # filtered, as DAPO's all-equal rows
    return TrainBatch(prompt_ids=prompts, completion_ids=comps,
                      behaviour_logprobs=[[0.0] * n for n in lens],
                      versions=[[0] * n for n in lens],
                      rewards=[1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.7, 0.1], group_size=4,
                      rollout_ids=[f"p{i}" for i in range(rows)], loss_mask=masks,
                      valid=[i != 3 for i in range(rows)])


def grad_parity(threads: int) -> dict[str, Any]:
    """``grad_max_rel_diff`` per objective (module docstring)."""
    import dataclasses
    import random

    import torch

    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.learner.objectives import ALGORITHMS, Objective
    shape = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, tied=True)
    max_len = 24
    objectives = {"grpo": Objective("grpo"), "dr_grpo": Objective("dr_grpo", max_tokens=32),
                  "dapo": Objective("dapo", clip_low=0.2, clip_high=0.28, overlong_max=max_len,
                                    overlong_buffer=6),
                  "gspo": Objective("gspo", clip_low=3e-4, clip_high=4e-4),
                  "rloo": Objective("rloo"), "reinforce_pp": Objective("reinforce_pp")}
    assert set(objectives) == set(ALGORITHMS)
    kl = {"grpo": 0.05}
    out: dict[str, float] = {}
    micro_counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shape.config().save_pretrained(tmp)
        spec = {"hf": tmp, "init": "random", "dtype": "float32", "max_seq_len": 64}
        base = parity_batch(shape.vocab, max_len)
        probe = LearnerCore(spec, torch_threads=threads)
        rng = random.Random(9)
        behaviour = [[lp + rng.uniform(-0.02, 0.02) for lp in row] for row in
                     probe.evaluate_logprobs(base.prompt_ids, base.completion_ids)]
        batch = dataclasses.replace(base, behaviour_logprobs=behaviour)
        longest = max(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids,
                                                       strict=True))
        small = 2 * longest   # two rows a micro-batch at most: >= 3 micro-batches of 7 rows
        for name, objective in objectives.items():
            grads = []
            for budget in (small, 10**9):
                core = LearnerCore(spec, objective=objective, kl_coef=kl.get(name, 0.0),
                                   lr=1e-4, max_grad_norm=0.0, torch_threads=threads,
                                   micro_batch_tokens=budget, precision="fp32")
                if core.reference is not None:   # a reference the policy is not at
                    with torch.no_grad():
                        for p in core.reference.parameters():
                            p.add_(torch.randn_like(p) * 0.01)
                core.train_step(batch)
                grads.append({n: p.grad.detach().clone() for n, p in
                              core.model.named_parameters() if p.grad is not None})
            micro, one = grads
            worst = 0.0
            for n, g in one.items():
                scale = float(g.abs().max())
                if scale > 0:
                    diff = float((micro[n] - g).abs().max()) if n in micro else float("inf")
                    worst = max(worst, diff / scale)
            out[name] = worst
        trained = sum(1 for i in range(len(batch)) if any(batch.token_mask(i)))
        micro_counts["rows_trained"] = trained
        micro_counts["micro_batches_at_least"] = -(-trained // 2)
    return {"grad_max_rel_diff": out, "grad_parity_kl": kl, "grad_parity": micro_counts}


# ---------------------------------------------------------------------------- refit
def refit_figures() -> dict[str, Any]:
    """``measure_refit()`` of ``bench/refit_probe.py`` at the full 0.5B shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from refit_probe import measure_refit  # type: ignore[import-not-found]
    figures = measure_refit()
    keys = ("refit_bytes", "param_count", "expected_bytes", "refit_s",
            "engine_steady_rss_bytes", "engine_refit_peak_rss_bytes",
            "engine_refit_peak_over_steady", "engine_refit_peak_anon_over_steady")
    return {k: figures[k] for k in keys}


# ---------------------------------------------------------------------------- the sweep
def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def sweep(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """Every measurement of the module docstring; medians over ``args.repeats``."""
    load = os.getloadavg()
    base = {"shape": asdict(shape), "row": args.row, "prompt": args.prompt,
            "micro": args.micro, "precision": "fp32", "checkpointing": False,
            "threads": args.threads}
    by_size: dict[int, list[dict[str, Any]]] = {}
    for n in args.sizes:
        repeats = args.repeats if n <= args.repeat_upto else 1
        by_size[n] = [run_child({**base, "tokens": n, "depth": args.depth})
                      for _ in range(repeats)]
        print(f"  measured {n} tokens at depth {args.depth}: {len(by_size[n])} run(s)",
              file=sys.stderr, flush=True)
    full = None
    if args.full_tokens:
        full = by_size[args.full_tokens] if args.depth == shape.layers else \
            [run_child({**base, "tokens": args.full_tokens, "depth": shape.layers})]
    lo, hi = min(args.sizes), max(args.sizes)
    peaks = {str(n): int(median_of(r, "peak_above_resident_bytes")) for n, r in by_size.items()}
    result: dict[str, Any] = {
        "shape": asdict(shape), "micro_batch_tokens": args.micro, "row_tokens": args.row,
        "prompt_tokens": args.prompt,
        "resident_bytes": by_size[lo][0]["resident_bytes"],
        "params_at_depth": by_size[lo][0]["params"],
        "peak_above_resident_bytes": peaks,
        "anon_peak_above_bytes": {str(n): int(median_of(r, "anon_peak_above_bytes"))
                                  for n, r in by_size.items()},
        "peak_growth": round(peaks[str(hi)] / peaks[str(lo)], 3),
        "depth": {str(n): args.depth for n in by_size},
        "step_s": {str(n): round(median_of(r, "step_s"), 2) for n, r in by_size.items()},
        "runs": {str(n): len(r) for n, r in by_size.items()},
        "bytes_per_micro_batch_token": int(peaks[str(lo)] / min(args.micro, lo)),
        "load": [round(x, 2) for x in load],
    }
    if full is not None:
        f = full[0]
        result.update({"full_depth_16k_peak_rss_bytes": f["peak_rss_bytes"],
                       "full_depth_resident_bytes": f["resident_bytes"],
                       "full_depth_params": f["params"],
                       "full_depth_peak_above_resident_bytes": f["peak_above_resident_bytes"],
                       "full_depth_step_s": round(f["step_s"], 2)})
        if shape.layers != args.depth:
            sweep_peak = peaks.get(str(args.full_tokens), f["peak_above_resident_bytes"])
            per_layer = (f["peak_above_resident_bytes"] - sweep_peak) / (
                shape.layers - args.depth) / args.micro
            result["activation_bytes_per_token_layer"] = int(per_layer)
            result["head_bytes"] = int(sweep_peak - per_layer * args.depth * args.micro)
    return result


def targets(result: dict[str, Any], smoke: bool) -> dict[str, bool]:
    """Which targets this run met (the smoke run: the gradients only)."""
    met = {f"grad_{k}": v <= GRAD_REL_TARGET for k, v in result["grad_max_rel_diff"].items()}
    if not smoke:   # a figure not measured (--full-tokens 0, --no-refit) is a target missed
        met["peak_growth"] = result["peak_growth"] <= PEAK_GROWTH_TARGET
        met["full_depth_16k_peak"] = \
            result.get("full_depth_16k_peak_rss_bytes", math.inf) <= FULL_DEPTH_PEAK_TARGET
        met["refit_bytes"] = result.get("refit_bytes", -1) == result.get("expected_bytes")
        met["engine_refit_peak"] = \
            result.get("engine_refit_peak_over_steady", math.inf) <= REFIT_PEAK_TARGET
    return met


def table(result: dict[str, Any]) -> str:
    s = result["shape"]
    lines = [f"Qwen2 shape: hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}; "
             f"fp32, AdamW; micro_batch_tokens {result['micro_batch_tokens']}, rows of "
             f"{result['row_tokens']} tokens ({result['prompt_tokens']} prompt)",
             f"resident (weights + grads + AdamW) at depth "
             f"{result['depth'][min(result['depth'], key=int)]}: "
             f"{result['resident_bytes'] / GIB:.2f} GiB ({result['params_at_depth']:,} params)",
             f"{'minibatch tokens':>17}{'depth':>7}{'peak above resident':>22}"
             f"{'RssAnon above':>16}{'step s':>9}{'runs':>6}"]
    for n, peak in result["peak_above_resident_bytes"].items():
        lines.append(f"{n:>17}{result['depth'][n]:>7}{peak / GIB:>18.3f} GiB"
                     f"{result['anon_peak_above_bytes'][n] / GIB:>12.3f} GiB"
                     f"{result['step_s'][n]:>9.2f}{result['runs'][n]:>6}")
    lines.append(f"peak_growth (largest / smallest minibatch): {result['peak_growth']:.3f} "
                 f"(target <= {PEAK_GROWTH_TARGET})")
    if "full_depth_16k_peak_rss_bytes" in result:
        lines.append(f"full depth ({s['layers']} layers, {result['full_depth_params']:,} "
                     f"params): resident {result['full_depth_resident_bytes'] / GIB:.2f} GiB, "
                     f"peak above {result['full_depth_peak_above_resident_bytes'] / GIB:.2f} "
                     f"GiB, process peak RSS "
                     f"{result['full_depth_16k_peak_rss_bytes'] / GIB:.2f} GiB (target <= "
                     f"{FULL_DEPTH_PEAK_TARGET / GIB:.0f}), step {result['full_depth_step_s']} s")
    if "activation_bytes_per_token_layer" in result:
        lines.append(f"activations: {result['activation_bytes_per_token_layer']:,} bytes per "
                     f"micro-batch token per layer; head and the rest "
                     f"{result['head_bytes'] / GIB:.3f} GiB per micro-batch")
    lines.append("gradients, micro-batched vs one pass (max rel diff, target <= 1e-5): " +
                 ", ".join(f"{k} {v:.2e}" for k, v in result["grad_max_rel_diff"].items()))
    if "refit_bytes" in result:
        lines.append(f"refit: {result['refit_bytes']:,} bytes in {result['refit_s']:.2f} s, "
                     f"engine peak / steady RSS {result['engine_refit_peak_over_steady']:.3f}")
    else:
        lines.append(f"refit: {result.get('refit')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, seconds (CI)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--micro", type=int, default=2048, help="micro_batch_tokens")
    parser.add_argument("--row", type=int, default=512, help="tokens per row")
    parser.add_argument("--prompt", type=int, default=384, help="prompt tokens per row")
    parser.add_argument("--depth", type=int, default=2, help="layers of the sweep")
    parser.add_argument("--full-tokens", type=int, default=16384,
                        help="minibatch tokens of the full-depth run (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size, medians")
    parser.add_argument("--repeat-upto", type=int, default=16384,
                        help="sizes above this run once")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-refit", action="store_true", help="skip measure_refit()")
    parser.add_argument("--sweep-out", type=Path, help="also write the sweep's figures here")
    parser.add_argument("--sweep-in", type=Path, help="take the sweep's figures from this "
                        "file (a --sweep-out of an earlier run) instead of measuring")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    shape = QWEN2_05B
    if args.smoke:
        shape = SMOKE
        args = argparse.Namespace(**{**vars(args), "sizes": [512, 1024], "micro": 256,
                                     "row": 64, "prompt": 32, "depth": shape.layers,
                                     "full_tokens": 512, "repeats": 1, "no_refit": True})
        shape = replace(shape)
    if args.sweep_in:
        result = json.loads(args.sweep_in.read_text(encoding="utf-8"))
    else:
        result = sweep(args, shape)
    if args.sweep_out:
        args.sweep_out.write_text(json.dumps(result), encoding="utf-8")
    result.update(grad_parity(args.threads))
    result.update({"refit": "skipped (--no-refit)"} if args.no_refit else refit_figures())
    result.setdefault("load", [round(x, 2) for x in os.getloadavg()])
    result.update({"threads": args.threads,
                   "load_after": [round(x, 2) for x in os.getloadavg()]})
    met = targets(result, args.smoke)
    result["targets_met"] = met
    print(table(result))
    print(json.dumps(result))
    if not all(met.values()):
        print(f"learner_memory: missed {', '.join(k for k, v in met.items() if not v)}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
