"""MTP heads and self-speculative decoding in the built-in engine's core."""

from __future__ import annotations

import copy
import math
from collections import Counter

import numpy as np
import pytest
import torch

from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence, run_to_completion
from erlay.actors.model.mtp import mtp_loss
from erlay.actors.model.policy import MTPModule, PolicyConfig, PolicyModel
from tests.actors.model.mtp_fit import fit_heads

CONFIG = PolicyConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                      max_seq_len=40, mtp_heads=4)


def model(seed: int = 0) -> PolicyModel:
    torch.manual_seed(seed)
    m = PolicyModel(CONFIG).eval()
    with torch.no_grad():   # a peaked policy, so drafts are sometimes right
        m.head.weight.mul_(40.0)
    return m


def requests(n: int, temperature: float, new: int = 20) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", (1, 3 + i % 5, 4), new, seed=100 + i,
                              temperature=temperature, stop_ids=(2,)) for i in range(n)]


def decode(m: PolicyModel, reqs: list[GenerationRequest], k: int, verify: str = "coupled",
           draft: str = "argmax") -> tuple[list[Sequence], DecodeBatch]:
    seqs = [Sequence(r) for r in reqs]
    batch = DecodeBatch(m)
    batch.admit(seqs)
    while batch.rows:
        batch.step(k, verify, draft)  # type: ignore[arg-type]
    return seqs, batch


@pytest.mark.parametrize("draft", ["argmax", "sample"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_coupled_speculation_is_token_identical_to_plain_decoding(temperature: float,
                                                                  draft: str) -> None:
    m = model()
    plain = run_to_completion(m, requests(6, temperature))
    for k in (1, 3, 4):
        spec, batch = decode(m, requests(6, temperature), k, draft=draft)
        assert [s.completion for s in spec] == [s.completion for s in plain], k
        for a, b in zip(spec, plain, strict=True):
            assert np.allclose(a._unstreamed_logprobs, b._unstreamed_logprobs, atol=1e-4)
        assert batch.drafted > 0


def train_heads(m: PolicyModel, steps: int = 150) -> tuple[float, float]:
    """Train the MTP heads on the policy's greedy completions; (first, last) loss."""
    prompts = [[1, 3 + i % 5, 4] for i in range(16)]
    completions = [s.completion for s in run_to_completion(m, requests(16, 0.0))]
    return fit_heads(m, prompts, completions, steps=steps, lr=3e-3)


def test_trained_heads_raise_acceptance_and_the_loss_falls() -> None:
    m = model()
    _, before = decode(m, requests(16, 0.0), 4)
    first, last = train_heads(m)
    assert last < 0.5 * first
    _, after = decode(m, requests(16, 0.0), 4)
    assert after.accepted / after.drafted > max(0.5, before.accepted / before.drafted)


def test_trunk_is_untouched_by_the_mtp_loss() -> None:
    m = model()
    loss, n, _ = mtp_loss(m, [[1, 3, 4]], [[5, 6, 7, 8, 9]])
    (loss / n).backward()
    grads = {name: p.grad for name, p in m.named_parameters()}
    assert all(g is None for name, g in grads.items() if not name.startswith("mtp."))
    assert all(g is not None for name, g in grads.items() if name.startswith("mtp."))


@pytest.mark.parametrize("draft", ["argmax", "sample"])
def test_rejection_sampling_keeps_the_base_distribution(draft: str) -> None:
    """Tokens at drafted positions follow the base model's marginal (chi-square test), with
    drafts sampled from the heads or proposed as their argmax (a point-mass proposal)."""
    m = model(1)
    with torch.no_grad():
        m.head.weight.div_(20.0)   # spread the distribution: a real test of the sampler
    n = 3000
    reqs = [GenerationRequest(f"s{i}", (1, 3, 4), 2, seed=i, temperature=1.0, stop_ids=())
            for i in range(n)]
    spec, batch = decode(m, reqs, 1, "rejection", draft)
    assert batch.drafted > n / 2
    # Exact marginal of the second token: sum over the first.
    with torch.no_grad():
        from erlay.actors.model.policy import left_pad
        t, pos, mask = left_pad([[1, 3, 4]])
        p1 = torch.softmax(m(t, pos, mask)[0][0, -1].double(), -1)
        ctx = [[1, 3, 4, x] for x in range(CONFIG.vocab_size)]
        t, pos, mask = left_pad(ctx)
        p2 = torch.softmax(m(t, pos, mask)[0][:, -1].double(), -1)
    marginal = (p1[:, None] * p2).sum(0).numpy()
    counts = Counter(s.completion[1] for s in spec)
    observed = np.array([counts.get(x, 0) for x in range(CONFIG.vocab_size)])
    expected = marginal * n
    keep = expected >= 5
    chi2 = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    # p < 0.001 critical value, Wilson-Hilferty approximation
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, (chi2, critical)


def test_learner_trains_the_heads_beside_the_policy() -> None:
    """The MTP loss joins the warm start and every RL step; the heads' accuracy rises."""
    from erlay.actors.learner.core import LearnerCore

    cfg = {**CONFIG.to_dict(), "mtp_heads": 2}
    learner = LearnerCore(cfg, lr=3e-3, seed=0, mtp_loss_weight=1.0)
    prompts = [[1, 3 + i % 4] for i in range(32)]
    targets = [[4 + (i + j) % 6 for j in range(8)] + [2] for i in range(32)]
    _, _, before = mtp_loss(learner.model, prompts, targets)
    learner.sft(prompts, targets, steps=60, batch_size=16)
    _, _, after = mtp_loss(learner.model, prompts, targets)
    assert after[0] > max(0.8, before[0]) and after[1] > max(0.8, before[1])
    plain = LearnerCore(cfg, lr=3e-3, seed=0, mtp_loss_weight=0.0)
    plain.sft(prompts, targets, steps=60, batch_size=16)
    # The heads do not move the policy: its weights train exactly as without the MTP loss.
    for (name, a), (_, b) in zip(learner.model.named_parameters(),
                                 plain.model.named_parameters(), strict=True):
        if not name.startswith("mtp."):
            assert torch.equal(a, b), name


def tally_violations(drafted: int, accepted: int, drafted_at: list[int],
                     accepted_at: list[int]) -> list[str]:
    """What is wrong with a batch's per-position draft counts: they must add up to the
    totals, and a draft at position j + 1 is verified only after the one at j was accepted."""
    bad = []
    if sum(drafted_at) != drafted or sum(accepted_at) != accepted:
        bad.append("per-position counts do not add up to the totals")
    for j, (d, a) in enumerate(zip(drafted_at, accepted_at, strict=True)):
        if a > d:
            bad.append(f"position {j}: more accepted than verified")
        if j + 1 < len(drafted_at) and drafted_at[j + 1] > a:
            bad.append(f"position {j + 1}: verified past a rejection")
    return bad


def test_acceptance_per_draft_position_is_counted_consistently() -> None:
    m = model()
    _, batch = decode(m, requests(8, 1.0), 4)
    assert batch.drafted > 0 and 0 < batch.accepted < batch.drafted
    assert 2 <= len(batch.drafted_at) <= 4
    assert tally_violations(batch.drafted, batch.accepted, batch.drafted_at,
                            batch.accepted_at) == []
    # The check catches counts that verified every draft of every row (a planted fault).
    every = [batch.drafted_at[0]] * len(batch.drafted_at)
    assert tally_violations(sum(every), batch.accepted, every, batch.accepted_at) != []


def test_record_many_is_record_token_by_token() -> None:
    rng = np.random.default_rng(0)
    for case in range(200):
        stops = tuple(int(x) for x in rng.choice(6, size=int(rng.integers(0, 3)),
                                                 replace=False))
        req = GenerationRequest("r", (1,), int(rng.integers(1, 8)), seed=0, stop_ids=stops)
        tokens = [int(x) for x in rng.integers(0, 6, size=int(rng.integers(1, 7)))]
        logprobs = [-float(i) for i in range(len(tokens))]
        one, many = Sequence(req), Sequence(req)
        for _ in range(int(rng.integers(0, 3))):   # some tokens already generated
            one.record(9, -0.5)
            many.record(9, -0.5)
        if one.finished:
            continue
        taken = 0
        for token, logprob in zip(tokens, logprobs, strict=True):
            one.record(token, logprob)
            taken += 1
            if one.finished:
                break
        assert many.record_many(tokens, logprobs) == taken, case
        assert (many.completion, many._unstreamed_logprobs, many.finish_reason) == \
            (one.completion, one._unstreamed_logprobs, one.finish_reason), case


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_switching_between_speculative_and_plain_steps_keeps_plain_tokens(
        temperature: float) -> None:
    """A coupled verification leaves each row's next token already drawn (``forced``); a
    plain step, a speculative one, or a release and re-admission takes it up unchanged."""
    m = model()
    plain = run_to_completion(m, requests(6, temperature, new=24))
    seqs = [Sequence(r) for r in requests(6, temperature, new=24)]
    batch = DecodeBatch(m)
    batch.admit(seqs)
    schedule = [3, 0, 4, 4, 0, 0, 2]
    step = 0
    while batch.rows:
        if step == 4:
            batch.admit(batch.release())
        batch.step(schedule[step % len(schedule)])
        step += 1
    assert batch.drafted > 0
    assert [s.completion for s in seqs] == [s.completion for s in plain]
    for a, b in zip(seqs, plain, strict=True):
        assert np.allclose(a._unstreamed_logprobs, b._unstreamed_logprobs, atol=1e-4)


def test_draft_table_equals_the_module_forward_and_follows_weight_changes() -> None:
    """MTPModule.draft (per-token table) == forward on the embedded token, to float32
    rounding; an in-place update of the embedding, norm_e or proj (an optimiser step, a
    weight load) rebuilds the table, so drafts never use stale weights."""
    torch.manual_seed(0)
    module, embed = MTPModule(16), torch.nn.Embedding(30, 16)
    h, token = torch.randn(5, 16), torch.randint(0, 30, (5,))

    def check() -> None:
        with torch.no_grad():
            want = module(h, embed(token))
            got = module.draft(h, token, embed.weight)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    check()
    with torch.no_grad():
        for param in (embed.weight, module.norm_e.weight, module.proj.weight, module.proj.bias):
            param.add_(torch.randn_like(param))
            check()
        module.load_state_dict(MTPModule(16).state_dict())
        check()


def test_argmax_drafts_do_not_depend_on_the_heads_confidence() -> None:
    """An argmax draft is accepted when the base model draws the head's top token, however
    sure the head is of it; a sampled draft is accepted when the two inverse-CDF draws agree,
    so trained heads less sure than the base lose acceptances when sampled.  Flattening the
    heads' outputs (same ranking) leaves argmax drafting's verification exactly as it was."""
    reqs = requests(16, 1.0, new=24)

    def acceptance(m: PolicyModel, draft: str) -> tuple[int, int]:
        _, batch = decode(m, reqs, 3, draft=draft)
        return batch.accepted, batch.drafted

    sure = model()
    train_heads(sure)
    unsure = copy.deepcopy(sure)
    with torch.no_grad():   # the heads' final norm scaled down: the same order, flatter
        for head in unsure.mtp:
            head.out.weight.mul_(0.2)
            head.out.bias.mul_(0.2)
    assert acceptance(unsure, "argmax") == acceptance(sure, "argmax")
    accepted, drafted = acceptance(unsure, "argmax")
    flat_accepted, flat_drafted = acceptance(unsure, "sample")
    assert accepted / drafted > flat_accepted / flat_drafted


def test_drafts_for_step_speculates_up_to_the_cap_and_zero_means_every_width() -> None:
    """The engine's rule, which the benchmarks share: 0 is "always", not "never"."""
    from erlay.actors.engine.core import drafts_for_step
    assert drafts_for_step(5, 64, 0) == 5
    assert drafts_for_step(5, 16, 16) == 5
    assert drafts_for_step(5, 17, 16) == 0
    assert drafts_for_step(0, 3, 0) == 0
