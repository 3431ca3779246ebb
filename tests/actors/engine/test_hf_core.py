"""The torch engine's batching core on Hugging Face models (Llama, Qwen2, GPT-2), without
Ray: the checks of test_core.py and of speculative decoding, run on ``HFPolicy``.

Each check is a function returning what differs, so a planted bug (cached decoding fed
positions one too far) shows the same check failing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence, run_to_completion
from erlay.actors.model.build import build_policy
from erlay.actors.model.hf import HFPolicy
from erlay.actors.model.policy import KVCache, left_pad, sequence_logprobs
from erlay.actors.model.sampling import sample_token
from erlay.actors.model.tiny import ARCHITECTURES
from tests.actors.model.hf_tiny import spec, tiny_dirs
from tests.actors.model.mtp_fit import fit_heads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_dirs(tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the engine runs
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest, dirs: dict[str, Path]) -> HFPolicy:
    return build_policy(spec(dirs[request.param]), for_engine=True).eval()


def prompt(model: Any, n: int, salt: int = 0) -> tuple[int, ...]:
    vocab = model.cfg.vocab_size
    return tuple(6 + (i * 7 + salt * 13) % (vocab - 6) for i in range(n))


def request(model: Any, rid: str, n_prompt: int, new: int, seed: int,
            **kw: Any) -> GenerationRequest:
    kw.setdefault("stop_ids", ())
    return GenerationRequest(rid, prompt(model, n_prompt, seed), new, seed, **kw)


def logprobs_of(seq: Sequence) -> list[float]:
    out: list[float] = []
    while (chunk := seq.take_chunk(0, flush=True)) is not None:
        out += chunk.logprobs
    return out


def without_cache(model: Any, req: GenerationRequest) -> tuple[list[int], list[float]]:
    """Reference decoding: a full forward pass over the whole context for every token."""
    completion = list(req.prefix_ids)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(req.max_new_tokens):
            ids, positions, mask = left_pad([[*req.prompt_ids, *completion]])
            logits, _ = model(ids, positions, mask)
            token, logprob = sample_token(logits[0, -1], req.temperature, req.seed,
                                          len(completion))
            completion.append(token)
            tokens.append(token)
            logprobs.append(logprob)
    return tokens, logprobs


def cache_mismatches(model: Any, reqs: list[GenerationRequest]) -> list[str]:
    """Requests whose batched, cached decoding differs from recomputation without cache."""
    bad = []
    for req, seq in zip(reqs, run_to_completion(model, reqs), strict=True):
        tokens, logprobs = without_cache(model, req)
        if seq.completion != tokens or logprobs_of(seq) != pytest.approx(logprobs, abs=1e-5):
            bad.append(req.request_id)
    return bad


class ShiftedPositions:
    """A planted bug: cached decoding feeds each new token one position too far."""

    def __init__(self, model: HFPolicy) -> None:
        self.inner, self.cfg, self.mtp, self.head = model, model.cfg, model.mtp, model.head

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
               cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        return self.inner.hidden(tokens, positions + (1 if cache else 0), key_mask, cache)

    def __call__(self, *args: Any) -> Any:
        return self.inner(*args)


def three(model: Any) -> list[GenerationRequest]:
    return [request(model, "a", 5, 16, 1), request(model, "b", 17, 12, 2, temperature=0.7),
            request(model, "c", 30, 9, 3, temperature=0.0)]


def test_cached_batched_decoding_matches_recomputing_without_cache(model: HFPolicy) -> None:
    assert cache_mismatches(model, three(model)) == []


def test_a_wrong_position_in_cached_decoding_is_caught(model: HFPolicy) -> None:
    assert cache_mismatches(ShiftedPositions(model), three(model)) != []  # type: ignore[arg-type]


def test_a_request_gets_its_solo_tokens_in_a_left_padded_batch(model: HFPolicy) -> None:
    reqs = [request(model, f"r{i}", n, new, seed=10 + i)
            for i, (n, new) in enumerate([(2, 20), (9, 14), (26, 18), (41, 12)])]
    together = run_to_completion(model, reqs)
    for req, seq in zip(reqs, together, strict=True):
        alone = run_to_completion(model, [req])[0]
        assert seq.completion == alone.completion, req.request_id
        assert logprobs_of(seq) == pytest.approx(logprobs_of(alone), abs=1e-5)


def test_requests_joining_a_running_batch_get_their_solo_tokens(model: HFPolicy) -> None:
    reqs = [request(model, "short", 4, 20, 5), request(model, "mid", 12, 20, 6),
            request(model, "late", 30, 14, 7)]
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs[:2])
    for _ in range(5):
        batch.step()
    batch.admit(seqs[2:])   # a wider cache merges into the running batch
    while batch.rows:
        batch.step()
    for req, seq in zip(reqs, seqs, strict=True):
        assert seq.completion == run_to_completion(model, [req])[0].completion, req.request_id


def test_resume_from_a_prefix_continues_token_for_token(model: HFPolicy) -> None:
    full_req = request(model, "r", 12, 20, 77, temperature=0.9)
    full = run_to_completion(model, [full_req])[0]
    full_logprobs = logprobs_of(full)
    for k in (1, 7, 19):
        resumed_req = replace(full_req, prefix_ids=tuple(full.completion[:k]),
                              max_new_tokens=20 - k)
        resumed = run_to_completion(model, [resumed_req])[0]
        assert resumed.completion == full.completion, k
        assert logprobs_of(resumed) == pytest.approx(full_logprobs[k:], abs=1e-5)


def test_engine_logprobs_equal_the_learners_sequence_logprobs(model: HFPolicy) -> None:
    reqs = [request(model, f"r{i}", n, 16, seed=i) for i, n in enumerate([3, 11, 30])]
    seqs = run_to_completion(model, reqs)
    behaviour = [logprobs_of(s) for s in seqs]
    with torch.no_grad():
        learner, mask = sequence_logprobs(model, [list(r.prompt_ids) for r in reqs],
                                          [s.completion for s in seqs])
    for i, lps in enumerate(behaviour):
        assert bool(mask[i, :len(lps)].all())
        assert learner[i, :len(lps)].tolist() == pytest.approx(lps, abs=1e-5)


@pytest.mark.parametrize("draft", ["sample", "argmax"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_speculative_decoding_with_mtp_heads_is_plain_decodings_output(
        dirs: dict[str, Path], arch: str, draft: str) -> None:
    """Coupled verification on an HF model: drafts from heads on its hidden states, verified
    in one pass with rejected slots masked in the cache, give plain decoding's tokens, under
    either draft rule."""
    model = build_policy(spec(dirs[arch], mtp_heads=3), for_engine=True, seed=1).eval()
    assert len(model.mtp) == 3
    with torch.no_grad():   # near-uniform logits: coupled sampled drafts are often right
        model.head.weight.mul_(0.05)
    reqs = [request(model, f"s{i}", n, 24, seed=i, temperature=t)
            for i, (n, t) in enumerate([(3, 1.0), (14, 1.0), (25, 0.0)])]
    plain = run_to_completion(model, reqs)
    plain_logprobs = [logprobs_of(ref) for ref in plain]   # taken once: it drains the chunks

    def check() -> tuple[int, int]:
        """Decode speculatively, compare with plain decoding; (accepted, drafted)."""
        seqs = [Sequence(r) for r in reqs]
        batch = DecodeBatch(model)
        batch.admit(seqs)
        while batch.rows:
            batch.step(k=3, draft=draft)  # type: ignore[arg-type]
        for ref, want, seq in zip(plain, plain_logprobs, seqs, strict=True):
            assert seq.completion == ref.completion, seq.request_id
            assert logprobs_of(seq) == pytest.approx(want, abs=1e-5)
        return batch.accepted, batch.drafted

    accepted, drafted = check()
    if draft == "argmax":
        # Untrained heads' argmax is rarely the base's draw (the rejection branch); heads
        # fitted to the policy's own completions are often right (the acceptance branch).
        assert accepted < drafted
        fit_heads(model, [list(r.prompt_ids) for r in reqs], [s.completion for s in plain],
                  steps=60, lr=1e-2)
        accepted, _ = check()
        assert accepted > 0
    else:
        assert 0 < accepted < drafted   # both branches of verification ran
