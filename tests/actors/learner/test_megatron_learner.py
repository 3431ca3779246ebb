"""MegatronLearner on a CPU: it imports, offers the replicated learner's surface (so the
driver can start either with the same keywords), and refuses to start without CUDA with a
clear error.  Its training path (TP, DP, PP) runs here with megatron's CUDA calls patched
in the test; on a GPU it is checked by bench/gpu/megatron_parity.py."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from erlay.actors.learner.core import LearnerCore, TrainBatch
from erlay.actors.learner.megatron_backend import MegatronLearner, MegatronUnavailable
from erlay.actors.learner.rank import Learner

SURFACE = ("train_step", "sft", "publish", "versioned_weights", "status", "save_checkpoint",
           "wait_checkpoints", "state", "load_state", "erlay_terminate")


def keywords(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_megatron_learner_has_the_replicated_learners_surface_and_options() -> None:
    """Every backend takes the same LearnerOptions the driver builds once: the same
    constructor, and an option no backend knows is refused by name before anything runs."""
    for name in SURFACE:
        assert callable(getattr(MegatronLearner, name, None)), name
    assert keywords(MegatronLearner) == keywords(Learner) == keywords(LearnerCore) == {
        "model_config", "options", "overrides"}
    with pytest.raises(TypeError, match="no learner option named ledger"):
        MegatronLearner({"hf": "unused"}, ledger="typo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_megatron_learner_refuses_to_start_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(MegatronUnavailable, match="runs on GPUs only"):
        MegatronLearner({"hf": str(tmp_path)}, device="cuda")


# -- the step logic on the CPU, megatron's CUDA calls patched in the test --------------------
@pytest.fixture
def cpu_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test-only: let MegatronLearner and megatron's forward run on the CPU (require_cuda
    off, ``torch.cuda.current_device`` -> "cpu", the CUDA RNG tracker's fork a no-op)."""
    import contextlib

    import megatron.core.tensor_parallel as tensor_parallel
    import torch.distributed as dist

    from erlay.actors.learner import megatron_backend

    class NoFork:
        def fork(self, *args: object, **kwargs: object) -> object:
            return contextlib.nullcontext()

    # A one-process group left by earlier tests (a one-rank checkpointer's) is what a
    # world-size-1 MegatronLearner would make itself: it joins it.
    assert not dist.is_initialized() or dist.get_world_size() == 1, \
        "a multi-rank process group exists in the test process"
    monkeypatch.setattr(megatron_backend, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: NoFork())


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpo_batch(core: LearnerCore, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(2)
    groups, size = 2, 4
    prompts = torch.randint(4, vocab, (groups, 6), generator=g).tolist()
    prompt_ids = [prompts[i // size] for i in range(groups * size)]
    completions = [torch.randint(4, vocab, (3 + i % 4,), generator=g).tolist()
                   for i in range(groups * size)]
    scored = core.evaluate_logprobs(prompt_ids, completions)
    behaviour = [[x + 0.3 * float(torch.randn((), generator=g)) for x in row] for row in scored]
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=completions,
                      behaviour_logprobs=behaviour, versions=[[0] * len(c) for c in completions],
                      rewards=[float((i * 7) % 3) for i in range(groups * size)],
                      group_size=size, rollout_ids=[f"r{i}" for i in range(groups * size)])


def test_megatron_learner_step_on_cpu_equals_the_hf_learners_step(
        tmp_path: Path, cpu_megatron: None) -> None:
    """The GPU-only learner's logic run on the CPU (fixture): it publishes the HF weights
    bit for bit before training, and one GRPO step gives LearnerCore's loss and gradient
    norm on the same weights and batch (float32), and moves the weights the same way;
    ``load_state(state())`` restores it exactly.  Planted: a perturbed norm weight changes
    the step's loss or gradient norm."""
    from erlay.actors.learner.megatron_backend import MegatronLearner
    from erlay.actors.model.tiny import write_tiny_model
    path = write_tiny_model(tmp_path / "m", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2,
                            ffn=128, max_positions=64)
    spec = {"hf": str(path), "init": "pretrained", "dtype": "float32"}
    hyper = dict(lr=1e-3, max_grad_norm=1e9, seed=0, temperature=0.9)
    core = LearnerCore(spec, **hyper)
    ours = MegatronLearner(spec, device="cpu", master_port=free_port(), **hyper)
    try:
        version, published = ours.versioned_weights()
        start = core.weights()
        assert version == 0 and set(published) == set(start)
        assert all(np.array_equal(published[k], start[k]) for k in start)
        batch = grpo_batch(core, ours.shape.vocab_size)
        initial = ours.state()
        theirs_m = core.train_step(batch)
        ours_m = ours.train_step(batch)
        assert ours_m["step"] == ours_m["version"] == 1
        assert abs(ours_m["loss"] - theirs_m["loss"]) < 1e-5
        assert abs(ours_m["grad_norm"] - theirs_m["grad_norm"]) < 1e-4 * theirs_m["grad_norm"]
        after_core, after_ours = core.weights(), ours.weights()
        moved = max(float(np.abs(after_core[k] - start[k]).max()) for k in start)
        apart = max(float(np.abs(after_core[k] - after_ours[k]).max()) for k in start)
        assert moved > 5e-4 and apart < 1e-4, (moved, apart)
        # state() restores exactly into the same learner (weights, step, version).
        saved = ours.state()
        ours.train_step(grpo_batch(core, ours.shape.vocab_size))
        assert ours.load_state(saved) == 1
        assert all(np.array_equal(ours.weights()[k], after_ours[k]) for k in after_ours)
        # Back to the start, the same step again: the same loss.
        assert ours.load_state(initial) == 0
        assert ours.train_step(batch)["loss"] == pytest.approx(ours_m["loss"], abs=1e-7)
        # Planted: from the start again, with a perturbed final norm on the megatron side.
        ours.load_state(initial)
        with torch.no_grad():
            ours.model.decoder.final_layernorm.weight.add_(0.05)
        planted = ours.train_step(batch)
        assert abs(planted["loss"] - theirs_m["loss"]) > 1e-4 or \
            abs(planted["grad_norm"] - theirs_m["grad_norm"]) > 1e-3 * theirs_m["grad_norm"]
    finally:
        ours.erlay_terminate()


def test_megatron_learner_refuses_pipeline_stages_with_a_tied_output_layer(
        tmp_path: Path, cpu_megatron: None) -> None:
    """A tied model with pipeline_parallel 2 is refused at construction (before any group
    forms); the same untied model is not (it fails later only for want of a peer rank)."""
    import json

    from erlay.actors.model.tiny import write_tiny_model
    path = write_tiny_model(tmp_path / "m", "llama", weights=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    kwargs = dict(device="cpu", rank=1, world_size=2, pipeline_parallel=2, data_parallel=1)
    with pytest.raises(ValueError, match="tied input and output embeddings"):
        MegatronLearner({"hf": str(path)}, **kwargs)
    (path / "config.json").write_text(json.dumps(config))
    assert MegatronLearner({"hf": str(path)}, **kwargs).pp == 2


def test_megatron_learner_tp2_dp2_and_pp2_on_two_gloo_ranks_equal_the_hf_learner(
        tmp_path: Path) -> None:
    """Two processes (tests/actors/learner/megatron_ranks.py), megatron's CUDA calls patched:
    with tensor-parallel 2 the sharded model's logits equal HF's (a naive fc1 split does
    not: planted), the gathered weights rank 0 publishes are the HF weights bit for bit, and
    one GRPO step gives the single HF learner's loss, gradient norm and weights; with
    data-parallel 2 the gradient norm and the weights after the step agree too; with
    pipeline-parallel 2 (megatron's 1F1B schedule) likewise, and SFT (see below)."""
    import json
    import os
    import subprocess
    import sys

    from erlay.actors.model.tiny import write_tiny_model
    from tests.paths import REPO
    path = write_tiny_model(tmp_path / "m", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2,
                            ffn=128, max_positions=64)
    port = free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "actors" / "learner" / "megatron_ranks.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(path),
                               str(tmp_path / f"rank{r}.json")], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tp2, dp2 = ranks[0]["tp2"], ranks[0]["dp2"]
    for r in ranks:
        assert r["tp2"]["logits_max_abs"] < 1e-4 and r["tp2"]["restored_logits_max_abs"] < 1e-4
        assert r["tp2"]["planted_fc1_logits_max_abs"] > 1e-3
    assert tp2["published_is_hf"] and dp2["published_is_hf"]
    assert abs(tp2["loss"] - tp2["ref_loss"]) < 1e-5
    for row in (tp2, dp2):
        assert abs(row["grad_norm"] - row["ref_grad_norm"]) < 1e-4 * row["ref_grad_norm"]
        assert row["weights_moved"] > 5e-4 and row["weights_vs_ref_max_abs"] < 1e-4, row
    # Data parallel: each rank's loss is its own half's; the two halves differ.
    assert ranks[0]["dp2"]["loss"] != ranks[1]["dp2"]["loss"]
    assert dp2["sft_loss"] == pytest.approx(dp2["ref_sft_loss"], abs=1e-4)
    # Pipeline parallel 2 (KL reference, two minibatches): stage r holds layer r + 1 (global
    # numbering); the last stage's no-grad logprobs are HF's, and not with stage 1 holding
    # stage 0's layer (planted offset); rank 0 publishes the HF weights, then exactly a merge
    # of both stages; the GRPO step and two SFT steps equal the single HF learner's, on
    # every stage (the gradient norm includes both stages' parameters).
    first, last = ranks[0]["pp2"], ranks[1]["pp2"]
    assert [first["layer_numbers"], last["layer_numbers"]] == [[1], [2]]
    assert first["logprobs_max_abs"] is None and last["logprobs_max_abs"] < 1e-5
    assert last["planted_offset_logprobs_max_abs"] > 1e-3
    assert first["published_is_hf"] and first["published_is_stage_merge"]
    for row in (first, last):
        assert abs(row["loss"] - row["ref_loss"]) < 1e-5
        assert abs(row["grad_norm"] - row["ref_grad_norm"]) < 1e-4 * row["ref_grad_norm"]
        assert row["clip_fraction"] == pytest.approx(row["ref_clip_fraction"], abs=1e-6)
        assert row["sft_loss"] == pytest.approx(row["ref_sft_loss"], abs=1e-5)
    assert first["weights_moved"] > 5e-4 and first["weights_vs_ref_max_abs"] < 1e-4, first
    assert first["sft_weights_vs_ref_max_abs"] < 1e-4
    # Rank 0's state() restores both stages (after a further step): its weights exactly.
    assert first["restored_is_state"] and first["restored_moved_back"] < 1e-4


def test_megatron_learner_checkpoint_restores_step_and_weights_on_cpu(
        tmp_path: Path, cpu_megatron: None) -> None:
    """save_checkpoint (the replicated learner's async checkpointer) then a new incarnation
    on the same directory: it reports the restored step, and publishes the saved weights
    and trains on from them exactly as the first would have; ``erlay export`` writes the
    checkpoint as an HF directory with exactly those weights.  Planted: a new incarnation on
    an empty directory starts from step 0."""
    from erlay.actors.learner.megatron_backend import MegatronLearner
    from erlay.actors.model.tiny import write_tiny_model
    path = write_tiny_model(tmp_path / "m", "llama", hidden=64, layers=2, heads=4, kv_heads=2,
                            ffn=128, max_positions=64)
    spec = {"hf": str(path), "init": "pretrained", "dtype": "float32"}
    run = tmp_path / "run"
    hyper = dict(lr=1e-3, seed=0, checkpoint_dir=str(run / "checkpoints"))
    core = LearnerCore(spec, lr=1e-3, seed=0)
    first = MegatronLearner(spec, device="cpu", master_port=free_port(), **hyper)
    try:
        batch = grpo_batch(core, first.shape.vocab_size)
        first.train_step(batch)
        saved = first.weights()
        assert first.save_checkpoint({"note": "x"})["step"] == 1
        assert first.wait_checkpoints() == {"committed": 1, "failed": []}
        next_step = first.train_step(batch)
        expected = first.weights()
    finally:
        first.erlay_terminate()
    second = MegatronLearner(spec, device="cpu", master_port=free_port(), **hyper)
    try:
        status = second.status()
        assert status["step"] == 1 and status["restored"]["step"] == 1
        assert status["restored"]["note"] == "x"
        assert all(np.array_equal(second.weights()[k], saved[k]) for k in saved)
        again = second.train_step(batch, expected_step=1)
        assert again["loss"] == pytest.approx(next_step["loss"], abs=1e-7)
        assert all(np.array_equal(second.weights()[k], expected[k]) for k in expected)
    finally:
        second.erlay_terminate()
    # erlay export writes the megatron checkpoint as an HF directory with its weights.
    from transformers import AutoModelForCausalLM

    from erlay.actors.config import load_config
    from erlay.actors.job.export import export_run
    (run / "config.yaml").write_text(load_config(None, [
        f"model.hf={path}", "learner.backend=megatron", "learner.device=cuda",
        "learner.num_gpus=1"]).to_yaml())
    exported = AutoModelForCausalLM.from_pretrained(export_run(run, tmp_path / "out").out)
    written = {k: v.detach().numpy() for k, v in exported.state_dict().items()}
    assert set(written) == set(saved)
    assert all(np.array_equal(written[k], saved[k]) for k in saved)
    fresh = MegatronLearner(spec, device="cpu", master_port=free_port(), lr=1e-3, seed=0,
                            checkpoint_dir=str(tmp_path / "empty"))
    try:
        assert fresh.status()["step"] == 0 and fresh.status()["restored"] is None
    finally:
        fresh.erlay_terminate()
