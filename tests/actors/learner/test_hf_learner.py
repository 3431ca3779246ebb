"""The learner on Hugging Face models (Llama, Qwen2, GPT-2), without Ray: the same GRPO
step as the built-in model's, deterministic, restorable, and publishing HF-named weights
that the torch engine loads; MTP heads on the HF hidden states, trained beside RL without
moving the policy."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from erlay.actors.config import load_config
from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import run_to_completion
from erlay.actors.job.modelplan import plan_model
from erlay.actors.learner.core import LearnerCore, TrainBatch
from erlay.actors.model.build import build_policy, load_engine_state
from erlay.actors.model.mtp import mtp_loss
from erlay.actors.model.tiny import ARCHITECTURES
from erlay.actors.model.tokens import HFTokenizer, load_hf_tokenizer
from tests.actors.model.hf_tiny import spec, tiny_dirs
from tests.paths import REPO

PROMPTS = ["3+4=", "12+9=", "5*6=", "8-2="]
ANSWERS = [["7", "8"], ["21", "12"], ["30", "11"], ["6", "4"]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_dirs(tmp_path_factory)


def batch_for(core: LearnerCore, tok: HFTokenizer) -> TrainBatch:
    """Four groups of two, as if sampled by ``core``'s current weights: the right answer
    (reward 1), then a wrong one (reward 0)."""
    prompt_ids = [tok.encode(p, bos=True) for p in PROMPTS for _ in range(2)]
    completion_ids = [tok.encode(c, eos=True) for group in ANSWERS for c in group]
    v = core.version()
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=completion_ids,
                      behaviour_logprobs=core.evaluate_logprobs(prompt_ids, completion_ids),
                      versions=[[v] * len(c) for c in completion_ids], rewards=[1.0, 0.0] * 4,
                      group_size=2, rollout_ids=[f"r-{i}" for i in range(8)])


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def trunk(weights: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in weights.items() if not k.startswith("mtp.")}


def test_the_learner_builds_from_the_jobs_model_plan(dirs: dict[str, Path]) -> None:
    cfg = load_config(REPO / "configs" / "cpu.yaml", [f"model.hf={dirs['qwen2']}",
                                                     "model.init=pretrained"])
    plan = plan_model(cfg)
    core = LearnerCore(plan.spec)
    assert core.config.vocab_size == plan.tokenizer.vocab_size
    saved = build_policy(spec(dirs["qwen2"])).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in core.model.state_dict().items())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_grpo_step_is_deterministic_and_moves_the_weights(dirs: dict[str, Path],
                                                            arch: str) -> None:
    tok = load_hf_tokenizer(dirs[arch])
    a, b = LearnerCore(spec(dirs[arch]), seed=7), LearnerCore(spec(dirs[arch]), seed=7)
    before = a.weights()
    batch = batch_for(a, tok)
    right, wrong = batch.completion_ids[0], batch.completion_ids[1]
    start = [sum(a.evaluate_logprobs([batch.prompt_ids[0]], [c])[0]) for c in (right, wrong)]
    for core in (a, b):
        metrics = core.train_step(batch.to_dict())
        assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["tokens"] > 0
    assert not same_weights(before, a.weights())
    assert same_weights(a.weights(), b.weights())   # bit-identical
    after = [sum(a.evaluate_logprobs([batch.prompt_ids[0]], [c])[0]) for c in (right, wrong)]
    assert after[0] > start[0] and after[1] < start[1]   # the advantage's direction


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_state_round_trip_gives_identical_later_steps(dirs: dict[str, Path],
                                                      arch: str) -> None:
    tok = load_hf_tokenizer(dirs[arch])
    a = LearnerCore(spec(dirs[arch]), seed=1, kl_coef=0.1, minibatches=2)
    a.train_step(batch_for(a, tok))
    saved = pickle.loads(pickle.dumps(a.state()))
    batch = batch_for(a, tok)
    # Another seed and random weights: nothing can match unless the state carried it.
    b = LearnerCore(spec(dirs[arch], init="random"), seed=2, kl_coef=0.1, minibatches=2)
    assert not same_weights(a.weights(), b.weights())
    assert b.load_state(saved) == 1
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert same_weights(a.weights(), b.weights())
    ma.pop("time_s"), mb.pop("time_s")
    assert ma == mb and ma["kl"] > 0.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_published_weights_load_into_the_engine_and_generate_as_the_learner_scores(
        dirs: dict[str, Path], arch: str) -> None:
    tok = load_hf_tokenizer(dirs[arch])
    core = LearnerCore(spec(dirs[arch]), lr=1e-2)
    core.train_step(batch_for(core, tok))
    version, state = core.versioned_weights()
    engine = build_policy(spec(dirs[arch]), for_engine=True).eval()
    assert set(state) == set(engine.state_dict())   # HF names, no renaming
    load_engine_state(engine, state)
    prompts = [tok.encode(p, bos=True) for p in PROMPTS]
    reqs = [GenerationRequest(f"g{i}", tuple(p), 8, seed=i, stop_ids=())
            for i, p in enumerate(prompts)]
    seqs = run_to_completion(engine, reqs)
    scored = core.evaluate_logprobs(prompts, [s.completion for s in seqs])
    for seq, row in zip(seqs, scored, strict=True):
        chunk = seq.take_chunk(version, flush=True)
        assert chunk is not None and chunk.version == version == 1
        assert list(chunk.logprobs) == pytest.approx(row, abs=1e-5)


def test_lora_trains_only_adapters_and_publishes_them_merged(dirs: dict[str, Path]) -> None:
    tok = load_hf_tokenizer(dirs["llama"])
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    core = LearnerCore(spec(dirs["llama"], lora=lora), lr=1e-2)
    base = {k: v.clone() for k, v in core.model.state_dict().items() if "lora_" not in k}
    published_before = core.weights()
    core.train_step(batch_for(core, tok))
    assert all(torch.equal(base[k], v) for k, v in core.model.state_dict().items() if k in base)
    state = core.weights()
    assert not any("lora" in k for k in state)
    assert not same_weights(published_before, state)   # the merged adapters moved
    engine = build_policy(spec(dirs["llama"], lora=lora), for_engine=True).eval()
    load_engine_state(engine, state)
    prompts = [tok.encode(p, bos=True) for p in PROMPTS]
    seqs = run_to_completion(engine, [GenerationRequest(f"l{i}", tuple(p), 6, seed=i,
                                                        stop_ids=())
                                      for i, p in enumerate(prompts)])
    scored = core.evaluate_logprobs(prompts, [s.completion for s in seqs])
    for seq, row in zip(seqs, scored, strict=True):
        chunk = seq.take_chunk(1, flush=True)
        assert chunk is not None and list(chunk.logprobs) == pytest.approx(row, abs=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mtp_heads_on_hf_hidden_states_learn_without_moving_the_policy(
        dirs: dict[str, Path], arch: str) -> None:
    tok = load_hf_tokenizer(dirs[arch])
    with_heads = LearnerCore(spec(dirs[arch], mtp_heads=2), lr=1e-2, mtp_loss_weight=1.0)
    no_term = LearnerCore(spec(dirs[arch], mtp_heads=2), lr=1e-2, mtp_loss_weight=0.0)
    assert len(with_heads.model.mtp) == 2
    assert with_heads.model.mtp[0].proj.in_features == 2 * with_heads.config.hidden_size
    batch = batch_for(with_heads, tok)
    losses = []
    for _ in range(6):
        losses.append(with_heads.train_step(batch)["mtp_loss"])
        no_term.train_step(batch)
    assert losses[-1] < 0.8 * losses[0], losses
    a, b = with_heads.weights(), no_term.weights()
    assert same_weights(trunk(a), trunk(b))   # the heads' term leaves the policy alone
    assert not same_weights(a, b)             # and trained the heads
    assert any(k.startswith("mtp.") for k in a)


def test_the_heads_loss_reaches_the_trunk_only_when_not_detached(dirs: dict[str, Path]) -> None:
    """The check above can fail: without the detach, the heads' loss moves the trunk."""
    model = build_policy(spec(dirs["llama"], mtp_heads=2))
    tok = load_hf_tokenizer(dirs["llama"])
    prompts, targets = [tok.encode("3+4=", bos=True)], [tok.encode("7", eos=True)]
    for detach, reaches in ((True, False), (False, True)):
        model.zero_grad(set_to_none=True)
        total, count, _ = mtp_loss(model, prompts, targets, detach_trunk=detach)
        assert count > 0
        total.backward()
        grads = [p.grad for n, p in model.named_parameters() if not n.startswith("mtp.")]
        assert any(g is not None and bool(g.abs().sum() > 0) for g in grads) is reaches
