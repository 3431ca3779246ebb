"""Benchmark of asynchronous learner checkpoints against a synchronous torch.save.

For a policy of about 10M and about 100M parameters (``SIZES``; ``state_mb`` is the state's
size: fp32 weights plus both AdamW moments, about 12 bytes per parameter), with real AdamW
moments, the learner's torch limited to 1 thread, the checkpoint files under ``--dir``, it
measures, from what event to what event:

- ``host_copy_s``: ``LearnerCore.state()`` called until it returns (the learner's own copy of
  its state);
- ``sync_save_s``: ``torch.save`` of that state to a file, from the call until ``fsync``
  returns: the loop blocked for the whole write;
- ``exposed_save_s``: ``AsyncCheckpointer.save()`` of that state, from the call until it
  returns, with the worker already running and the previous save committed (staging copy
  and enqueue): the loop blocked by an async save;
- ``first_exposed_save_s``: the same for the first save of a checkpointer, which also makes
  the process group, starts the worker and maps the staging buffer (one per run);
- ``views_pause_s``: ``save()`` of live views of the weights and AdamW moments (no copy by the
  learner), call to return: the whole pause if the learner hands its state over under its
  lock;
- ``async_persist_s``: from the call to ``save()`` until ``wait()`` returns, i.e. until the
  worker has written, fsynced and committed the checkpoint, with nothing else queued;
- ``restore_s``: ``load()`` of the latest checkpoint, call to return, checksums verified;
- ``exposed_ratio`` = exposed / sync, ``exposed_ratio_with_copy`` = (host copy + exposed) /
  sync, the whole pause if the learner copies its state first, and ``views_pause_ratio`` =
  views pause / sync.

Within a run each figure is the median of ``--repeats`` saves (a ratio is the ratio of those
medians).  ``--runs`` repeats the whole run, each with a fresh learner and checkpointer; every
figure is then reported as ``{"median", "min", "max", "runs"}`` over the runs, because a target
met by one lucky run is a miss.  Prints a table that names each figure's events, then one
JSON object as the last line: keys ``<figure>_10M`` and ``<figure>_100M`` (the same meaning as
before ``--runs``: a run's median of its repeats), and ``exposed_ratio``,
``exposed_ratio_with_copy`` and ``views_pause_ratio``, each the worse size's in a run;
``params_*`` and ``state_mb_*`` are plain numbers; ``load_avg_1m`` is the 1-minute load
average at the start and the end.  Target: ``exposed_ratio`` <= 0.02.

    python bench/checkpoint.py [--sizes 10M,100M] [--repeats 3] [--runs 3] [--dir /tmp]
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


def spread(values: list[float], digits: int = 4) -> dict[str, Any]:
    """Median, min and max over runs: the form every timed figure is reported in."""
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "runs": len(values)}


# (figure, what it measures: from what event to what event).
WHAT: list[tuple[str, str]] = [
    ("host_copy_s", "LearnerCore.state() call -> return (learner copies its state)"),
    ("sync_save_s", "torch.save call -> fsync returns (loop blocked for the write)"),
    ("first_exposed_save_s", "first save() call -> return (+ worker start, buffer map)"),
    ("exposed_save_s", "save() call -> return, worker idle, previous save committed"),
    ("views_pause_s", "save() of live weight/moment views call -> return (no copy)"),
    ("async_persist_s", "save() call -> wait() returns (written, fsynced, committed)"),
    ("restore_s", "load() call -> return, checksums verified"),
    ("exposed_ratio", "exposed_save_s / sync_save_s (target <= 0.02)"),
    ("exposed_ratio_with_copy", "(host_copy_s + exposed_save_s) / sync_save_s"),
    ("views_pause_ratio", "views_pause_s / sync_save_s"),
]
WORST_OF_SIZES = ("exposed_ratio", "exposed_ratio_with_copy", "views_pause_ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=3, help="saves per run (median)")
    parser.add_argument("--runs", type=int, default=3, help="whole runs (median, min..max)")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    names = args.sizes.split(",")
    began, load0 = time.perf_counter(), os.getloadavg()[0]
    runs: list[dict[str, dict[str, float]]] = []
    for _ in range(args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="erlay-bench-checkpoint-", dir=args.dir))
        try:
            runs.append({name: bench_size(name, SIZES[name], args.repeats, workdir)
                         for name in names})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    load1 = os.getloadavg()[0]

    summary: dict[str, Any] = {}
    for name in names:
        summary[f"params_{name}"] = runs[0][name]["params"]
        summary[f"state_mb_{name}"] = round(runs[0][name]["state_mb"], 1)
        for key, _ in WHAT:
            summary[f"{key}_{name}"] = spread([run[name][key] for run in runs])
    for key in WORST_OF_SIZES:
        summary[key] = spread([max(run[name][key] for name in names) for run in runs])
    summary.update({"repeats": args.repeats, "runs": args.runs,
                    "load_avg_1m": [round(load0, 2), round(load1, 2)],
                    "wall_s": round(time.perf_counter() - began, 1)})

    print(f"learner state per size ({args.repeats} saves per run, median; {args.runs} runs, "
          f"median (min-max)); torch 1 thread; files under {args.dir}; "
          f"1-min load average {load0:.2f} -> {load1:.2f}")
    print(f"{'figure':24}" + "".join(f"{name:>26}" for name in names) + "  what it measures")
    print(f"{'params / state MB':24}" + "".join(
        f"{summary[f'params_{n}'] / 1e6:>16.1f}M / {summary[f'state_mb_{n}']:>6.0f}"
        for n in names) + "  fp32 weights + AdamW moments")
    for key, what in WHAT:
        cells = []
        for name in names:
            s = summary[f"{key}_{name}"]
            cells.append(f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})")
        print(f"{key:24}" + "".join(f"{c:>26}" for c in cells) + f"  {what}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
