"""The fsdp2 equivalence check: ranks that shard the policy with FSDP2 take the same optimizer
step as one whole (replicated, single-rank) learner on the same batch.

:func:`run_parity` trains one whole learner and ``world`` fsdp2 ranks (each its own process,
a gloo group on loopback; :func:`spawn_ranks`) from the same seed on the same batch, then
compares every published parameter: ``equivalent`` is ``max_abs_diff <= tolerance`` and the
pre-clip global gradient norms agree to ``tolerance`` relative.  The norm is the part that sees
a wrong gradient scale: Adam's update ``g / (sqrt(v) + eps)`` does not change when the whole
gradient is scaled, except where ``|g|`` is near ``eps``.  Those entries also set the default
learning rate, 1e-4: there the update ``lr * g / (|g| + eps)`` turns a float-summation
difference of ~1e-10 in ``g`` (the ranks sum the batch in two halves) into ~1e-2 ``lr``, so at
1e-4 the two learners agree to ~2e-6 while each parameter that has a gradient moves by up to
1e-4, ten times the tolerance.  It also reports the bytes each rank holds after the step
(:func:`erlay.actors.learner.fsdp.local_bytes`); :func:`fsdp_rank_startup` accounts for the
device bytes while a rank shards.  ``perturb`` plants a violation: the last
rank adds it to every parameter before the step, as a rank that drifted from its peers
would, so the check must then fail.  Used by the tests and by ``bench/learner_scale.py``.

Run as a script, it checks a random-initialised Llama-architecture HF model (``--hidden``,
``--layers``, ``--ffn``; the sizes of ``bench/learner_scale.py``) on ``--world`` ranks,
prints a table, then one JSON object as the last line: ``{"max_abs_diff", "equivalent",
"grad_norm": {"whole", "fsdp2"}, "bytes": [per rank], "params", "world", "perturb"}``.  The
exit status is 0 when the verdict is the expected one (equivalent, or not with
``--perturb``), 1 otherwise.  ``--smoke`` is ``--hidden 64 --layers 2 --ffn 128`` (options
given explicitly win).

    python bench/fsdp_parity.py [--hidden 256] [--layers 4] [--ffn 1024] [--world 2]
                                [--perturb 0] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from erlay.actors.learner.core import LearnerCore, TrainBatch
from erlay.actors.learner.fsdp import local_bytes

TOLERANCE = 1e-5


def parity_batch(vocab_size: int, *, groups: int = 2, group_size: int = 2, seed: int = 0,
                 idle_rows: tuple[int, ...] = ()) -> TrainBatch:
    """A deterministic GRPO batch of random tokens: ``groups`` groups of ``group_size``
    completions, rewards that differ within each group (non-zero advantages), fixed
    behaviour logprobs.  Rows in ``idle_rows`` train no token (their loss mask is off)."""
    rng = random.Random(seed)
    n = groups * group_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(4 + i % 3)] for i in range(n)]
    completions = [[rng.randrange(3, vocab_size) for _ in range(3 + i % 4)] for i in range(n)]
    return TrainBatch(prompt_ids=prompts, completion_ids=completions,
                      behaviour_logprobs=[[-3.0] * len(c) for c in completions],
                      versions=[[0] * len(c) for c in completions],
                      rewards=[float(i % group_size) for i in range(n)],
                      group_size=group_size, rollout_ids=[f"r{i}" for i in range(n)],
                      loss_mask=[[i not in idle_rows] * len(c)
                                 for i, c in enumerate(completions)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, out: str, target: Any, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    result = target(rank, world, port, *args)
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def spawn_ranks(world: int, target: Any, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run ``target(rank, world, port, *args)`` in ``world`` forked processes that can form a
    gloo group on loopback at ``port``; returns each rank's result (picklable), by rank.
    A rank that fails raises here (torch.multiprocessing's ProcessRaisedException); ranks
    still running after ``timeout_s`` (a hung collective) are killed and TimeoutError is
    raised.  Forked where it can be: the children start with torch and transformers already
    imported (seconds per process on a small CPU).  A caller that belongs to a process group
    (a test session that made one for a one-rank checkpointer) spawns them instead: a forked
    child would inherit that group and could not form its own."""
    import torch.multiprocessing as mp
    from torch import distributed as dist
    method = "spawn" if dist.is_available() and dist.is_initialized() else "fork"
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_rank_main, args=(world, free_port(), out, target, args),
                                     nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:g} s")
        return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def _learner(spec: dict[str, Any], rank: int, world: int, port: int, backend: str,
             options: dict[str, Any]) -> LearnerCore:
    return LearnerCore(spec, rank=rank, world_size=world, master_port=port, backend=backend,
                       **options)


def fsdp_rank_step(rank: int, world: int, port: int, spec: dict[str, Any],
                   batch: TrainBatch, options: dict[str, Any], perturb: float
                   ) -> dict[str, Any]:
    """One fsdp2 rank: one train step on ``batch``; rank 0 returns the published weights.
    Every rank returns its bytes after the step."""
    core = _learner(spec, rank, world, port, "fsdp2", options)
    if perturb and rank == world - 1:
        with torch.no_grad():
            for p in core.model.parameters():
                p.add_(perturb)
    metrics = core.train_step(batch)
    out = {"bytes": local_bytes(core.model, core.optimizer), "grad_norm": metrics["grad_norm"],
           "weights": core.weights() if rank == 0 else None}
    core.close()
    return out


def fsdp_rank_startup(rank: int, world: int, port: int, spec: dict[str, Any],
                      options: dict[str, Any]) -> dict[str, int]:
    """The parameter bytes an fsdp2 rank places on its device while it starts, accounted
    from FSDP2's placement rule (the mesh's device here may be the host): ``fully_shard``
    moves a unit's whole parameters to the device, keeps this rank's shard, frees the rest.
    ``peak``: the largest, over the ``fully_shard`` calls, of the shards made so far plus
    the unit being sharded, whole.  ``whole``: the model's parameter bytes, which a rank that
    built the model on its device held from its constructor on (before sharding was
    deferred to the host).  ``shards``: this rank's shards at the end."""
    import torch.distributed.fsdp as fsdp_module
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()
    core = _learner(spec, rank, world, port, "fsdp2", options)
    models = [m for m in (core.model, core.reference) if m is not None]
    whole = sum(nbytes(p) for m in models for p in m.parameters())
    real, peaks = fsdp_module.fully_shard, []

    def shards() -> int:
        return sum(nbytes(p) for m in models for p in m.parameters()
                   if isinstance(p, DTensor))

    def accounting(module: torch.nn.Module, **kwargs: Any) -> Any:
        unit = sum(nbytes(p) for p in module.parameters() if not isinstance(p, DTensor))
        out = real(module, **kwargs)
        peaks.append(unit + shards())
        return out
    fsdp_module.fully_shard = accounting
    try:
        core.state()   # the first collective: shards
    finally:
        fsdp_module.fully_shard = real
    result = {"whole": whole, "peak": max(peaks), "shards": shards()}
    core.close()
    return result


def fsdp_rank_resume(rank: int, world: int, port: int, spec: dict[str, Any],
                     batches: list[TrainBatch], options: dict[str, Any], port2: int,
                     checkpoint: str) -> dict[str, Any]:
    """The restart path: ranks train ``batches[0]``, rank 0 writes :meth:`LearnerCore.state`
    (a collective) to the file ``checkpoint``, ranks train ``batches[1]``; then a new
    incarnation (a new group at ``port2``) loads that file before it shards, as a restarted
    rank does in its constructor, is asked for step 2 (it must answer ``stale_step``), and
    trains ``batches[1]`` again; then loads the file once more, sharded now, and trains it
    again.  Rank 0 returns the weights after each of the three second steps; every rank says
    whether it refused to serve weights (all but rank 0 must)."""
    import torch.distributed as dist
    first = _learner(spec, rank, world, port, "fsdp2", options)
    first.train_step(batches[0], expected_step=0)
    state = first.state()
    if rank == 0:
        Path(checkpoint).write_bytes(pickle.dumps(state))
    dist.barrier()   # the file is whole before any rank reads it
    first.train_step(batches[1], expected_step=1)
    weights = first.weights() if rank == 0 else None
    try:
        first.weights()
        refused = False
    except RuntimeError:
        refused = True
    first.close()
    second = _learner(spec, rank, world, port2, "fsdp2", options)
    second.load_state(pickle.loads(Path(checkpoint).read_bytes()))
    stale = second.train_step(batches[1], expected_step=2)
    second.train_step(batches[1], expected_step=1)
    resumed = second.weights() if rank == 0 else None
    # Loading again once sharded (a collective): the same step gives the same weights.
    second.load_state(pickle.loads(Path(checkpoint).read_bytes()))
    second.train_step(batches[1], expected_step=1)
    out = {"weights": weights, "resumed": resumed, "refused": refused,
           "reloaded": second.weights() if rank == 0 else None,
           "stale": bool(stale.get("stale_step"))}
    second.close()
    return out


def whole_step(spec: dict[str, Any], batch: TrainBatch, options: dict[str, Any]
               ) -> tuple[dict[str, np.ndarray], float]:
    """The reference: one replicated single-rank learner's weights after the same step, and
    its gradient norm."""
    core = LearnerCore(spec, **options)
    metrics = core.train_step(batch)
    return core.weights(), float(metrics["grad_norm"])


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest absolute difference over every parameter (inf if the names differ)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def run_parity(spec: dict[str, Any], *, world: int = 2, batch: TrainBatch | None = None,
               options: dict[str, Any] | None = None, perturb: float = 0.0,
               tolerance: float = TOLERANCE,
               rank_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The equivalence check (module docstring).  ``options`` are LearnerCore keywords shared
    by both sides (seed, lr, max_grad_norm, ...); ``rank_options`` apply to the fsdp2 ranks
    only (``micro_batch_tokens``: the ranks accumulate micro-batches, the whole learner takes
    one pass).  Returns ``{max_abs_diff, equivalent, grad_norm: {whole, fsdp2}, bytes: [per
    rank]}``."""
    options = {"lr": 1e-4, "max_grad_norm": 1.0, **(options or {})}
    batch = batch or parity_batch(vocab_of(spec))
    whole, whole_norm = whole_step(spec, batch, options)
    ranks = spawn_ranks(world, fsdp_rank_step, spec, batch, {**options, **(rank_options or {})},
                        perturb)
    diff = max_abs_diff(whole, ranks[0]["weights"])
    norm_gap = abs(ranks[0]["grad_norm"] - whole_norm) / max(abs(whole_norm), 1e-30)
    return {"max_abs_diff": diff, "equivalent": diff <= tolerance and norm_gap <= tolerance,
            "grad_norm": {"whole": whole_norm, "fsdp2": ranks[0]["grad_norm"]},
            "bytes": [r["bytes"] for r in ranks]}


def vocab_of(spec: dict[str, Any]) -> int:
    if spec.get("hf"):
        from erlay.actors.model.hf import load_hf_config, resolve_model
        return int(load_hf_config(resolve_model(spec["hf"])).vocab_size)
    return int(spec["vocab_size"])


SMOKE = ("--hidden", "64", "--layers", "2", "--ffn", "128")


def model_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The tiny Llama's size options, ``--perturb`` and ``--smoke`` (the :data:`SMOKE` sizes;
    explicit options win over them), parsed; shared with ``bench/learner_scale.py``."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--perturb", type=float, default=0.0,
                        help="plant a drift on the last rank (equivalent must be false)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): " + " ".join(SMOKE))
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*SMOKE, *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="fsdp2 ranks")
    args = model_args(parser, argv)
    logging.basicConfig(level=logging.WARNING)
    from erlay.actors.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(tmp, "llama", hidden=args.hidden, layers=args.layers,
                                heads=args.heads, ffn=args.ffn, max_positions=64)
        spec = {"hf": str(path), "dtype": "float32"}
        result = run_parity(spec, world=args.world, perturb=args.perturb)
    # fp32: the ranks' shards together hold every parameter once.
    params = sum(held["param_bytes"] for held in result["bytes"]) // 4
    expected = args.perturb == 0
    norms = result["grad_norm"]
    print(f"model: {params:,} parameters (fp32), {args.world} fsdp2 ranks against one whole "
          f"learner, one GRPO step (lr 1e-4); perturb {args.perturb:g}")
    print(f"{'max_abs_diff':<16}{result['max_abs_diff']:>14.3g}  tolerance {TOLERANCE:g}")
    print(f"{'grad_norm':<16}{norms['whole']:>14.6g}  whole; {norms['fsdp2']:.6g} fsdp2")
    for rank, held in enumerate(result["bytes"]):
        print(f"{f'rank {rank} bytes':<16}" + ", ".join(f"{k} {v:,}" for k, v in held.items()))
    print(f"equivalent: {result['equivalent']} (expected {expected})")
    print(json.dumps({**result, "params": params, "world": args.world,
                      "perturb": args.perturb}))
    sys.exit(0 if result["equivalent"] is expected else 1)


if __name__ == "__main__":
    main()
