"""Benchmark of the learner's asynchronous checkpoints against a synchronous torch.save.

For a policy of about 10M and about 100M parameters (``SIZES``; ``state_mb`` is the state's
size: fp32 weights plus both AdamW moments, about 12 bytes per parameter), with real AdamW
moments, the learner's torch limited to 1 thread, the checkpoint files under ``--dir``, it
drives the learner's real checkpoint path: :class:`~erlay.actors.learner.rank.Learner`'s
``save_checkpoint()`` (live views of the state, handed under the learner's lock to
:class:`~erlay.actors.learner.checkpoint.AsyncCheckpointer`, whose background snapshot copies
them while the next ``train_step()`` computes; that step's optimizer waits for the snapshot
at the guard).  Train steps use a batch of ``--batch-rows`` rows of 16 prompt and 16
completion tokens.  It measures, from what event to what event:

- ``host_copy_s``: ``LearnerCore.state()`` call to return (a full host copy of the state:
  what a save blocked for before the background snapshot);
- ``sync_save_s``: ``torch.save`` of that state to a file, from the call until ``fsync``
  returns: the loop blocked for the whole write;
- ``first_exposed_save_s``: the first ``save_checkpoint()`` of a learner, call to return
  (also makes the process group, starts the worker, maps the staging buffer; one per run);
- ``save_return_s``: ``save_checkpoint()`` call to return, the worker idle and the previous
  save committed;
- ``barrier_wait_s``: the time the next ``train_step()``'s optimizer step waited at the
  guard for the snapshot to finish copying;
- ``exposed_save_s`` = ``save_return_s + barrier_wait_s``: the whole time a save blocked
  training (from the save call until training may move the weights again);
- ``immediate_exposed_s``: ``save_checkpoint()`` call until ``wait_snapshot()`` returns
  when called at once: the pause if the weights were modified right after the save, with
  no compute to overlap (the worst case);
- ``snapshot_copy_s`` / ``snapshot_cpu_s``: the background copy's wall time, and the CPU
  time its thread used (what the overlap costs a host with no idle core);
- ``step_s``: ``train_step()`` call to return with no save in flight; ``step_after_save_s``:
  the same for the step right after a save (interleaved with the former);
  ``step_delta_s`` = their difference (includes the barrier wait and any contention with
  the copy; noisy: a step is seconds long);
- ``async_persist_s``: ``save_checkpoint()`` call until ``wait_checkpoints()`` returns
  (written, fsynced, committed), with no train step in between;
- ``restore_s``: ``load()`` of the latest checkpoint, call to return, checksums verified;
- ``exposed_ratio`` = exposed / sync (target <= 0.02), ``exposed_ratio_immediate`` =
  immediate exposed / sync, ``step_delta_ratio`` = step delta / sync.

Within a run each figure is the median of ``--repeats`` saves (a ratio is the ratio of those
medians).  ``--runs`` repeats the whole run, each with a fresh learner and checkpointer; every
figure is then reported as ``{"median", "min", "max", "runs"}`` over the runs, because a target
met by one lucky run is a miss.  Prints a table that names each figure's events, then one
JSON object as the last line: keys ``<figure>_10M`` and ``<figure>_100M`` (a run's median of
its repeats), and ``exposed_ratio``, ``exposed_ratio_immediate`` and ``step_delta_ratio``,
each the worse size's in a run; ``params_*`` and ``state_mb_*`` are plain numbers;
``load_avg_1m`` is the 1-minute load average at the start and the end.

With ``--storage s3`` the run's home is an S3 bucket on a real S3 API server (moto's, on
loopback, started by the bench; ``tests/s3server.py``): the learner commits each checkpoint
on local disk and its mirror (:mod:`erlay.actors.storage.mirror`, the shipped default but a
1 s tick) uploads it in the background while training goes on, so every figure above is
measured with the uploads running.  ``async_persist_s`` then runs until the checkpoint is
uploaded too (``wait_checkpoints()`` settles the mirror), and three figures are added:
``uploaded_mb`` (what the mirror sent in a run), ``upload_lag_s_p50`` and ``upload_lag_s_max``
(per uploaded file, upload end minus the file's last change: how much a crash of the
machine at that moment would have lost, in seconds).

    python bench/checkpoint.py [--sizes 10M,100M] [--repeats 3] [--runs 3] [--dir /tmp]
                               [--storage local|s3] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from runstats import spread  # bench/ (a script's own folder is on sys.path)

from erlay.actors.learner.checkpoint import latest, load
from erlay.actors.learner.core import TrainBatch
from erlay.actors.learner.rank import Learner

# Decoder-only policies of ~10M and ~100M parameters (embedding and head are 2 * 8192 * d).
SIZES: dict[str, dict[str, int]] = {
    "10M": {"vocab_size": 8192, "d_model": 256, "n_layers": 8, "n_heads": 4, "d_ff": 1024,
            "max_seq_len": 128},
    "100M": {"vocab_size": 8192, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
             "max_seq_len": 128},
    # CI's smoke size.
    "1M": {"vocab_size": 1024, "d_model": 128, "n_layers": 2, "n_heads": 2, "d_ff": 256,
           "max_seq_len": 64},
}
TOKENS = 16  # prompt and completion tokens per row


def primed_learner(model_config: dict[str, int], checkpoint_dir: Path,
                   remote_url: str | None = None) -> Learner:
    """A learner rank whose AdamW has taken one step, so its moments exist and are not
    zero; it checkpoints into ``checkpoint_dir`` (keep 2), and with ``remote_url`` its
    mirror uploads them there (a 1 s tick)."""
    learner = Learner(model_config, seed=0, torch_threads=1,
                      checkpoint_dir=str(checkpoint_dir), checkpoint_keep=2,
                      remote_url=remote_url, upload_every_s=1.0)
    generator = torch.Generator().manual_seed(1)
    for p in learner.model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return learner


def batch(learner: Learner, rows: int, seed: int) -> TrainBatch:
    """``rows`` random rows in groups of two, on-policy for the learner's version."""
    rng = random.Random(seed)
    vocab = learner.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(TOKENS)] for _ in range(rows)]
    completions = [[rng.randrange(3, vocab) for _ in range(TOKENS)] for _ in range(rows)]
    v = learner.version()
    return TrainBatch(prompt_ids=prompts, completion_ids=completions,
                      behaviour_logprobs=[[-5.0] * TOKENS for _ in range(rows)],
                      versions=[[v] * TOKENS for _ in range(rows)],
                      rewards=[float(i % 2) for i in range(rows)], group_size=2,
                      rollout_ids=[f"r-{seed}-{i}" for i in range(rows)])


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


def bench_size(name: str, model_config: dict[str, int], repeats: int, rows: int,
               workdir: Path, remote_url: str | None = None) -> dict[str, float]:
    root = workdir / f"async-{name}" / "checkpoints"   # the mirror uploads checkpoints/
    learner = primed_learner(model_config, root, remote_url)
    fig: dict[str, list[float]] = {key: [] for key, _ in WHAT}
    size = 0
    for r in range(repeats):
        seconds, state = timed(learner.state)
        fig["host_copy_s"].append(seconds)
        size = state_bytes(state)
        path = workdir / f"sync-{name}-{r}.pt"
        fig["sync_save_s"].append(timed(lambda state=state, path=path: sync_save(state, path))[0])
        path.unlink()
        del state
        gc.collect()
    try:
        fig["first_exposed_save_s"].append(timed(learner.save_checkpoint)[0])
        learner.wait_checkpoints()
        checkpointer = learner._checkpointer
        assert checkpointer is not None
        for r in range(repeats):
            # Interleaved: a step with no save in flight, then a save and the next step.
            fig["step_s"].append(timed(lambda r=r: learner.train_step(
                batch(learner, rows, 2 * r)))[0])
            next_batch = batch(learner, rows, 2 * r + 1)
            returned = timed(learner.save_checkpoint)[0]
            fig["step_after_save_s"].append(timed(lambda b=next_batch: learner.train_step(b))[0])
            snapshot = checkpointer.last_snapshot
            assert snapshot is not None and snapshot.done
            fig["save_return_s"].append(returned)
            fig["barrier_wait_s"].append(snapshot.waited_s)
            fig["exposed_save_s"].append(returned + snapshot.waited_s)
            fig["snapshot_copy_s"].append(snapshot.copy_s)
            fig["snapshot_cpu_s"].append(snapshot.cpu_s)
            learner.wait_checkpoints()
            gc.collect()
        for _ in range(repeats):
            # No compute to overlap: the barrier right after the save, then the commit.
            started = time.perf_counter()
            learner.save_checkpoint()
            checkpointer.wait_snapshot()
            fig["immediate_exposed_s"].append(time.perf_counter() - started)
            learner.wait_checkpoints()
            fig["async_persist_s"].append(time.perf_counter() - started)
            learner.train_step(batch(learner, rows, 99))  # a new step to save next
            gc.collect()
        upload = learner.wait_checkpoints().get("upload")
    finally:
        learner.erlay_terminate()
    if remote_url is not None:
        assert upload is not None and upload["ok"], upload
        fig["uploaded_mb"] = [upload["bytes"] / 2**20]
        fig["upload_lag_s_p50"] = [upload["lag_s_p50"]]
        fig["upload_lag_s_max"] = [upload["lag_s_max"]]
    info = latest(root)
    assert info is not None and info.step == learner.status()["step"] - 1
    for _ in range(repeats):
        seconds, loaded = timed(lambda: load(info.path))
        fig["restore_s"].append(seconds)
        del loaded
        gc.collect()
    shutil.rmtree(root.parent)
    med = {key: statistics.median(values) for key, values in fig.items() if values}
    med["step_delta_s"] = med["step_after_save_s"] - med["step_s"]
    med["exposed_ratio"] = med["exposed_save_s"] / med["sync_save_s"]
    med["exposed_ratio_immediate"] = med["immediate_exposed_s"] / med["sync_save_s"]
    med["step_delta_ratio"] = med["step_delta_s"] / med["sync_save_s"]
    return {"params": float(learner.model.num_parameters()), "state_mb": size / 2**20, **med}


# (figure, what it measures: from what event to what event).
WHAT: list[tuple[str, str]] = [
    ("host_copy_s", "LearnerCore.state() call -> return (a full host copy)"),
    ("sync_save_s", "torch.save call -> fsync returns (loop blocked for the write)"),
    ("first_exposed_save_s", "first save_checkpoint() call -> return (+ worker start)"),
    ("save_return_s", "save_checkpoint() call -> return, previous save committed"),
    ("barrier_wait_s", "next step's optimizer waits at the guard for the snapshot"),
    ("exposed_save_s", "save_return_s + barrier_wait_s (training blocked by a save)"),
    ("immediate_exposed_s", "save_checkpoint() -> wait_snapshot() at once (no overlap)"),
    ("snapshot_copy_s", "background copy of the state, start -> end (wall)"),
    ("snapshot_cpu_s", "CPU time of the background copy's thread"),
    ("step_s", "train_step() call -> return, no save in flight"),
    ("step_after_save_s", "train_step() call -> return, right after a save"),
    ("step_delta_s", "step_after_save_s - step_s (noisy)"),
    ("async_persist_s", "save_checkpoint() -> wait_checkpoints() returns (committed)"),
    ("restore_s", "load() call -> return, checksums verified"),
    ("exposed_ratio", "exposed_save_s / sync_save_s (target <= 0.02)"),
    ("exposed_ratio_immediate", "immediate_exposed_s / sync_save_s (worst case)"),
    ("step_delta_ratio", "step_delta_s / sync_save_s (noisy)"),
]
UPLOAD: list[tuple[str, str]] = [
    ("uploaded_mb", "what the learner's mirror uploaded in the run (--storage s3)"),
    ("upload_lag_s_p50", "per file: upload end - last change (p50)"),
    ("upload_lag_s_max", "per file: upload end - last change (max: a crash's loss)"),
]
WORST_OF_SIZES = ("exposed_ratio", "exposed_ratio_immediate", "step_delta_ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=3, help="saves per run (median)")
    parser.add_argument("--runs", type=int, default=3, help="whole runs (median, min..max)")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows per train step")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--storage", choices=("local", "s3"), default="local",
                        help="s3: the run's home is a bucket on moto's S3 server (loopback)")
    parser.add_argument("--smoke", action="store_true", help="CI's smallest run: the 1M "
                        "size, 1 repeat, 1 run")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.runs = "1M", 1, 1
    logging.basicConfig(level=logging.WARNING)
    names = args.sizes.split(",")
    with contextlib.ExitStack() as stack:
        remote = None
        if args.storage == "s3":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.s3server import aws_env, s3_server
            server = stack.enter_context(s3_server())
            stack.enter_context(aws_env(server))
            remote = server.url("bench")
        began, load0 = time.perf_counter(), os.getloadavg()[0]
        runs: list[dict[str, dict[str, float]]] = []
        for i in range(args.runs):
            workdir = Path(tempfile.mkdtemp(prefix="erlay-bench-checkpoint-", dir=args.dir))
            try:
                runs.append({name: bench_size(name, SIZES[name], args.repeats,
                                              args.batch_rows, workdir,
                                              f"{remote}/run-{i}-{name}" if remote else None)
                             for name in names})
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        load1 = os.getloadavg()[0]
    what = WHAT + (UPLOAD if args.storage == "s3" else [])

    summary: dict[str, Any] = {}
    for name in names:
        summary[f"params_{name}"] = runs[0][name]["params"]
        summary[f"state_mb_{name}"] = round(runs[0][name]["state_mb"], 1)
        for key, _ in what:
            summary[f"{key}_{name}"] = spread([run[name][key] for run in runs], digits=4)
    for key in WORST_OF_SIZES:
        summary[key] = spread([max(run[name][key] for name in names) for run in runs], digits=4)
    summary.update({"storage": args.storage, "repeats": args.repeats, "runs": args.runs,
                    "load_avg_1m": [round(load0, 2), round(load1, 2)],
                    "wall_s": round(time.perf_counter() - began, 1)})

    print(f"learner state per size ({args.repeats} saves per run, median; {args.runs} runs, "
          f"median (min-max)); torch 1 thread; {args.batch_rows} rows per step; "
          f"files under {args.dir}; storage {args.storage}; "
          f"1-min load average {load0:.2f} -> {load1:.2f}")
    print(f"{'figure':24}" + "".join(f"{name:>26}" for name in names) + "  what it measures")
    print(f"{'params / state MB':24}" + "".join(
        f"{summary[f'params_{n}'] / 1e6:>16.1f}M / {summary[f'state_mb_{n}']:>6.0f}"
        for n in names) + "  fp32 weights + AdamW moments")
    for key, meaning in what:
        cells = []
        for name in names:
            s = summary[f"{key}_{name}"]
            cells.append(f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})")
        print(f"{key:24}" + "".join(f"{c:>26}" for c in cells) + f"  {meaning}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
