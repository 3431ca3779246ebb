"""Benchmark of asynchronous learner checkpoints against a synchronous torch.save.

For a policy of about 10M and about 100M parameters, with real AdamW moments, it measures:

- ``host_copy_s``: ``LearnerCore.state()``, the learner's own copy of its state;
- ``sync_save_s``: ``torch.save`` of that state to disk plus fsync, the loop blocked;
- ``exposed_save_s``: ``AsyncCheckpointer.save()`` of that state, the loop blocked (staging
  copy and enqueue; the worker is already running and the previous save committed);
- ``first_exposed_save_s``: the same for the first save, which also makes the process group,
  starts the worker and maps the staging buffer;
- ``views_pause_s``: save() of live views of the weights and AdamW moments (no copy by the
  learner): the whole pause if the learner hands its state over under its lock;
- ``async_persist_s``: from save() until the checkpoint is committed (wait() returns);
- ``restore_s``: ``load()`` of the latest checkpoint, checksums verified;
- ``exposed_ratio`` = exposed / sync, ``exposed_ratio_with_copy`` = (host copy + exposed) /
  sync, the whole pause if the learner copies its state first, and ``views_pause_ratio`` =
  views pause / sync.

Medians of a few repeats.  Prints a table, then one JSON object as the last line (flat keys,
``..._10M`` and ``..._100M``; ``exposed_ratio`` is the worse size's).

    python bench/checkpoint.py [--sizes 10M,100M] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from erlay.actors.learner.checkpoint import AsyncCheckpointer, latest, load
from erlay.actors.learner.core import LearnerCore

# Decoder-only policies of ~10M and ~100M parameters (embedding and head are 2 * 8192 * d).
SIZES: dict[str, dict[str, int]] = {
    "10M": {"vocab_size": 8192, "d_model": 256, "n_layers": 8, "n_heads": 4, "d_ff": 1024,
            "max_seq_len": 128},
    "100M": {"vocab_size": 8192, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
             "max_seq_len": 128},
}


def primed_learner(model_config: dict[str, int]) -> LearnerCore:
    """A learner whose AdamW has taken one step, so its moments exist and are not zero."""
    core = LearnerCore(model_config, seed=0, torch_threads=1)
    generator = torch.Generator().manual_seed(1)
    for p in core.model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    core.optimizer.step()
    core.optimizer.zero_grad(set_to_none=True)
    return core


def state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def sync_save(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def bench_size(name: str, model_config: dict[str, int], repeats: int,
               workdir: Path) -> dict[str, float]:
    core = primed_learner(model_config)
    copies, syncs, exposed, persists, restores, views = [], [], [], [], [], []
    size = 0
    for r in range(repeats):
        seconds, state = timed(core.state)
        copies.append(seconds)
        size = state_bytes(state)
        path = workdir / f"sync-{name}-{r}.pt"
        syncs.append(timed(lambda state=state, path=path: sync_save(state, path))[0])
        path.unlink()
        del state
        gc.collect()
    root = workdir / f"async-{name}"
    with AsyncCheckpointer(root, keep=2) as checkpointer:
        first = checkpointer.save(0, core.state(), {"bench": name})
        checkpointer.wait()
        for r in range(1, repeats + 1):
            state = core.state()
            started = time.perf_counter()
            exposed.append(checkpointer.save(r, state, {"bench": name}))
            del state  # save() has staged it
            checkpointer.wait()
            persists.append(time.perf_counter() - started)
            gc.collect()
        # The same state without the learner's copy: its small fields, then references to
        # the live weights and moments (an optimizer's state_dict() holds no copies).
        live = {**core.state(), "model": core.model.state_dict(),
                "optimizer": core.optimizer.state_dict()}
        for r in range(repeats + 1, 2 * repeats + 1):
            views.append(checkpointer.save(r, live, {"bench": name}))
            checkpointer.wait()
        del live
        gc.collect()
    info = latest(root)
    assert info is not None and info.step == 2 * repeats
    for _ in range(repeats):
        seconds, loaded = timed(lambda: load(info.path))
        restores.append(seconds)
        del loaded
        gc.collect()
    shutil.rmtree(root)
    med = statistics.median
    return {"params": float(core.model.num_parameters()), "state_mb": size / 2**20,
            "host_copy_s": med(copies), "sync_save_s": med(syncs),
            "first_exposed_save_s": first, "exposed_save_s": med(exposed),
            "async_persist_s": med(persists), "restore_s": med(restores),
            "views_pause_s": med(views), "exposed_ratio": med(exposed) / med(syncs),
            "exposed_ratio_with_copy": (med(copies) + med(exposed)) / med(syncs),
            "views_pause_ratio": med(views) / med(syncs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="erlay-bench-checkpoint-", dir=args.dir))
    results: dict[str, dict[str, float]] = {}
    try:
        for name in args.sizes.split(","):
            results[name] = bench_size(name, SIZES[name], args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    columns = ["params", "state_mb", "host_copy_s", "sync_save_s", "first_exposed_save_s",
               "exposed_save_s", "views_pause_s", "async_persist_s", "restore_s",
               "exposed_ratio", "exposed_ratio_with_copy", "views_pause_ratio"]
    print(f"{'':24}" + "".join(f"{name:>12}" for name in results))
    for c in columns:
        print(f"{c:24}" + "".join(f"{row[c]:>12.4g}" for row in results.values()))
    summary: dict[str, float] = {f"{key}_{name}": round(value, 4)
                                 for name, row in results.items() for key, value in row.items()}
    summary["exposed_ratio"] = round(max(r["exposed_ratio"] for r in results.values()), 4)
    for key in ("exposed_ratio_with_copy", "views_pause_ratio"):
        summary[key] = round(max(r[key] for r in results.values()), 4)
    summary["repeats"] = args.repeats
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
