"""One rank of test_megatron_learner.py's two-process check (not a test module):
``python megatron_ranks.py RANK PORT MODEL_DIR OUT_JSON``.

Runs :class:`~erlay.actors.learner.megatron_backend.MegatronLearner` on the CPU over a
2-process gloo group, with megatron's CUDA calls patched (test-only, as in
test_megatron_convert.py), twice: tensor-parallel 2, then data-parallel 2.  Against a
single-process :class:`~erlay.actors.learner.core.LearnerCore` on the same HF model and batch
it records, for rank 0: the TP=2 model's logits before training (and with a planted naive
fc1 split), whether the gathered, merged weights it publishes equal the HF weights bit for
bit, and one GRPO step's loss, gradient norm and resulting weights.  Then pipeline-parallel
2 (:func:`pp2`), with megatron's 1F1B schedule patched for the CPU too
(:func:`patch_schedule`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import numpy as np
import torch


def patch_cuda() -> None:
    import megatron.core.tensor_parallel as tensor_parallel

    from erlay.actors.learner import megatron_backend

    class NoFork:
        def fork(self, *args: Any, **kwargs: Any) -> Any:
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"   # type: ignore[assignment]
    tensor_parallel.get_cuda_rng_tracker = lambda: NoFork()
    megatron_backend.require_cuda = lambda: None


def grpo_batch(core: Any, vocab: int) -> Any:
    from erlay.actors.learner.core import TrainBatch
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


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def tp2_logits(learner: Any, hf: Any) -> dict[str, float]:
    """Logits of the TP=2 model against HF's, then with rank r holding row chunk r of
    ``[gate; up]`` (planted), then the right shards back."""
    from erlay.actors.learner.megatron_model import load_megatron_state, megatron_logits
    from erlay.actors.model import megatron_convert as mc
    shape = learner.shape
    torch.manual_seed(0)
    tokens = torch.randint(4, shape.vocab_size, (2, 9))
    want = hf(tokens).logits.detach()

    def diff() -> float:
        with torch.no_grad():
            got = megatron_logits(learner.model, tokens)[..., :shape.vocab_size]
        return float((got - want).abs().max())

    good = diff()
    full = mc.hf_to_megatron({k: v.detach() for k, v in hf.state_dict().items()}, shape, tp=2)
    mine = mc.split_tp(full, shape, 2)[learner._tp_rank]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    load_megatron_state(learner.model, {**mine, name: full[name].chunk(2)[learner._tp_rank]
                                        .contiguous()})
    planted = diff()
    load_megatron_state(learner.model, mine)
    return {"logits_max_abs": good, "planted_fc1_logits_max_abs": planted,
            "restored_logits_max_abs": diff()}


def main(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    patch_cuda()
    from transformers import AutoModelForCausalLM

    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.learner.megatron_backend import MegatronLearner
    spec = {"hf": model_dir, "init": "pretrained", "dtype": "float32"}
    hyper: dict[str, Any] = dict(lr=1e-3, max_grad_norm=1e9, seed=0, temperature=0.9)
    core = LearnerCore(spec, **hyper)
    start = core.weights()
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    results: dict[str, Any] = {}
    batch = None
    reference = None
    for i, (name, tp, dp) in enumerate((("tp2", 2, 1), ("dp2", 1, 2))):
        # Micro-batches of 16 tokens (a row or two each) against the HF learner's one pass:
        # the same step, with megatron's gradients accumulated.
        learner = MegatronLearner(spec, device="cpu", rank=rank, world_size=2,
                                  master_port=port + i, tensor_parallel=tp,
                                  data_parallel=dp, micro_batch_tokens=16, **hyper)
        if batch is None:
            batch = grpo_batch(core, learner.shape.vocab_size)
            reference = core.train_step(batch)
        row: dict[str, Any] = {}
        learner._ensure_model()   # the lazy group and model, as the first collective forms them
        if tp == 2:
            row.update(tp2_logits(learner, hf))
        if rank == 0:
            published = learner.weights()
            row["published_is_hf"] = set(published) == set(start) and all(
                np.array_equal(published[k], start[k]) for k in start)
        metrics = learner.train_step(batch)
        row.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"],
                   ref_loss=reference["loss"], ref_grad_norm=reference["grad_norm"])
        if rank == 0:
            row["weights_vs_ref_max_abs"] = max_diff(learner.weights(), core.weights())
            row["weights_moved"] = max_diff(learner.weights(), start)
        if dp == 2:   # SFT (temperature 1, as LearnerCore's) from the step's weights
            args = (batch.prompt_ids, batch.completion_ids, 1, 8)
            row["sft_loss"] = learner.sft(*args, lr=1e-3)["loss_first"]
            row["ref_sft_loss"] = core.sft(*args, lr=1e-3)["loss_first"]
        learner.erlay_terminate()
        results[name] = row
    results["pp2"] = pp2(rank, port + 2, model_dir)
    with open(out, "w") as f:
        json.dump(results, f)




def patch_schedule() -> None:
    """Test-only, on top of :func:`patch_cuda`: megatron's 1F1B schedule counts tokens in a
    tensor it puts on ``"cuda"`` and synchronises CUDA around its batched p2p calls."""
    import types

    from megatron.core.pipeline_parallel import schedules

    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)

    schedules.torch = types.SimpleNamespace(**{**vars(torch), "zeros": zeros})
    torch.cuda.synchronize = lambda *a, **k: None   # type: ignore[assignment]


def stage_logprobs(learner: Any, batch: Any, want: list[list[float]]) -> float | None:
    """Max abs difference of the pipeline's no-grad logprobs (last stage) from ``want``."""
    got = learner._fixed_logprobs(learner.model, batch.prompt_ids, batch.completion_ids)
    if got is None:
        return None
    return max(float((got[b, :len(w)] - torch.tensor(w)).abs().max())
               for b, w in enumerate(want))


def pp2(rank: int, port: int, model_dir: str) -> dict[str, Any]:
    """Pipeline-parallel 2 over the two ranks (stage = rank), with a KL reference and two
    minibatches, against a single LearnerCore with the same settings: the last stage's
    no-grad logprobs (and with stage 1 holding stage 0's layers: planted), rank 0's publish
    (HF weights before, a merge of both stages' own weights after), one GRPO step, then two
    SFT steps."""
    patch_schedule()
    import torch.distributed as dist

    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.learner.megatron_backend import MegatronLearner
    from erlay.actors.learner.megatron_model import load_megatron_state, read_hf_state
    from erlay.actors.model import megatron_convert as mc
    spec = {"hf": model_dir, "init": "pretrained", "dtype": "float32"}
    hyper: dict[str, Any] = dict(lr=1e-3, max_grad_norm=1e9, seed=0, temperature=0.9,
                                 kl_coef=0.05, minibatches=2)
    core = LearnerCore(spec, **hyper)
    start = core.weights()
    learner = MegatronLearner(spec, device="cpu", rank=rank, world_size=2, master_port=port,
                              pipeline_parallel=2, data_parallel=1, **hyper)
    batch = grpo_batch(core, learner.shape.vocab_size)
    from erlay.actors.model.policy import sequence_logprobs
    with torch.no_grad():   # the HF model's logprobs at the learner's temperature
        scored = sequence_logprobs(core._serving_model(), batch.prompt_ids,
                                   batch.completion_ids, temperature=0.9)[0]
    want = [scored[i, :len(c)].tolist() for i, c in enumerate(batch.completion_ids)]
    reference = core.train_step(batch)
    learner._ensure_model()
    row: dict[str, Any] = {"stage": learner._pipe.stage,
                           "layer_numbers": [layer.layer_number for layer in
                                             learner.model.decoder.layers]}
    row["logprobs_max_abs"] = stage_logprobs(learner, batch, want)
    # Planted: stage 1 loaded with stage 0's layer block (the wrong layer offset).
    stages = mc.split_pp(mc.hf_to_megatron(read_hf_state(model_dir), learner.shape),
                         learner.shape, 2)
    mine = stages[learner._pipe.stage]
    if learner._pipe.stage == 1:
        load_megatron_state(learner.model, {**mine, **{k: v for k, v in stages[0].items()
                                                       if k.startswith("decoder.layers.")}})
    row["planted_offset_logprobs_max_abs"] = stage_logprobs(learner, batch, want)
    load_megatron_state(learner.model, mine)
    if rank == 0:
        published = learner.weights()
        row["published_is_hf"] = set(published) == set(start) and all(
            np.array_equal(published[k], start[k]) for k in start)
    metrics = learner.train_step(batch)
    row.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"],
               ref_loss=reference["loss"], ref_grad_norm=reference["grad_norm"],
               clip_fraction=metrics["clip_fraction"],
               ref_clip_fraction=reference["clip_fraction"])
    # Rank 0's published weights against a merge of both stages' own weights.
    local = {k: v.clone() for k, v in learner._local_state().items()}
    parts: list[Any] = [None, None]
    dist.all_gather_object(parts, local)
    if rank == 0:
        merged = mc.megatron_to_hf(mc.merge_pp(parts, learner.shape), learner.shape)
        published = learner.weights()
        row["published_is_stage_merge"] = set(published) == set(merged) and all(
            np.array_equal(published[k], merged[k].numpy()) for k in merged)
        row["weights_vs_ref_max_abs"] = max_diff(published, core.weights())
        row["weights_moved"] = max_diff(published, start)
    # Supervised steps through the pipeline (targets = the completions).
    args = (batch.prompt_ids, batch.completion_ids, 2, 4)
    ours, theirs = learner.sft(*args, lr=1e-3), core.sft(*args, lr=1e-3)
    row.update(sft_loss=[ours["loss_first"], ours["loss_last"]],
               ref_sft_loss=[theirs["loss_first"], theirs["loss_last"]])
    if rank == 0:
        row["sft_weights_vs_ref_max_abs"] = max_diff(learner.weights(), core.weights())
    # Rank 0's state (merged HF weights) restores every stage's shard: train on, restore.
    box = [learner.state() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    learner.train_step(batch)
    learner.load_state(box[0])
    if rank == 0:
        restored = learner.weights()
        row["restored_is_state"] = all(np.array_equal(restored[k], box[0]["model"][k].numpy())
                                       for k in restored)
        row["restored_moved_back"] = max_diff(restored, core.weights())
    learner.erlay_terminate()
    return row


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
