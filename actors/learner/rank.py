"""The learner rank as a supervised actor child: :class:`~erlay.actors.learner.core.LearnerCore`
plus the Ray object store.

Start it as ``ChildSpec("learner-0", ActorStart(Learner, kwargs={"model_config": ...}))``.
All public methods are synchronous, so the supervisor runs it as a threaded actor: its
monitor and progress probes answer on their own threads while a train step runs, and the
step's progress ticks (phase ``train_step``, or ``sft``) are what hang detection reads.

Ranks of a data-parallel learner are siblings under a ``one_for_all`` supervisor (they share
a gloo process group, so one rank's death breaks the others' collectives).  Only rank 0
publishes weights: with ``backend: replicated`` every rank holds the same weights after each
step; with ``fsdp2`` each holds a shard, and rank 0 serves the whole weights gathered at the
end of every update (:mod:`erlay.actors.learner.fsdp`), so no call into rank 0 alone needs
its peers.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from erlay.actors.learner.checkpoint import (
    AsyncCheckpointer,
    FailedSaves,
    ensure_process_group,
    latest,
    load,
)
from erlay.actors.learner.checkpoint.format import SHARDED
from erlay.actors.learner.core import STATE_FORMAT, LearnerCore, TrainBatch
from erlay.actors.learner.fsdp import full_model_state, read_sharded_whole, sharded_app_state
from erlay.actors.learner.ledger import LearnerLedger
from erlay.actors.learner.options import LearnerOptions
from erlay.actors.learner.rendezvous import (
    announce_master,
    interface_of,
    lookup_master,
    node_address,
)
from erlay.actors.learner.uploads import fetch_newer_checkpoint, settle, start_mirror
from erlay.actors.model.build import shape_of
from erlay.actors.model.refit import Refit, put_refit, refit_tensors, resolve_dtype
from erlay.supervisor import failpoints
from erlay.supervisor.failpoints import Action, failpoint

log = logging.getLogger("erlay.learner")

__all__ = ["Learner", "TrainBatch"]


class Learner(LearnerCore):
    """One learner rank; see :class:`~erlay.actors.learner.core.LearnerCore` for the contracts.

    With ``init_model_dir`` (a GPT-2 directory, see :mod:`erlay.actors.model.hf_export`; the
    built-in model only, for ``engine.vllm.model_dir``) the policy starts from its weights
    instead of the seeded initialisation.  An HF model needs none: learner and engines load
    ``model.hf``.  With ``checkpoint_dir``, a new incarnation restores the newest committed
    checkpoint there before it serves (every rank loads the same one: one_for_all restarts
    them together), and :meth:`save_checkpoint` saves asynchronously into it.  With
    ``backend: fsdp2`` checkpoints are sharded and saving, polling and waiting are
    collectives: every rank calls :meth:`save_checkpoint`, :meth:`train_step` and
    :meth:`wait_checkpoints` at the same points.  A restarted fsdp2 rank reads the whole
    weights and its timeline alone in its constructor (no collective there: the supervisor
    starts ranks one at a time) and loads its optimizer's and model's shards when it shards
    (:mod:`erlay.actors.learner.fsdp`).

    A save that fails (its worker died, or made no progress for ``checkpoint_deadline_s`` and
    was killed) never fails a call: the learner trains on, the previous committed checkpoint
    stands, the next save starts a new worker, and the failure is in the ``"failed"`` list of
    the next answer of :meth:`save_checkpoint` or :meth:`wait_checkpoints`.
    """

    def __init__(self, model_config: dict[str, Any], options: LearnerOptions | None = None,
                 **overrides: Any) -> None:
        super().__init__(model_config, options, **overrides)
        o = self.options
        rendezvous, init_model_dir = o.rendezvous, o.init_model_dir
        checkpoint_dir, ledger_path = o.checkpoint_dir, o.ledger_path
        # With a rendezvous key the ranks meet at rank 0's node, wherever Ray placed it
        # (erlay.actors.learner.rendezvous); without one, at master_addr:master_port.
        self._rendezvous = rendezvous
        if rendezvous is not None and self.rank == 0:
            self.master_addr, self.master_port = announce_master(rendezvous)
        if init_model_dir is not None:
            # Start from the weights the vllm engines serve (a GPT-2 directory); a checkpoint,
            # if any, replaces them below.
            from erlay.actors.model.hf_export import read_model_dir
            from erlay.actors.model.policy import load_numpy_state

            _, weights = read_model_dir(init_model_dir)
            load_numpy_state(self.model, weights)
            if self.reference is not None:
                self.reference = self._frozen_copy()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_keep = o.checkpoint_keep
        self.checkpoint_deadline_s = o.checkpoint_deadline_s
        self._checkpointer: Any = None   # AsyncCheckpointer, or ShardedCheckpointer (fsdp2)
        self._failed_saves = FailedSaves()   # reported by the next save or wait answer
        self.restored: dict[str, Any] | None = None
        fetch_newer_checkpoint(o)   # remote storage: this node may lack the newest one
        info = latest(self.checkpoint_dir) if self.checkpoint_dir else None
        if info is not None and info.layout == SHARDED:
            self._restore_sharded_whole(info.path)
            self.restored = {"step": info.step, "path": str(info.path), **info.extra}
        elif info is not None:
            state, extra = load(info.path)
            self.load_state(state)
            self.restored = {"step": info.step, "path": str(info.path), **extra}
            log.warning("learner rank %d restored checkpoint %s (step %d)", self.rank,
                        info.path.name, info.step)
        # Rank 0 keeps the ledger of what was trained (erlay.actors.learner.ledger): the
        # evidence, independent of the journal, that each rollout was trained once.
        self.ledger = LearnerLedger(ledger_path) if ledger_path and self.rank == 0 else None
        if self.ledger is not None:
            self.ledger.started(self._step, self.restored is not None)
        self._mirror = start_mirror(o)   # remote storage: rank 0 uploads both

    def _restore_sharded_whole(self, path: Path) -> None:
        """The constructor's half of restoring a sharded checkpoint (class docstring): the
        whole weights and the timeline, this rank alone; the shards wait for sharding."""
        if self._fsdp is None:
            raise ValueError(f"{path} is a sharded checkpoint (saved by learner.backend fsdp2); "
                             f"resume it with backend fsdp2, or turn it into an HF directory "
                             f"with erlay export")
        plain = read_sharded_whole(path, self.model)
        if self.reference is not None:
            self.reference.load_state_dict(plain.get("reference") or self.model.state_dict())
        self._step, self._version = int(plain["step"]), int(plain["version"])
        self._warm_started = bool(plain.get("warm_started", True))
        self._fsdp.pending_sharded = path

    def _sharded_plain(self) -> dict[str, Any]:
        """A sharded checkpoint's plain entries (rank 0's are the ones loaded back); the
        frozen reference, when there is one, gathered whole to rank 0 (collective)."""
        return {"format": STATE_FORMAT, "model_config": shape_of(self.model),
                "step": self._step, "version": self._version,
                "warm_started": self._warm_started,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "reference": None if self.reference is None else
                full_model_state(self.reference)}

    def _save_sharded(self, extra: dict[str, Any]) -> dict[str, Any]:
        """:meth:`save_checkpoint` for fsdp2: every rank saves its shards (collective)."""
        from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer
        started = time.perf_counter()
        with self._lock:
            self._ready()
            if self._checkpointer is None:
                self._checkpointer = ShardedCheckpointer(
                    self.checkpoint_dir, keep=self.checkpoint_keep,
                    deadline_s=self.checkpoint_deadline_s)
                self._checkpointer.guard(self.optimizer)
            # The save in flight first (save() would wait for it too), so that its failure
            # is in this answer and `committed` is current.
            self._failed_saves.settle(self._checkpointer.wait)
            self._checkpointer.save(self._step, sharded_app_state(
                self.model, self.optimizer, self._sharded_plain()), extra)
        return {"step": self._step, "exposed_s": time.perf_counter() - started,
                "committed": self._checkpointer.committed,
                "failed": self._failed_saves.take()}

    def _ensure_group(self) -> None:
        """Form the group at rank 0's announced address (rendezvous), on the interface that
        holds this node's address."""
        if not self._group_ready and self._rendezvous is not None:
            if self.rank != 0:
                self.master_addr, self.master_port = lookup_master(self._rendezvous,
                                                                   self.dist_timeout_s)
            interface = interface_of(node_address())
            if interface is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        super()._ensure_group()

    def train_step(self, batch: dict[str, Any] | TrainBatch,
                   expected_step: int | None = None) -> dict[str, float]:
        """:meth:`LearnerCore.train_step`, then commit any checkpoint the background worker
        has finished persisting (a non-blocking poll), so commits follow saves closely."""
        failpoint("learner.train_step")
        metrics = super().train_step(batch, expected_step)
        if self.ledger is not None and not metrics.get("stale_step"):
            rows = batch.to_dict() if isinstance(batch, TrainBatch) else batch
            self.ledger.trained(int(metrics["step"]) - 1, int(metrics["version"]) - 1,
                                rows["rollout_ids"], rows["versions"], rows.get("loss_mask"))
        if self._checkpointer is not None:
            self._failed_saves.settle(self._checkpointer.poll)
        return metrics

    def status(self) -> dict[str, Any]:
        """``{step, version, warm_started, restored, committed}``: ``restored`` describes the
        checkpoint this incarnation started from (or is None), ``committed`` is the newest
        committed checkpoint's step (or None)."""
        info = latest(self.checkpoint_dir) if self.checkpoint_dir else None
        return {**super().status(), "restored": self.restored,
                "committed": info.step if info else None}

    def save_checkpoint(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Save this rank's state at its current step, asynchronously.

        Blocks only to record the state and hand it off: a background snapshot copies the
        tensors to host memory while the next step computes, and the optimizer's next step
        waits for it (:meth:`AsyncCheckpointer.guard`); persisting and the atomic commit
        happen in the checkpoint worker process.  Only rank 0 saves (ranks
        hold identical state after every step); other ranks return at once.  fsdp2: every
        rank calls it and saves its shards (:class:`ShardedCheckpointer`; a chaos ``delay``
        armed here is not applied to its write).  Returns ``{step, exposed_s, committed,
        failed}``: the newest committed step so far, and the saves that failed since the last
        answer (``[{"step": N, "reason": "..."}]``, oldest first; class docstring).  A save
        still in flight is waited for first, at most until its worker has made no progress
        for ``checkpoint_deadline_s``.
        """
        if self.checkpoint_dir is None or (self.rank != 0 and self._fsdp is None):
            return {"step": self._step, "exposed_s": 0.0, "committed": None, "failed": []}
        # Chaos: a `delay` armed here is slow storage, so it slows the background write,
        # not this call; any other action (raise, hang, exit) acts here, mid-save.
        armed = failpoints.armed().get("learner.checkpoint")
        write_delay_s = armed.delay_s if armed and armed.action is Action.DELAY else 0.0
        if not write_delay_s:
            failpoint("learner.checkpoint")
        if self._fsdp is not None:
            return self._save_sharded(extra or {})
        if self._checkpointer is None:
            if self.world_size > 1:
                self._ensure_group()
            ensure_process_group()
            self._checkpointer = AsyncCheckpointer(self.checkpoint_dir, keep=self.checkpoint_keep,
                                                   deadline_s=self.checkpoint_deadline_s)
            self._checkpointer.guard(self.optimizer)
        # Exposed here: the save in flight, waited for first (save() would wait for it too; so
        # its failure is in this answer and `committed` is current), recording the state and
        # the hand-off.
        started = time.perf_counter()
        self._failed_saves.settle(self._checkpointer.wait)
        with self._lock:  # the state's structure is read between steps
            self._checkpointer.save(self._step, self._state_locked(copied=False), extra or {},
                                    write_delay_s=write_delay_s)
        exposed = time.perf_counter() - started
        return {"step": self._step, "exposed_s": exposed,
                "committed": self._checkpointer.committed, "failed": self._failed_saves.take()}

    def wait_checkpoints(self) -> dict[str, Any]:
        """Block until no save is in flight (a stuck one: until its worker has made no progress
        for ``checkpoint_deadline_s`` and is killed); ``{committed, failed}``: the newest
        committed step (or None) and the saves that failed since the last answer, as
        :meth:`save_checkpoint` gives them; with remote storage, rank 0 also waits (at most
        ``upload_timeout_s``) for its mirror and adds ``upload`` (:func:`settle`'s answer).
        fsdp2: a collective, every rank calls it."""
        if self._checkpointer is not None:
            self._failed_saves.settle(self._checkpointer.wait)
        info = latest(self.checkpoint_dir) if self.checkpoint_dir else None
        answer = {"committed": info.step if info else None, "failed": self._failed_saves.take()}
        upload = settle(self._mirror, self.options.upload_timeout_s)
        return answer if upload is None else {**answer, "upload": upload}

    def checkpoint_writer(self) -> dict[str, int] | None:
        """``{"step": N, "pid": P}`` while this rank's checkpoint worker process ``P`` is
        writing the save of step ``N``, else None (the chaos suite stops that process)."""
        writer = self._checkpointer.writer if self._checkpointer is not None else None
        return None if writer is None else {"step": writer[0], "pid": writer[1]}

    def publish(self) -> Refit:
        """The current weights as a :class:`~erlay.actors.model.refit.Refit`: packed in the
        engines' dtype (``options.serving_dtype``) one bucket at a time, each bucket put in
        the object store as soon as it is built, so this rank holds at most one bucket beyond
        its model.  With LoRA only the adapters (and ``mtp.*``) move, or, with
        ``options.refit_merge_lora`` (vLLM), the merged weights.  Read under the lock: no
        step runs in between, so the refit is one version.

        This actor owns the objects: they stay readable while this incarnation lives, so
        the coordinator re-puts them, bucket by bucket, and a new incarnation publishes
        again.  Raises RuntimeError on ranks other than 0.
        """
        if self.rank != 0:
            raise RuntimeError(f"learner rank {self.rank} does not publish weights; rank 0 does")
        with self._lock:
            model = self._serving_model()
            return put_refit(self._version, refit_tensors(
                model, merge_lora=self.options.refit_merge_lora),
                resolve_dtype(self.options.serving_dtype, model))

    def erlay_terminate(self) -> None:
        """On a polite shutdown, commit pending checkpoints (waiting on a stuck worker at most
        until ``checkpoint_deadline_s`` without progress), then leave the process group so
        peers fail fast, not by timeout."""
        if self._checkpointer is not None:
            try:
                if self._fsdp is not None and self._checkpointer.in_flight is not None:
                    # Waiting is a collective, and peers shut down on their own schedule:
                    # the save in flight is given up (the last committed one stands), and
                    # its worker is killed (a stopped one would outlive this rank).
                    log.warning("learner rank %d: shutting down with the save of step %d "
                                "uncommitted", self.rank, self._checkpointer.in_flight)
                    self._checkpointer.abandon()
                else:
                    self._checkpointer.close()
            except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask
                log.error("learner rank %d: pending checkpoint failed at shutdown: %s",
                          self.rank, exc)
        self.close()
