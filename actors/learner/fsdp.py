"""``learner.backend: fsdp2``: the policy sharded over the learner's ranks with FSDP2
(``torch.distributed.fsdp.fully_shard``), and what that changes in a learner rank.

:class:`Fsdp2Plan` is held by :class:`~erlay.actors.learner.core.LearnerCore` when its backend
is ``fsdp2``; the core calls it at a few fixed points.  Contracts:

- **Lazy sharding.** Every rank builds the whole model from the same seed (and loads the same
  checkpoint, if any) in its constructor, without collectives: the supervisor starts the
  ranks one at a time, so a constructor that waited for its peers would deadlock the start.
  :meth:`Fsdp2Plan.shard` runs at the first call that every rank makes together (a train
  step, an SFT warm start, a checkpoint save, a state read): ``fully_shard`` on each
  transformer block (:func:`decoder_layers`), then on the root, and a new AdamW over the
  sharded (DTensor) parameters.  An optimizer state loaded before that waits and is applied
  to the new optimizer, resharded to this rank count.
- **Host first, shards on the device.** The constructor builds the whole model (and the KL
  reference) on the host, whatever the device (:func:`build_device`), and touches no device
  memory.  ``fully_shard`` moves one unit (a block, then the root) whole to the mesh's
  device, keeps this rank's shard and frees the rest before the next unit: the device never
  holds more than the shards plus one unit's whole weights, so a model whose weights do not
  fit one device starts.  Nothing else may hold the whole parameters meanwhile (the core
  drops the constructor's optimizer first).  The host holds the whole model once per rank
  until sharding; afterwards only rank 0 does (its publishing copy, which takes over the
  constructor's host storage).
- **Gradients.** FSDP reduce-scatters each block's gradients in backward and averages them
  over ranks: the core's manual all-reduce is skipped, and its loss scaling (each rank's
  token sum over the global token count, times the rank count) makes that average the
  token mean over the whole batch, as one learner would take.  Clipping uses the global norm
  over the DTensor shards (:func:`clip_global`).
- **Uniform collectives.** Every forward pass gathers parameters (a collective), so every
  rank runs the same forwards and backwards in the same order, even with nothing to train
  on: such a rank runs an idle pass whose loss is zero (the core's ``_idle_pass``).
- **Publishing.** At the end of every update (and of a state load) every rank joins the
  gather of the full weights (:meth:`Fsdp2Plan.refresh_host`); rank 0 keeps them in a host
  copy of the model, which serves ``publish``, ``versioned_weights`` and
  ``evaluate_logprobs`` on rank 0 alone without any collective.  Other ranks refuse those.
- **Checkpoints** are sharded (:mod:`erlay.actors.learner.checkpoint.sharded`; every rank
  saves its shards, a collective).  A restarted rank restores one in two halves: in its
  constructor, alone, the whole weights and the timeline (step, version; what ``status`` and
  rank 0's ``publish`` need before any collective), and at sharding, collectively, the
  optimizer's and the model's shards, resharded to this rank count
  (:meth:`Fsdp2Plan.shard` with ``pending_sharded``).  A whole (``state.pt``) checkpoint
  loads too, before sharding (``pending_optimizer``): :meth:`LearnerCore.state` gives the
  optimizer state keyed by parameter name (``optimizer_layout: fqn``), so a state moves
  between rank counts and between the replicated and fsdp2 backends
  (:func:`optimizer_by_name`, :func:`optimizer_by_index`).
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist
from torch import nn

from erlay.actors.model.layers import decoder_layers

log = logging.getLogger("erlay.learner")

FQN_LAYOUT = "fqn"   # optimizer state keyed by parameter name (torch.distributed.checkpoint's)


def build_device(backend: str, device: str) -> str:
    """Where a learner builds its policy: on the host for fsdp2 (only shards go to
    ``device``, at sharding), on ``device`` itself otherwise.  Pure."""
    return "cpu" if backend == "fsdp2" else device


def shard_module(model: nn.Module, mesh: Any, *, cpu_offload: bool,
                 reshard_after_forward: bool) -> None:
    """``fully_shard`` each block of ``model``, then the root (embeddings, final norm, head,
    MTP heads), in place; each unit goes whole to the mesh's device, then only its shard
    stays.  ``hidden`` becomes an FSDP forward method too, because the MTP
    loss calls it directly rather than through ``forward``."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
    # Pinned host memory speeds the copies to a GPU; there is none to copy to on a CPU
    # device, and pinning needs an accelerator.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload \
        else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    # The root keeps its parameters gathered after forward (FSDP's own default for a root):
    # they are needed again at once in backward, and ``forward`` calls ``hidden``, also an
    # FSDP forward method, whose end must not reshard the head that ``forward`` then uses.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
    if hasattr(model, "hidden"):
        register_fsdp_forward_method(model, "hidden")


def clip_global(params: list[nn.Parameter], limit: float) -> float:
    """``clip_grad_norm_`` over ``params``; returns the pre-clip norm over every rank's shards
    (a DTensor norm is reduced over the mesh, so all ranks return the same number)."""
    from torch.distributed.tensor import DTensor
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as host tensors on rank 0 (an empty dict elsewhere).
    Collective: every rank calls it at the same point."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def unstepped_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped yet the state a first step would create, with
    its step counts at 0: what ``torch.distributed.checkpoint`` needs to save or load it.

    Its own initialisation (``get_state_dict`` on an empty state) takes a zero-gradient step
    at lr 0, which leaves Adam's ``step`` at 1: the first real step's bias correction would
    then shrink it by a quarter, so a learner that saved before training would train
    differently from one that did not.  Adam with step 0 and zero moments steps exactly as
    with no state."""
    if optimizer.state:
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer
                         ) -> dict[str, Any]:
    """The whole optimizer state, keyed by parameter name, as host tensors on rank 0 (empty
    elsewhere).  Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    unstepped_state(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load a name-keyed whole optimizer state (every rank holds it) into a sharded
    optimizer: each rank keeps its own shards.  Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, copy.deepcopy(state),
                             options=StateDictOptions(full_state_dict=True))


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole weights (every rank holds them) into a sharded model.  Every rank calls
    it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def trainable_names(model: nn.Module) -> list[str]:
    """The names of the trainable parameters, in the order the optimizer holds them."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def optimizer_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A ``torch.optim`` state dict keyed by parameter index -> keyed by ``names[index]``
    (the layout :func:`full_optimizer_state` gives).  Pure."""
    return {"state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                             for g in state["param_groups"]]}


def optimizer_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_by_name`: name keys -> indices into ``names``.
    Raises ValueError naming a parameter this model does not have.  Pure."""
    index = {n: i for i, n in enumerate(names)}
    missing = [n for g in state["param_groups"] for n in g["params"] if n not in index]
    if missing:
        raise ValueError(f"the checkpoint's optimizer names parameters this model does not "
                         f"train: {missing[:3]}")
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counting a
    DTensor by its local shard (``to_local()``)."""
    from torch.distributed.tensor import DTensor

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()
    params = list(model.parameters())
    return {"param_bytes": sum(size(p) for p in params),
            "grad_bytes": sum(size(p.grad) for p in params if p.grad is not None),
            "optim_bytes": sum(size(v) for st in optimizer.state.values()
                               for v in st.values() if isinstance(v, torch.Tensor)
                               and v.dim() > 0)}


class Fsdp2Plan:
    """One rank's FSDP2 state: whether the model is sharded yet, rank 0's host copy of the
    full weights, and an optimizer state waiting for the sharded optimizer (module
    docstring)."""

    def __init__(self, *, rank: int, cpu_offload: bool = False,
                 reshard_after_forward: bool = True) -> None:
        self.rank = rank
        self.cpu_offload, self.reshard_after_forward = cpu_offload, reshard_after_forward
        self.sharded = False
        self.host: nn.Module | None = None
        self.pending_optimizer: dict[str, Any] | None = None
        self.pending_sharded: Path | None = None   # a sharded checkpoint to load at shard()

    def shard(self, model: nn.Module, reference: nn.Module | None, device: str,
              make_optimizer: Any) -> torch.optim.Optimizer:
        """Shard ``model`` (and the frozen ``reference``) over the default process group,
        which must exist; returns the new optimizer, ``make_optimizer(params)``, with any
        pending state loaded.  Every rank calls it at the same point.  Each unit's whole
        weights are freed once it is sharded only if nothing else (an optimizer) holds the
        model's parameters."""
        from torch.distributed.device_mesh import init_device_mesh
        if self.rank == 0:
            # The full weights before sharding: rank 0 serves them until the first update.
            self.host = _host_copy(model)
        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        shard_module(model, mesh, cpu_offload=self.cpu_offload,
                     reshard_after_forward=self.reshard_after_forward)
        if reference is not None:
            shard_module(reference, mesh, cpu_offload=self.cpu_offload,
                         reshard_after_forward=True)
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        if self.pending_optimizer is not None:
            load_full_optimizer_state(model, optimizer, self.pending_optimizer)
            self.pending_optimizer = None
        if self.pending_sharded is not None:
            load_sharded_state(self.pending_sharded, model, optimizer)
            self.pending_sharded = None
        self.sharded = True
        log.info("learner rank %d: fsdp2 sharded %d blocks over %d ranks (cpu_offload %s)",
                 self.rank, len(decoder_layers(model)), dist.get_world_size(),
                 self.cpu_offload)
        return optimizer

    def full_state(self, model: nn.Module, reference: nn.Module | None,
                   optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """``(model, reference, optimizer)`` state, whole, as host copies on rank 0 (the
        model's from the host copy, current after every update; the optimizer's name-keyed).
        Collective (the optimizer and reference gathers): every rank calls it."""
        ref = None if reference is None else full_model_state(reference)
        # Copies: on a CPU device the gather may hand back the live tensors (one rank, or
        # the unsharded scalars such as Adam's step count), which the next step changes.
        optim = copy.deepcopy(full_optimizer_state(model, optimizer))
        ref = copy.deepcopy(ref)
        weights = {} if self.host is None else {k: v.detach().clone() for k, v in
                                                self.host.state_dict().items()}
        return weights, ref, optim

    def load(self, model: nn.Module, reference: nn.Module | None,
             optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
             reference_weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
        """Load whole state (every rank holds it; the optimizer's name-keyed).  Before
        sharding: into the whole model, each rank alone, the optimizer's kept for
        :meth:`shard`.  After: a collective that every rank calls."""
        if not self.sharded:
            model.load_state_dict(weights)
            if reference is not None:
                reference.load_state_dict(reference_weights)
            self.pending_optimizer = optim
            return
        load_full_model_state(model, weights)
        if reference is not None:
            load_full_model_state(reference, reference_weights)
        load_full_optimizer_state(model, optimizer, optim)
        self.refresh_host(model)

    def refresh_host(self, model: nn.Module) -> None:
        """Gather the full weights into rank 0's host copy.  Collective."""
        state = full_model_state(model)
        if self.host is not None:
            self.host.load_state_dict(state)

    def serving_model(self, model: nn.Module) -> nn.Module:
        """The module whose weights this rank may read alone: the model itself before
        sharding, rank 0's host copy after.  Raises RuntimeError on other ranks."""
        if not self.sharded:
            return model
        if self.host is None:
            raise RuntimeError(f"learner rank {self.rank} holds a shard of the fsdp2 model; "
                               f"rank 0 serves its weights")
        return self.host

    @staticmethod
    def copy_shards(source: nn.Module, target: nn.Module) -> None:
        """Make ``target`` (sharded the same way) hold ``source``'s weights: a local copy of
        each shard, no collective."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for s, t in zip(source.parameters(), target.parameters(), strict=True):
                (t.to_local() if isinstance(t, DTensor) else t).copy_(
                    s.to_local() if isinstance(s, DTensor) else s)


def sharded_app_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                      plain: dict[str, Any]) -> dict[str, Any]:
    """What :class:`~erlay.actors.learner.checkpoint.sharded.ShardedCheckpointer` saves:
    the model's and optimizer's DCP state dicts (this rank's shards) and ``plain``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    unstepped_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state, **plain}


def load_sharded_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> dict[str, Any]:
    """Load the sharded checkpoint ``path`` into the sharded ``model`` and ``optimizer``,
    resharded to this rank count, and this rank's saved RNG state when the rank count is the
    saved one; returns the plain entries.  Collective."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from erlay.actors.learner.checkpoint.sharded_load import load_sharded
    app = sharded_app_state(model, optimizer, {})
    load_sharded(path, app)
    set_state_dict(model, optimizer, model_state_dict=app["model"],
                   optim_state_dict=app["optimizer"])
    rng = app.get("rng")
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(_python_rng(rng["python"]))
    return {k: v for k, v in app.items() if k not in ("model", "optimizer")}


def read_sharded_whole(path: Path, model: nn.Module) -> dict[str, Any]:
    """Every rank alone, before sharding: fill the whole ``model`` from the sharded
    checkpoint ``path`` (every rank's shards consolidated) and return its plain entries
    (rank 0's: step, version, ...)."""
    from erlay.actors.learner.checkpoint.sharded_load import load_full_model, rank_file
    load_full_model(path, model.state_dict())
    return dict(torch.load(path / rank_file(0), map_location="cpu", weights_only=True))


def _python_rng(state: Any) -> tuple:
    """``random.getstate()`` back from its saved form (``torch.load`` may give lists)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _host_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` on the host whose tensors share the host ``model``'s
    storage: sharding gives the model new (shard) tensors and leaves this storage to the
    copy, so rank 0 holds the whole weights on its host once at start-up, not twice."""
    memo: dict[int, Any] = {id(t): nn.Parameter(t.detach(), requires_grad=False)
                            if isinstance(t, nn.Parameter) else t.detach()
                            for t in [*model.parameters(), *model.buffers()]
                            if t.device.type == "cpu"}
    host = copy.deepcopy(model, memo).to("cpu")
    host.requires_grad_(False)
    return host
