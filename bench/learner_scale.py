"""Benchmark of what ``learner.backend: fsdp2`` saves: the bytes each learner rank holds, on 1
rank and on 2, and the equivalence of the sharded step with one whole learner's.

A random-initialised Llama-architecture HF model (``--hidden``, ``--layers``, ``--ffn``; a few
million parameters by default) is written to a temporary directory.  Each fsdp2 rank is its
own process in a gloo group on loopback (`spawn_ranks` in `bench/fsdp_parity.py`);
each takes one GRPO train step (fp32, AdamW) on the same deterministic batch.  Measured after
that optimizer step, from the rank's local shards (``DTensor.to_local()``;
:func:`erlay.actors.learner.fsdp.local_bytes`):

- ``param_bytes``: the parameters this rank holds between steps (its shards);
- ``grad_bytes``: the gradients it holds (sharded like the parameters);
- ``optim_bytes``: AdamW's moments (``exp_avg``, ``exp_avg_sq``; the scalar step counts are
  left out).

The table (not the JSON line) also shows the start-up peak of parameter bytes on a rank's
device, 2 ranks, accounted from FSDP2's placement rule
(`fsdp_rank_startup` in `bench/fsdp_parity.py`; on this CPU the device is the
host, so it is not a memory measurement): built on the host, the device holds the shards
made so far plus one unit (a block, or the root) whole; built on the device (before), the
whole model from the constructor on, plus the shards.

Per-rank figures are the maximum over ranks.  Not counted: rank 0's host copy of the whole
weights, which serves publishing (shown in the table as ``host copy``), and the transient
gather of one block's parameters during its forward and backward passes.

``equivalent``: the 2-rank step against one whole, replicated learner's step on the same
batch: every parameter's max abs difference <= 1e-5, and the pre-clip gradient norms equal to
1e-5 relative, at learning rate 1e-4 (why: `bench/fsdp_parity.py`;
`run_parity` there).  ``--perturb EPS`` plants a drift (the
last rank adds EPS to its weights before the step), which must make it false.

Prints a table, then one JSON object as the last line:
``{"ranks_1": {"param_bytes", "grad_bytes", "optim_bytes"}, "ranks_2": {...},
"equivalent": bool}``.  Bytes are deterministic for a given shape; run it again for the
timing of the step, which this benchmark does not report.

    python bench/learner_scale.py [--hidden 256] [--layers 4] [--ffn 1024] [--perturb 0]
    python bench/learner_scale.py --smoke [--perturb 0]   # the smallest size (CI, tests)

``--smoke`` is ``--hidden 64 --layers 2 --ffn 128`` (options given explicitly win): the same
figures of a tiny model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from erlay.actors.model.tiny import write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_parity import (  # bench/ is on sys.path when run as a script
    fsdp_rank_startup,
    fsdp_rank_step,
    model_args,
    parity_batch,
    run_parity,
    spawn_ranks,
    vocab_of,
)

KEYS = ("param_bytes", "grad_bytes", "optim_bytes")


def per_rank_max(ranks: list[dict[str, int]]) -> dict[str, int]:
    """The maximum over ranks of each figure."""
    return {k: max(r[k] for r in ranks) for k in KEYS}


def measure(hidden: int, layers: int, ffn: int, heads: int, perturb: float) -> dict[str, Any]:
    """The figures of the module docstring, plus the table's extras."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(tmp, "llama", hidden=hidden, layers=layers, heads=heads,
                                ffn=ffn, max_positions=64)
        spec = {"hf": str(path), "dtype": "float32"}
        batch = parity_batch(vocab_of(spec))
        options = {"lr": 1e-4, "max_grad_norm": 1.0}
        one = spawn_ranks(1, fsdp_rank_step, spec, batch, options, 0.0)
        two = run_parity(spec, world=2, batch=batch, options=options, perturb=perturb)
        startup = spawn_ranks(2, fsdp_rank_startup, spec, options)
    weights = one[0]["weights"]
    return {"ranks_1": per_rank_max([one[0]["bytes"]]), "ranks_2": per_rank_max(two["bytes"]),
            "equivalent": bool(two["equivalent"]), "max_abs_diff": two["max_abs_diff"],
            "params": sum(v.size for k, v in weights.items()),
            "host_copy_bytes": sum(v.nbytes for v in weights.values()),
            # Before: the whole model on the device from the constructor, plus the shards.
            "startup_before": max(r["whole"] + r["shards"] for r in startup),
            "startup_peak": max(r["peak"] for r in startup)}


def table(result: dict[str, Any]) -> str:
    one, two = result["ranks_1"], result["ranks_2"]
    lines = [f"model: {result['params']:,} parameters (fp32); per rank = max over ranks",
             f"{'bytes per rank':<16}{'1 rank':>14}{'2 ranks':>14}{'2 / 1':>8}"]
    for key in KEYS:
        lines.append(f"{key:<16}{one[key]:>14,}{two[key]:>14,}{two[key] / one[key]:>8.3f}")
    lines.append(f"{'host copy':<16}{result['host_copy_bytes']:>14,}"
                 f"{result['host_copy_bytes']:>14,}  (rank 0 only: serves publishing)")
    lines.append(f"start-up peak on the device, 2 ranks (parameter bytes, accounted): "
                 f"{result['startup_peak']:,} built on the host, "
                 f"{result['startup_before']:,} built on the device (before)")
    lines.append(f"equivalent: {result['equivalent']} (max abs diff "
                 f"{result['max_abs_diff']:.3g}, tolerance 1e-5)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = model_args(parser, argv)
    logging.basicConfig(level=logging.WARNING)
    result = measure(args.hidden, args.layers, args.ffn, args.heads, args.perturb)
    print(table(result))
    print(json.dumps({"ranks_1": result["ranks_1"], "ranks_2": result["ranks_2"],
                      "equivalent": result["equivalent"]}))


if __name__ == "__main__":
    main()
