"""Reading sharded checkpoints (:mod:`erlay.actors.learner.checkpoint.sharded` writes them):
into a sharded learner on any rank count (:func:`load_sharded`), or whole into one process
without a process group (:func:`load_full_model`, what ``erlay export`` uses).

A sharded checkpoint directory holds ``manifest.json`` (``"layout": "sharded"``,
``world_size``, each file's size and sha256, ``extra``), DCP's ``.metadata`` and
``__<rank>_0.distcp`` files with the ``"model"`` and ``"optimizer"`` state dicts, and one
``rank-XXXXX.pt`` per saving rank with that rank's plain entries (``torch.save`` of a dict,
read back with ``weights_only=True``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist

from erlay.actors.learner.checkpoint.format import (
    REPLICATED,
    CheckpointInvalid,
    read_manifest,
    verify_files,
)

__all__ = ["DCP_KEYS", "checkpoint_group", "load_full_model", "load_sharded", "rank_file"]

log = logging.getLogger("erlay.checkpoint")

DCP_KEYS = ("model", "optimizer")  # saved with torch.distributed.checkpoint, resharded on load
RNG_KEY = "rng"                    # per rank: restored only on the rank count it was saved on

_GROUPS: dict[tuple[int, float], Any] = {}


def rank_file(rank: int) -> str:
    """The file of one saving rank's plain (non-DCP) entries."""
    return f"rank-{rank:05d}.pt"


def checkpoint_group(timeout_s: float) -> Any:
    """The checkpoints' gloo group over all ranks of the default group, made collectively by
    the first caller in this process (per default group and timeout).  Checkpoint
    collectives run there, on the CPU, apart from the training group's sequence."""
    key = (id(dist.distributed_c10d._get_default_group()), timeout_s)
    # A group destroyed since (destroy_process_group ends them all) is made again: a new
    # default group may reuse the old one's id.
    if key not in _GROUPS or _GROUPS[key] not in dist.distributed_c10d._world.pg_map:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _GROUPS[key]


def forget_groups() -> None:
    """Drop the cached groups (their default group is being destroyed)."""
    _GROUPS.clear()


def sharded_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the sharded checkpoint ``path``; :class:`CheckpointInvalid` for an
    incomplete one or a replicated one."""
    manifest = read_manifest(path)
    if manifest.get("layout", REPLICATED) == REPLICATED:
        raise CheckpointInvalid(path, "it is a replicated checkpoint (state.pt), not a "
                                      "sharded one; load it with checkpoint_format.load")
    return manifest


def load_sharded(path: Path, app_state: dict[str, Any], *, verify: bool = True,
                 timeout_s: float = 600.0) -> dict[str, Any]:
    """Collective (every rank of the default group, or one process without a group): load
    the sharded checkpoint ``path`` into ``app_state`` in place; returns its ``extra``.

    ``app_state["model"]`` and ``app_state["optimizer"]`` must be DCP-able state dicts of
    the current layout (``get_state_dict(model, optimizer)`` of the sharded model, after
    which the caller applies them with ``set_state_dict``): their tensors are filled in
    place, resharded from the saved rank count to this one.  Plain entries are replaced by
    the saved ones (rank 0's), except ``"rng"``: each rank gets its own saved RNG state when
    the rank count is the one saved with, and keeps its current one otherwise (logged).
    With ``verify`` every file's sha256 is checked first (one read of the whole checkpoint
    per rank).  Raises :class:`CheckpointInvalid`.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    manifest = sharded_manifest(path)
    if verify:
        verify_files(path, manifest)
    grouped = dist.is_initialized()
    rank = dist.get_rank() if grouped else 0
    world = dist.get_world_size() if grouped else 1
    state = {key: app_state[key] for key in DCP_KEYS}
    try:
        if grouped:
            dcp.load(state, checkpoint_id=str(path), process_group=checkpoint_group(timeout_s))
        else:
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception as exc:
        raise CheckpointInvalid(path, f"torch.distributed.checkpoint could not load it: "
                                      f"{str(exc).strip().splitlines()[0]}") from exc
    app_state.update(state)
    plain = _read_plain(path, 0)
    saved_world = int(manifest.get("world_size", 1))
    plain.pop(RNG_KEY, None)
    if saved_world == world:
        own = _read_plain(path, rank)
        if RNG_KEY in own:
            plain[RNG_KEY] = own[RNG_KEY]
    else:
        log.info("rank %d keeps its RNG state: the checkpoint was saved on %d ranks, this "
                 "group has %d", rank, saved_world, world)
    app_state.update(plain)
    return dict(manifest.get("extra") or {})


def load_full_model(path: Path, model_state: dict[str, torch.Tensor], *,
                    verify: bool = True) -> dict[str, Any]:
    """Fill ``model_state`` (a whole model's state dict on the CPU, e.g. an unsharded
    policy's ``state_dict()``) from the sharded checkpoint ``path``, in one process without
    a process group, consolidating every rank's shards; returns the checkpoint's ``extra``.
    Keys the checkpoint lacks, or shapes that differ, raise :class:`CheckpointInvalid`."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    manifest = sharded_manifest(path)
    if verify:
        verify_files(path, manifest)
    try:
        dcp.load({"model": model_state}, checkpoint_id=str(path), no_dist=True)
    except Exception as exc:
        raise CheckpointInvalid(path, f"its model does not fit: "
                                      f"{str(exc).strip().splitlines()[0]}") from exc
    return dict(manifest.get("extra") or {})


def _read_plain(path: Path, rank: int) -> dict[str, Any]:
    try:
        return dict(torch.load(path / rank_file(rank), map_location="cpu", weights_only=True))
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointInvalid(path, f"{rank_file(rank)} is unreadable: {exc}") from exc
