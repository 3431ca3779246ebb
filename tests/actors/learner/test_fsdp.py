"""``learner.backend: fsdp2``: two ranks sharding a tiny HF model (each its own process, a gloo
group on loopback, no Ray) take the step one whole learner takes, serve weights from rank 0
only, and resume from a checkpoint on a different rank count and backend."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.fsdp_parity import (
    TOLERANCE,
    free_port,
    fsdp_rank_resume,
    max_abs_diff,
    parity_batch,
    run_parity,
    spawn_ranks,
    vocab_of,
)
from erlay.actors.learner.core import LearnerCore
from erlay.actors.learner.fsdp import (
    optimizer_by_index,
    optimizer_by_name,
    trainable_names,
)
from erlay.actors.model.layers import decoder_layers
from erlay.actors.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", hidden=64, layers=2,
                            heads=4, ffn=128, max_positions=64)
    return {"hf": str(path), "dtype": "float32"}


def test_two_fsdp2_ranks_take_the_step_one_whole_learner_takes(spec: dict[str, Any]) -> None:
    # max_grad_norm well under the gradient's norm: the clip (over DTensor shards) acts.
    result = run_parity(spec, options={"max_grad_norm": 0.05})
    assert result["grad_norm"]["whole"] > 0.05
    assert result["grad_norm"]["fsdp2"] == pytest.approx(result["grad_norm"]["whole"],
                                                         rel=1e-5)
    assert result["max_abs_diff"] <= TOLERANCE, result["max_abs_diff"]
    assert result["equivalent"]


def test_two_ranks_take_one_learners_steps_with_several_minibatches(
        spec: dict[str, Any]) -> None:
    """Each optimiser step of the RL step trains the same rows on 2 ranks as on 1, the ranks
    accumulating micro-batches of 16 tokens (one row or two each, so their counts differ
    and a rank runs idle passes) against the whole learner's one pass."""
    batch = parity_batch(vocab_of(spec), groups=2, group_size=4)
    result = run_parity(spec, batch=batch, options={"minibatches": 2},
                        rank_options={"micro_batch_tokens": 16})
    assert result["equivalent"], result["max_abs_diff"]


def test_lora_mtp_kl_cpu_offload_and_zero2_take_the_same_step_too(
        spec: dict[str, Any]) -> None:
    """The wrappers and options around the sharded blocks: LoRA adapters (only they train),
    MTP heads trained beside the policy (``hidden`` as an FSDP forward method), a sharded
    frozen reference for the KL term, CPU offload, blocks kept gathered after forward, and
    recomputed in backward (activation checkpointing)."""
    result = run_parity({**spec, "lora": {"r": 4}, "mtp_heads": 2}, options={
        "mtp_loss_weight": 0.5, "kl_coef": 0.1, "fsdp_cpu_offload": True,
        "fsdp_reshard_after_forward": False},
        rank_options={"activation_checkpointing": True})
    assert result["equivalent"], result["max_abs_diff"]


def test_the_equivalence_check_flags_a_planted_difference() -> None:
    a = {"w": np.zeros((3, 4), dtype=np.float32), "b": np.ones(2, dtype=np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    assert max_abs_diff(a, b) == 0.0
    b["w"][2, 1] += 2 * TOLERANCE
    assert max_abs_diff(a, b) > TOLERANCE
    assert max_abs_diff(a, {"w": a["w"]}) == float("inf")


def test_fsdp2_restart_resumes_the_same_timeline_on_two_ranks_and_on_one(
        spec: dict[str, Any], tmp_path: Path) -> None:
    """The restart path of one_for_all: the new incarnation loads the last checkpoint before
    it shards, refuses a step past its checkpoint (the coordinator then feeds the steps
    since it again), and retrains them to the same weights.  The second batch leaves rank 1
    nothing to train on, so it runs the idle pass; a whole learner restored from the same
    checkpoint takes the same step."""
    vocab = vocab_of(spec)
    options = {"lr": 1e-4, "max_grad_norm": 1.0}
    batches = [parity_batch(vocab, seed=1), parity_batch(vocab, seed=2, idle_rows=(2, 3))]
    checkpoint = tmp_path / "state.pkl"
    ranks = spawn_ranks(2, fsdp_rank_resume, spec, batches, options, free_port(),
                        str(checkpoint))
    assert [r["refused"] for r in ranks] == [False, True]
    assert all(r["stale"] for r in ranks)
    before, resumed = ranks[0]["weights"], ranks[0]["resumed"]
    assert max_abs_diff(before, resumed) <= 1e-6
    assert max_abs_diff(before, ranks[0]["reloaded"]) <= 1e-6
    state = pickle.loads(checkpoint.read_bytes())
    assert state["optimizer_layout"] == "fqn" and state["step"] == 1
    whole = LearnerCore(spec, **options)
    whole.load_state(state)            # an fsdp2 checkpoint, loaded by a replicated learner
    whole.train_step(batches[1], expected_step=1)
    assert max_abs_diff(before, whole.weights()) <= TOLERANCE
    fresh = LearnerCore(spec, **options)   # planted: no restore, the check must fail
    fresh.train_step(batches[1])
    assert max_abs_diff(before, fresh.weights()) > TOLERANCE


def _save_before_training(rank: int, world: int, port: int, spec: dict[str, Any],
                          batch: Any, port2: int) -> dict[str, Any]:
    plain = LearnerCore(spec, lr=1e-4, backend="fsdp2", master_port=port)
    plain.train_step(batch)
    out = {"plain": plain.weights()}
    plain.close()
    saved = LearnerCore(spec, lr=1e-4, backend="fsdp2", master_port=port2)
    state = saved.state()    # the optimizer has no state yet: saving must not give it one
    saved.train_step(batch)
    out.update(saved=saved.weights(), steps=[int(s["step"]) for s in
                                             state["optimizer"]["state"].values()])
    saved.close()
    return out


def test_a_save_before_the_first_step_does_not_change_it(spec: dict[str, Any]) -> None:
    """torch.distributed.checkpoint initialises an empty optimizer state with a step at lr 0,
    which leaves Adam's step count at 1 and would shrink the first real step (bias
    correction); the learner zeroes the count, so the step is the one it would have been."""
    (out,) = spawn_ranks(1, _save_before_training, spec, parity_batch(vocab_of(spec)),
                         free_port())
    assert out["steps"] and set(out["steps"]) == {0}
    assert max_abs_diff(out["plain"], out["saved"]) == 0.0


def test_optimizer_state_moves_between_index_and_name_keys() -> None:
    names = ["a.weight", "b.weight", "c.bias"]
    by_index = {"state": {0: {"step": torch.tensor(1.0)}, 2: {"step": torch.tensor(2.0)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    by_name = optimizer_by_name(by_index, names)
    assert set(by_name["state"]) == {"a.weight", "c.bias"}
    assert by_name["param_groups"][0]["params"] == names
    assert optimizer_by_index(by_name, names) == by_index
    with pytest.raises(ValueError, match="does not train"):
        optimizer_by_index(by_name, names[:2])


def test_decoder_layers_are_the_blocks_of_hf_lora_and_builtin_models(
        spec: dict[str, Any]) -> None:
    from erlay.actors.model.build import build_policy
    hf = build_policy(spec)
    assert decoder_layers(hf) == list(hf.backbone.layers) and len(decoder_layers(hf)) == 2
    lora = build_policy({**spec, "lora": {"r": 2}})
    assert len(decoder_layers(lora)) == 2
    assert trainable_names(lora) and all("lora_" in n for n in trainable_names(lora))
    builtin = build_policy({"vocab_size": 16, "d_model": 16, "n_layers": 3, "n_heads": 2,
                            "d_ff": 32, "max_seq_len": 16})
    assert len(decoder_layers(builtin)) == 3
    with pytest.raises(ValueError, match="no transformer blocks"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_an_unknown_backend_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="megatron"):
        LearnerCore(spec, backend="megatron")


def _sharded_incarnations(rank: int, world: int, port: int, spec: dict[str, Any],
                          batches: list[Any], root: str, port2: int) -> dict[str, Any]:
    """Learner ranks (the actor class, without Ray) with sharded checkpoints: the first
    incarnation trains step 0, saves (every rank), trains step 1 and shuts down; the second
    restores in its constructor and answers ``status`` and rank 0's weights before any
    collective, refuses step 2, and trains step 1 again."""
    from erlay.actors.learner.rank import Learner
    options = {"lr": 1e-4, "backend": "fsdp2", "rank": rank, "world_size": world,
               "checkpoint_dir": root}
    first = Learner(spec, master_port=port, **options)
    first.train_step(batches[0], expected_step=0)
    saved = first.save_checkpoint({"journal_snapshot": "snap-1"})
    committed = first.wait_checkpoints()["committed"]
    after_save = first.weights() if rank == 0 else None
    first.train_step(batches[1], expected_step=1)
    trained = first.weights() if rank == 0 else None
    first.erlay_terminate()
    second = Learner(spec, master_port=port2, **options)
    status = second.status()
    restored_weights = second.weights() if rank == 0 else None   # no peer needed
    stale = second.train_step(batches[1], expected_step=2)
    second.train_step(batches[1], expected_step=1)
    out = {"saved_step": saved["step"], "committed": committed, "status": status,
           "stale": bool(stale.get("stale_step")), "after_save": after_save,
           "restored": restored_weights, "trained": trained,
           "retrained": second.weights() if rank == 0 else None}
    second.erlay_terminate()
    return out


def _one_rank_resume(rank: int, world: int, port: int, spec: dict[str, Any],
                     batch: Any, root: str) -> dict[str, Any]:
    from erlay.actors.learner.rank import Learner
    learner = Learner(spec, lr=1e-4, backend="fsdp2", rank=rank, world_size=world,
                      master_port=port, checkpoint_dir=root)
    learner.train_step(batch, expected_step=1)
    out = {"weights": learner.weights()}
    learner.erlay_terminate()
    return out


def test_a_sharded_checkpoint_restarts_two_ranks_and_reshards_onto_one(
        spec: dict[str, Any], tmp_path: Path) -> None:
    """one_for_all's restart of an fsdp2 learner: the checkpoint is sharded (each rank its
    shards), the restarted ranks report its step and serve its weights before any collective
    (the coordinator asks rank 0 alone), refuse a step past it (the coordinator then feeds
    the steps since it again), and retrain to the same weights; on one rank it reshards and
    trains the same step.  The second batch leaves rank 1 nothing to train (idle pass)."""
    from erlay.actors.learner.checkpoint.format import SHARDED, latest
    vocab = vocab_of(spec)
    batches = [parity_batch(vocab, seed=1), parity_batch(vocab, seed=2, idle_rows=(2, 3))]
    root = tmp_path / "checkpoints"
    ranks = spawn_ranks(2, _sharded_incarnations, spec, batches, str(root), free_port())
    info = latest(root)
    assert info is not None and info.layout == SHARDED and info.world_size == 2
    assert info.step == 1 and info.extra["journal_snapshot"] == "snap-1"
    for r in ranks:
        assert r["saved_step"] == 1 and r["committed"] == 1 and r["stale"]
        assert (r["status"]["step"], r["status"]["committed"]) == (1, 1)
        assert r["status"]["restored"]["step"] == 1
    zero = ranks[0]
    assert max_abs_diff(zero["after_save"], zero["restored"]) == 0.0
    assert max_abs_diff(zero["trained"], zero["retrained"]) <= 1e-6
    # Planted: the step after the checkpoint moved the weights, so "trained" cannot pass
    # for the restored ones.
    assert max_abs_diff(zero["trained"], zero["restored"]) > TOLERANCE
    (one,) = spawn_ranks(1, _one_rank_resume, spec, batches[1], str(root))
    assert max_abs_diff(zero["trained"], one["weights"]) <= TOLERANCE
    # The chaos invariant checkpoints_intact verifies sharded checkpoints, and sees a torn one.
    from erlay.chaos.gather import checkpoint_problems
    assert checkpoint_problems(root) == [(1, None)]
    shard = next(info.path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_problems(root)[0][1] is not None


def _construct_for_cuda(rank: int, world: int, port: int, spec: dict[str, Any],
                        eager: bool) -> dict[str, Any]:
    """An fsdp2 learner for device ``cuda``, constructed in a process whose torch has no CUDA:
    any tensor the constructor put on the device would raise.  ``eager`` plants the old
    placement (the policy built on the device)."""
    import erlay.actors.learner.core as core_module
    if eager:
        core_module.build_device = lambda backend, device: device   # type: ignore[attr-defined]
    try:
        core = LearnerCore(spec, backend="fsdp2", device="cuda", kl_coef=0.1, rank=rank,
                           world_size=world, master_port=port)
    except Exception as error:   # the planted placement fails inside the HF loader
        return {"error": str(error)}
    modules = [core.model, core.reference]
    return {"devices": sorted({str(t.device) for m in modules
                               for t in [*m.parameters(), *m.buffers()]}),
            "status": core.status(), "serves": bool(core.weights())}


def test_an_fsdp2_constructor_leaves_the_whole_model_on_the_host(spec: dict[str, Any]) -> None:
    """The constructor of a rank for a GPU builds the policy (LoRA, MTP heads, KL reference)
    on the host and touches no device memory; it serves status and weights from there.  This
    machine's torch has no CUDA, so a device tensor would fail; the planted old placement
    does."""
    wrapped = {**spec, "lora": {"r": 4}, "mtp_heads": 2}
    (out,) = spawn_ranks(1, _construct_for_cuda, wrapped, False)
    assert out.get("error") is None and out["devices"] == ["cpu"]
    assert out["status"]["step"] == 0 and out["serves"]
    (planted,) = spawn_ranks(1, _construct_for_cuda, wrapped, True)
    assert "CUDA" in planted["error"]


def _whole_bytes_alive_while_sharding(rank: int, world: int, port: int, spec: dict[str, Any],
                                      port2: int) -> dict[str, Any]:
    """Bytes of the constructor's (whole) parameters still alive after each ``fully_shard``
    call (on a GPU, FSDP moves a unit's whole parameters to the device before sharding it, so
    these are device bytes), the local shard bytes after sharding, and whether rank 0's host
    copy took over the constructor's storage; then the same with planted faults: a reference
    to the constructor's optimizer held through the sharding, a host copy that copies."""
    import copy
    import gc
    import weakref

    import torch.distributed.fsdp as fsdp_module
    from torch.distributed.tensor import DTensor

    import erlay.actors.learner.fsdp as fsdp
    real = fsdp_module.fully_shard

    def run(master_port: int, hold: bool) -> dict[str, Any]:
        core = LearnerCore(spec, backend="fsdp2", rank=rank, world_size=world,
                           master_port=master_port)
        whole = [weakref.ref(p) for p in core.model.parameters()]
        storage = {p.data_ptr() for p in core.model.parameters()}
        if hold:
            fsdp._host_copy = lambda m: copy.deepcopy(m).requires_grad_(False)
        total = sum(p.numel() * p.element_size() for p in core.model.parameters())
        held = core.optimizer if hold else None
        alive: list[int] = []

        def counting(module: Any, **kwargs: Any) -> Any:
            out = real(module, **kwargs)
            gc.collect()
            alive.append(sum(p.numel() * p.element_size() for ref in whole
                             if (p := ref()) is not None))
            return out
        fsdp_module.fully_shard = counting
        try:
            core.state()   # the first collective: shards
        finally:
            fsdp_module.fully_shard = real
        params = list(core.model.parameters())
        host = core._fsdp.host
        result = {"total": total, "alive": alive, "held": held is not None,
                  "dtensors": all(isinstance(p, DTensor) for p in params),
                  "local": fsdp.local_bytes(core.model, core.optimizer)["param_bytes"],
                  "host_shares": host is not None and all(p.data_ptr() in storage
                                                           for p in host.parameters())}
        core.close()
        return result
    return {"fixed": run(port, False), "planted": run(port2, True)}


def test_sharding_frees_each_blocks_whole_weights_and_keeps_a_shard(
        spec: dict[str, Any]) -> None:
    """The device never holds the whole model: the whole parameters of each block are freed
    as soon as it is sharded (none are left after the root), and each of 2 ranks keeps
    DTensor shards of about half the bytes.  Planted: a reference to the constructor's
    optimizer held through the sharding keeps every whole parameter alive (the old code).
    Rank 0's host copy (publishing) is the constructor's host storage, not a second copy."""
    ranks = spawn_ranks(2, _whole_bytes_alive_while_sharding, spec, free_port())
    blocks = 2   # the spec's layers; then the root
    for r in ranks:
        fixed, planted = r["fixed"], r["planted"]
        total, alive = fixed["total"], fixed["alive"]
        assert len(alive) == blocks + 1
        assert alive[0] < total and alive == sorted(alive, reverse=True) and alive[-1] == 0
        assert fixed["dtensors"] and abs(fixed["local"] - total / 2) <= 0.01 * total
        assert planted["alive"] == [total] * (blocks + 1)
    assert [r["fixed"]["host_shares"] for r in ranks] == [True, False]
    assert not ranks[0]["planted"]["host_shares"]
