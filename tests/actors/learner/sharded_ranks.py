"""One rank of a sharded-checkpoint scenario, run as a process by the sharded checkpoint tests:
``python -m tests.actors.learner.sharded_ranks SCENARIO RANK WORLD PORT DIR [ARGS...]``.

The model is the erlay policy of the run directory ``DIR/run`` (its ``config.yaml`` names a
tiny HF Llama the test wrote), ``fully_shard``-ed per decoder layer and then the root over a
gloo group on 127.0.0.1, trained with AdamW on a made-up loss.  Rank 0
prints what the test checks, one line each; failpoints come from ``ERLAY_FAILPOINTS``.

Scenarios:

- ``save ROOT STEP...``: one train step, then for each ``STEP`` a save and a train step that
  changes every tensor while the save is in flight (after the barrier; rank 0 first writes
  the whole state of the last save to ``DIR/ref-STEP.pt``), then wait: prints ``committed
  [...]`` (every step committed, the last wait's included) or ``failed: <reason>``.
- ``load PATH REF [ROOT STEP]``: load the checkpoint ``PATH`` into a fresh sharded model and
  optimizer on this rank count; rank 0 prints ``equal`` when the whole model and optimizer
  state equal ``REF`` exactly, else ``differs: <key>``, then ``rng same|kept`` and the plain
  entries.  With ``ROOT STEP`` it saves what it loaded as ``STEP`` (and ``REF`` is rewritten
  by nobody: the state is the same).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist


def build(run_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from erlay.actors.config import load_config
    from erlay.actors.job.modelplan import plan_model
    from erlay.actors.model.build import build_policy
    model = build_policy(plan_model(load_config(run_dir / "config.yaml")).spec, seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.backbone.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    ids = torch.randint(0, model.cfg.vocab_size, (2, 8), generator=generator)
    positions = torch.arange(8).expand(2, 8)
    logits, _ = model(ids, positions, torch.ones_like(ids, dtype=torch.bool))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "step": step, "version": step + 10,
            "rng": {"torch": torch.get_rng_state()}, "model_config": {"layers": 2}}


def whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state on rank 0's host (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optimizer": optim_sd}


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return where + " (keys)"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return where + " (length)"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if a == b else where


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
         root: Path, steps: list[int]) -> None:
    """Save each of ``steps`` in turn, a train step after each (the third save of a
    checkpointer reuses its cached plan); the reference is the last step's."""
    from erlay.actors.learner.checkpoint import CheckpointSaveFailed
    from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer
    checkpointer = ShardedCheckpointer(root, keep=1)
    checkpointer.guard(optimizer)
    for step in steps:
        if step == steps[-1]:
            reference = whole(model, optimizer)
            if dist.get_rank() == 0:
                torch.save(reference, directory / f"ref-{step}.pt")
        checkpointer.save(step, app_state(model, optimizer, step), {"data_position": step * 8})
        train_step(model, optimizer, seed=step + 1)  # waits at the barrier, changes all
    try:
        committed = checkpointer.wait(timeout_s=120)
        report(f"committed {committed}")
    except CheckpointSaveFailed as exc:
        report(f"failed: {exc.reason}")
    checkpointer.close()


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path,
         reference: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from erlay.actors.learner.checkpoint.sharded import load_sharded
    rng_before = torch.get_rng_state()
    fresh = whole(model, optimizer)
    if dist.get_rank() == 0:  # what the check below says when nothing is loaded
        differs = first_difference(torch.load(reference, weights_only=False), fresh)
        report("fresh equal" if differs is None else "fresh differs")
    state = app_state(model, optimizer, step=-1)
    extra = load_sharded(path, state)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    loaded = whole(model, optimizer)
    if dist.get_rank() == 0:
        want = torch.load(reference, weights_only=False)
        found = first_difference(want, loaded)
        report("equal" if found is None else f"differs: {found}")
        same = torch.equal(state["rng"]["torch"], rng_before)
        report(f"rng {'kept' if same else 'restored'}")
        report(f"plain step={state['step']} version={state['version']} extra={extra}")


def report(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def main(argv: list[str]) -> None:
    scenario, rank, world, port, directory = argv[:5]
    logging.basicConfig(level=os.environ.get("SHARDED_RANKS_LOG", "WARNING"))
    os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    directory_path = Path(directory)
    model, optimizer = build(directory_path / "run")
    if scenario == "save":
        train_step(model, optimizer, seed=0)
        save(model, optimizer, directory_path, Path(argv[5]), [int(s) for s in argv[6:]])
    elif scenario == "load":
        load(model, optimizer, Path(argv[5]), Path(argv[6]))
        if len(argv) > 7:
            save(model, optimizer, directory_path, Path(argv[7]), [int(argv[8])])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
