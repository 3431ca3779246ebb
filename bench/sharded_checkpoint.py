"""Benchmark of sharded asynchronous checkpoints against a synchronous sharded save, on 2 ranks.

A stack of ``--layers`` Linear(``--width``, ``--width``) layers (10.5M parameters by default),
``fully_shard``-ed per layer and then the root over a 2-process gloo group on 127.0.0.1, with
real AdamW moments (state: about 12 bytes per parameter, half on each rank), torch limited to
1 thread per rank, files under ``--dir``.  Per repeat, interleaved, and per rank:

- ``save_return_s``: ``get_state_dict(model, optimizer)`` plus :meth:`ShardedCheckpointer.save`,
  call to return (agreement on the directory, DCP planning or its cached plan; the worker
  idle, the previous save committed; after two warm-up saves, so the plan is cached);
- ``state_dict_s``: the ``get_state_dict`` part of ``save_return_s``;
- ``barrier_wait_s``: how long the next train step's ``optimizer.step()`` waited at the
  guard for the background snapshot to finish copying (forward and backward overlap it);
- ``exposed_s`` = ``save_return_s + barrier_wait_s``: the time the save blocked training;
- ``commit_s``: save() call until :meth:`ShardedCheckpointer.wait` returns, the step in
  between included (written, fsynced, agreed, manifest written, committed);
- ``sync_save_s``: ``torch.distributed.checkpoint.save`` of the same state dicts (files
  fsynced, ``.metadata`` written), call to return: training blocked for the whole write;
- ``step_s``: a train step with no save in flight.

A figure per repeat is the maximum over the ranks (the slowest rank holds the others at the
next collective).  Printed: a table, then as the last line one JSON object with each figure's
median, min and max over the repeats, and ``exposed_ratio`` = median exposed / median sync.

Usage: ``python bench/sharded_checkpoint.py [--repeats 5] [--width 1024] [--layers 10]``;
``--smoke`` is CI's smoke size (``--repeats 1 --width 64 --layers 2``: the same 2 ranks,
per-layer sharding, warm-up saves and sync save, on 8k parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FIGURES = ("state_dict_s", "save_return_s", "barrier_wait_s", "exposed_s", "commit_s",
           "sync_save_s", "step_s")


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer
    torch.set_num_threads(1)
    os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())  # DTensors: the global count
    x = torch.randn(8, args.width)

    def step() -> float:
        started = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "step": 0}

    step()
    directory = Path(args.dir)
    group = dist.new_group(backend="gloo")
    checkpointer = ShardedCheckpointer(directory / "async", keep=1)
    checkpointer.guard(optimizer)
    # The first two saves start the worker, map the staging buffer and plan in full; the
    # repeats measure the steady state (the cached plan).
    for warmup in (-2, -1):
        checkpointer.save(warmup + 2, state())
        step()
        checkpointer.wait()
    rows: list[dict[str, float]] = []
    for repeat in range(2, args.repeats + 2):
        row = {"step_s": step()}
        dist.barrier(group)  # as before the sync save: no rank's lag counts as exposed
        started = time.perf_counter()
        saved = state()
        row["state_dict_s"] = time.perf_counter() - started
        checkpointer.save(repeat, saved)
        row["save_return_s"] = time.perf_counter() - started
        step()
        snapshot = checkpointer.last_snapshot
        row["barrier_wait_s"] = snapshot.waited_s if snapshot is not None else 0.0
        row["exposed_s"] = row["save_return_s"] + row["barrier_wait_s"]
        checkpointer.wait()
        row["commit_s"] = time.perf_counter() - started
        dist.barrier(group)
        started = time.perf_counter()
        sync_state = state()
        dcp.save({"model": sync_state["model"], "optimizer": sync_state["optimizer"]},
                 checkpoint_id=str(directory / f"sync-{repeat}"), process_group=group)
        row["sync_save_s"] = time.perf_counter() - started
        rows.append(row)
    checkpointer.close()
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, rows, group=group)
    if args.rank == 0:
        worst = [{k: max(r[i][k] for r in gathered) for k in FIGURES}
                 for i in range(args.repeats)]
        print(json.dumps({"params": params, "rows": worst}), flush=True)
    dist.destroy_process_group()


def summary(params: int, rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": 2, "params": params, "repeats": len(rows),
                           "state_mb": round(params * 12 / 2**20, 1)}
    for key in FIGURES:
        values = [r[key] for r in rows]
        out[key] = {"median": round(statistics.median(values), 4),
                    "min": round(min(values), 4), "max": round(max(values), 4)}
    out["exposed_ratio"] = round(out["exposed_s"]["median"] / out["sync_save_s"]["median"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke size: --repeats 1 --width 64 --layers 2")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.width, args.layers = 1, 64, 2
    if args.rank is not None:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="erlay-sharded-bench-",
                                     dir=args.dir) as directory:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = [sys.executable, __file__, "--repeats", str(args.repeats), "--width",
                  str(args.width), "--layers", str(args.layers), "--dir", directory,
                  "--port", str(port)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        procs = [subprocess.Popen([*common, "--rank", str(r)], env=env,
                                  stdout=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    figures = summary(result["params"], result["rows"])
    print(f"{'figure':<16}{'median':>10}{'min':>10}{'max':>10}")
    for key in FIGURES:
        f = figures[key]
        print(f"{key:<16}{f['median']:>10.4f}{f['min']:>10.4f}{f['max']:>10.4f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
