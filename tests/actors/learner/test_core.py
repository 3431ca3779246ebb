"""The learner without Ray: determinism, the direction of a GRPO update, masking, SFT,
checkpoints and versions.  The helpers at the top are shared with the Ray-level tests."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch

from erlay.actors.learner.core import LearnerCore, TrainBatch, rank_minibatches, shard
from erlay.actors.model.tokenizer import CharTokenizer

TOK = CharTokenizer()
MODEL = {"vocab_size": TOK.vocab_size, "d_model": 64, "n_layers": 2, "n_heads": 4,
         "d_ff": 128, "max_seq_len": 48}
PROMPTS = ["3+4=", "12+9=", "5*6=", "8-2="]
ANSWERS = [["7", "8"], ["21", "12"], ["30", "11"], ["6", "4"]]


def learner(**kwargs: Any) -> LearnerCore:
    return LearnerCore(MODEL, **kwargs)


def on_policy_batch(core: LearnerCore, prompts: list[str], completions: list[list[str]],
                    rewards: list[float], loss_mask: list[list[bool]] | None = None
                    ) -> TrainBatch:
    """One group per prompt, as if sampled by ``core``'s current weights."""
    prompt_ids = [TOK.encode(p, bos=True) for p, group in zip(prompts, completions,
                                                              strict=True) for _ in group]
    completion_ids = [TOK.encode(c, eos=True) for group in completions for c in group]
    v = core.version()
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=completion_ids,
                      behaviour_logprobs=core.evaluate_logprobs(prompt_ids, completion_ids),
                      versions=[[v] * len(c) for c in completion_ids], rewards=rewards,
                      group_size=len(completions[0]),
                      rollout_ids=[f"r-{i}" for i in range(len(completion_ids))],
                      loss_mask=loss_mask)


def arithmetic_batch(core: LearnerCore) -> TrainBatch:
    """Four groups of two: the right answer (reward 1), then a wrong one (reward 0)."""
    return on_policy_batch(core, PROMPTS, ANSWERS, [1.0, 0.0] * 4)


def same_weights(a: LearnerCore, b: LearnerCore) -> bool:
    wa, wb = a.weights(), b.weights()
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def completion_logprob(core: LearnerCore, prompt: str, completion: str) -> float:
    return sum(core.evaluate_logprobs([TOK.encode(prompt, bos=True)],
                                      [TOK.encode(completion, eos=True)])[0])


# ----------------------------------------------------------------------------- the batch
def test_train_batch_round_trips_through_a_dict() -> None:
    batch = arithmetic_batch(learner())
    assert TrainBatch.from_dict(batch.to_dict()) == batch


def test_train_batch_names_the_row_with_a_ragged_token_column() -> None:
    batch = arithmetic_batch(learner())
    bad = [list(v) for v in batch.versions]
    bad[3] = bad[3][:-1]
    with pytest.raises(ValueError, match="row 3: versions"):
        replace(batch, versions=bad)


def test_a_rollout_fed_twice_in_one_batch_is_refused_naming_it() -> None:
    """A duplicate inside one batch (a coordinator bug re-feeding a replayed rollout) would
    be trained twice and collapse in any set of ids downstream: the batch refuses it."""
    batch = arithmetic_batch(learner())
    ids = list(batch.rollout_ids)
    ids[5] = ids[2]
    with pytest.raises(ValueError, match="rollout ids repeat in one batch: r-2"):
        replace(batch, rollout_ids=ids)


def test_nan_behaviour_logprob_is_rejected_only_on_trained_tokens() -> None:
    batch = arithmetic_batch(learner())
    behaviour = [list(row) for row in batch.behaviour_logprobs]
    behaviour[2][0] = float("nan")  # e.g. a tool-output token the engine did not sample
    with pytest.raises(ValueError, match=r"row 2 .*NaN"):
        replace(batch, behaviour_logprobs=behaviour)
    mask = [[True] * len(c) for c in batch.completion_ids]
    mask[2][0] = False
    replace(batch, behaviour_logprobs=behaviour, loss_mask=mask)  # accepted


@pytest.mark.parametrize(("rows", "minibatches", "world"), [(8, 2, 2), (7, 3, 2), (5, 2, 3),
                                                             (4, 1, 2), (3, 4, 2)])
def test_ranks_train_together_exactly_the_rows_of_each_single_learner_minibatch(
        rows: int, minibatches: int, world: int) -> None:
    single = rank_minibatches(rows, minibatches, 1, 0)
    for j in range(minibatches):
        together = [i for r in range(world) for i in rank_minibatches(rows, minibatches,
                                                                      world, r)[j]]
        assert together == single[j]
    # The old pairing (each rank's part of the batch, then minibatches of it) fails this.
    mine = [shard(list(range(8)), 2, r) for r in range(2)]
    old = [[i for part in mine for i in shard(part, 2, j)] for j in range(2)]
    assert old != rank_minibatches(8, 2, 1, 0)


def test_shards_cover_the_indices_once_in_order() -> None:
    idx = list(range(7))
    assert [shard(idx, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert shard([0], 2, 1) == []


# ------------------------------------------------------------------------------- updates
def test_same_seed_and_batch_give_identical_weights() -> None:
    a, b, c = learner(seed=7), learner(seed=7), learner(seed=8)
    batch = arithmetic_batch(a)
    for core in (a, b, c):
        core.train_step(batch.to_dict())
        core.train_step(batch.to_dict())
    assert same_weights(a, b)
    assert not same_weights(a, c)


def test_positive_advantage_raises_its_completions_logprob() -> None:
    core = learner(lr=1e-3)
    before = [completion_logprob(core, "3+4=", c) for c in ("7", "8")]
    metrics = core.train_step(on_policy_batch(core, ["3+4="], [["7", "8"]], [1.0, 0.0]))
    after = [completion_logprob(core, "3+4=", c) for c in ("7", "8")]
    assert after[0] > before[0]  # A = +1
    assert after[1] < before[1]  # A = -1
    # on-policy, one minibatch: ratio and IS weights are exactly 1
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["is_weight_mean"] == 1.0


def test_loss_mask_keeps_masked_tokens_out_of_the_update() -> None:
    # The masked token's behaviour logprob is made absurd (an IS weight far past the cap).
    # Masked, it changes nothing; unmasked, the same batch gives a different update.
    ref = learner()
    batch = arithmetic_batch(ref)
    mask = [[True] * len(c) for c in batch.completion_ids]
    mask[0][0] = False
    garbage = [list(row) for row in batch.behaviour_logprobs]
    garbage[0][0] = -50.0
    clean = learner()
    masked = learner()
    unmasked = learner()
    m_clean = clean.train_step(replace(batch, loss_mask=mask))
    m_masked = masked.train_step(replace(batch, loss_mask=mask, behaviour_logprobs=garbage))
    unmasked.train_step(replace(batch, behaviour_logprobs=garbage))
    assert same_weights(clean, masked)
    assert not same_weights(clean, unmasked)
    total = sum(len(c) for c in batch.completion_ids)
    assert m_clean["tokens"] == m_masked["tokens"] == total - 1
    assert m_masked["is_weight_max_hit_fraction"] == 0.0


def test_a_batch_with_nothing_to_train_on_leaves_the_weights_alone() -> None:
    # After one real step Adam has momentum that would move the weights even with zero
    # gradients; a step with no trained token must not take an optimiser step at all.
    core = learner()
    core.train_step(arithmetic_batch(core))
    before = core.weights()
    batch = arithmetic_batch(core)
    nothing = replace(batch, loss_mask=[[False] * len(c) for c in batch.completion_ids])
    metrics = core.train_step(nothing)
    after = core.weights()
    assert all((before[k] == after[k]).all() for k in before)
    assert metrics["tokens"] == 0 and metrics["version"] == 2


def test_minibatches_step_the_optimizer_once_each_within_one_version() -> None:
    core = learner(minibatches=2, lr=1e-2)
    metrics = core.train_step(arithmetic_batch(core))
    steps = {int(s["step"]) for s in core.optimizer.state_dict()["state"].values()}
    assert steps == {2} and metrics["version"] == 1
    # the second minibatch runs on moved weights, against the step's proximal logprobs
    assert metrics["approx_kl"] > 0.0


def test_sft_lowers_cross_entropy_on_its_data() -> None:
    core = learner(lr=3e-3)
    prompts = [TOK.encode(p, bos=True) for p in PROMPTS]
    targets = [TOK.encode(group[0], eos=True) for group in ANSWERS]

    def cross_entropy() -> float:
        rows = core.evaluate_logprobs(prompts, targets)
        return -sum(map(sum, rows)) / sum(map(len, rows))

    before = cross_entropy()
    summary = core.sft(prompts, targets, steps=40, batch_size=2)
    assert cross_entropy() < 0.5 * before
    assert summary["loss_last"] < summary["loss_first"] and summary["steps"] == 40
    assert summary["curve"][0][0] == 0 and summary["curve"][-1][0] == 39


# ------------------------------------------------------------------- versions, checkpoints
def test_version_counts_train_steps_and_sft_calls() -> None:
    core = learner()
    assert core.version() == 0
    prompts, targets = [TOK.encode("1+1=", bos=True)], [TOK.encode("2", eos=True)]
    assert core.sft(prompts, targets, steps=3, batch_size=1)["version"] == 1
    batch = arithmetic_batch(core)  # every token made by version 1
    # each completion's first token from version 0; row 0's made by no policy (-1, ignored)
    versions = [[0, *v[1:]] for v in batch.versions]
    versions[0][0] = -1
    metrics = core.train_step(replace(batch, versions=versions))
    assert (metrics["step"], metrics["version"], core.version()) == (1, 2, 2)
    # learner at version 1 when the step began; oldest tokens from version 0 -> lag 1
    assert metrics["staleness_max"] == 1.0 and metrics["staleness_min"] == 0.0
    assert metrics["staleness_mean"] == pytest.approx(7 / 8)


def test_state_round_trip_gives_identical_later_steps() -> None:
    # kl_coef > 0, so the frozen reference must travel too; the restoring learner starts
    # from another seed, so nothing can match by accident.
    a = learner(seed=1, kl_coef=0.1, minibatches=2)
    a.train_step(arithmetic_batch(a))
    saved = pickle.loads(pickle.dumps(a.state()))
    batch = arithmetic_batch(a)
    b = learner(seed=2, kl_coef=0.1, minibatches=2)
    assert b.load_state(saved) == a.version() == 1
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert same_weights(a, b)
    ma.pop("time_s"), mb.pop("time_s")
    assert ma == mb and ma["kl"] > 0.0
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])


def test_load_state_keeps_this_learners_hyperparameters() -> None:
    resumed = learner(lr=5e-2)
    resumed.load_state(learner(lr=1e-3).state())
    assert resumed.optimizer.param_groups[0]["lr"] == 5e-2


def test_load_state_rejects_another_model_shape() -> None:
    saved = learner().state()
    other = LearnerCore({**MODEL, "d_model": 32})
    with pytest.raises(ValueError, match="model config"):
        other.load_state(saved)


def test_progress_is_idle_after_a_step_and_ticked_during_it() -> None:
    core = learner(minibatches=2)
    before = core.progress.snapshot().counter
    core.train_step(arithmetic_batch(core))
    after = core.progress.snapshot()
    # begin + proximal pass + two minibatches + end
    assert after.counter - before == 5 and after.phase is None
