"""One rank of test_megatron_learner.py's two-process check (not a test module):
``python megatron_ranks.py RANK PORT MODEL_DIR OUT_JSON``.

Runs :class:`~erlay.actors.learner.megatron_backend.MegatronLearner` on the CPU over a
2-process gloo group, with megatron's CUDA calls patched (test-only, as in
test_megatron_convert.py), twice: tensor-parallel 2, then data-parallel 2.  Against a
single-process :class:`~erlay.actors.learner.core.LearnerCore` on the same HF model and batch
it records, for rank 0: the TP=2 model's logits before training (and with a planted naive
fc1 split), whether the gathered, merged weights it publishes equal the HF weights bit for
bit, and one GRPO step's loss, gradient norm and resulting weights.
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
        learner = MegatronLearner(spec, device="cpu", rank=rank, world_size=2,
                                  master_port=port + i, tensor_parallel=tp,
                                  data_parallel=dp, **hyper)
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
        learner.erlay_terminate()
        results[name] = row
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
