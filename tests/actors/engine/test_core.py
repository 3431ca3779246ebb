"""The torch engine's batching core, without Ray: cache, batch invariance, resume, logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from erlay.actors.engine.api import ContextTooLong, FinishReason, GenerationRequest, InvalidRequest
from erlay.actors.engine.core import DecodeBatch, Sequence, run_to_completion, validate_request
from erlay.actors.model.policy import PolicyConfig, PolicyModel, left_pad, sequence_logprobs
from erlay.actors.model.sampling import sample_token
from erlay.actors.model.tokenizer import CharTokenizer

VOCAB = CharTokenizer().vocab_size
CONFIG = PolicyConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                      max_seq_len=96)


@pytest.fixture(scope="module")
def model() -> Iterator[PolicyModel]:
    # One thread, as the engine runs: on a shared two-core machine more threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield PolicyModel(CONFIG).eval()
    torch.set_num_threads(threads)


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(4 + (i * 7 + salt * 13) % (VOCAB - 4) for i in range(n))


def request(rid: str, n_prompt: int, new: int, seed: int, **kw: object) -> GenerationRequest:
    kw.setdefault("stop_ids", ())
    return GenerationRequest(rid, prompt(n_prompt, seed), new, seed, **kw)  # type: ignore[arg-type]


def generated_logprobs(seq: Sequence) -> list[float]:
    """All logprobs of the tokens ``seq`` sampled, read back through its chunks."""
    out: list[float] = []
    while (chunk := seq.take_chunk(0, flush=True)) is not None:
        out += chunk.logprobs
    return out


def without_cache(model: PolicyModel, req: GenerationRequest) -> tuple[list[int], list[float]]:
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
            if token in req.stop_ids:
                break
    return tokens, logprobs


def test_cached_decoding_matches_recomputing_without_cache(model: PolicyModel) -> None:
    reqs = [request("a", 5, 20, 1), request("b", 17, 12, 2, temperature=0.7),
            request("c", 30, 9, 3, temperature=0.0)]
    for req, seq in zip(reqs, run_to_completion(model, reqs), strict=True):
        tokens, logprobs = without_cache(model, req)
        assert seq.completion == tokens
        assert generated_logprobs(seq) == pytest.approx(logprobs, abs=1e-5)


def test_batch_of_different_lengths_gives_each_request_its_solo_tokens(
        model: PolicyModel) -> None:
    reqs = [request(f"r{i}", n, new, seed=10 + i)
            for i, (n, new) in enumerate([(2, 30), (9, 20), (26, 25), (41, 12), (60, 30)])]
    together = run_to_completion(model, reqs)
    for req, seq in zip(reqs, together, strict=True):
        alone = run_to_completion(model, [req])[0]
        assert seq.completion == alone.completion, req.request_id
        assert generated_logprobs(seq) == pytest.approx(generated_logprobs(alone), abs=1e-5)


def test_requests_joining_a_running_batch_get_their_solo_tokens(model: PolicyModel) -> None:
    reqs = [request("short", 4, 30, 5), request("mid", 12, 30, 6), request("late", 40, 20, 7)]
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs[:2])  # "short" is left-padded inside this wave
    for _ in range(7):
        batch.step()
    batch.admit(seqs[2:])  # continuous batching: a wider cache merges in
    while batch.rows:
        batch.step()
    for req, seq in zip(reqs, seqs, strict=True):
        assert seq.completion == run_to_completion(model, [req])[0].completion, req.request_id


def test_resume_from_a_prefix_reproduces_the_rest_token_for_token(model: PolicyModel) -> None:
    full_req = request("r", 12, 24, 77, temperature=0.9)
    full = run_to_completion(model, [full_req])[0]
    full_logprobs = generated_logprobs(full)
    for k in (1, 5, 23):
        resumed_req = replace(full_req, prefix_ids=tuple(full.completion[:k]),
                              max_new_tokens=24 - k)
        resumed = run_to_completion(model, [resumed_req])[0]
        assert resumed.completion == full.completion, k
        assert generated_logprobs(resumed) == pytest.approx(full_logprobs[k:], abs=1e-5)


def test_behaviour_logprobs_equal_sequence_logprobs_at_temperature_one(
        model: PolicyModel) -> None:
    reqs = [request(f"r{i}", n, 20, seed=i) for i, n in enumerate([3, 11, 40])]
    seqs = run_to_completion(model, reqs)
    behaviour = [generated_logprobs(s) for s in seqs]
    with torch.no_grad():
        learner, mask = sequence_logprobs(model, [list(r.prompt_ids) for r in reqs],
                                          [s.completion for s in seqs])
    for i, lps in enumerate(behaviour):
        assert bool(mask[i, :len(lps)].all())
        assert learner[i, :len(lps)].tolist() == pytest.approx(lps, abs=1e-4)


def test_sampling_a_stop_id_finishes_with_reason_stop(model: PolicyModel) -> None:
    stops = tuple(range(0, VOCAB, 3))  # a third of the vocabulary: stops within a few tokens
    seq = run_to_completion(model, [request("s", 6, 60, 9, stop_ids=stops)])[0]
    assert seq.finish_reason is FinishReason.STOP
    assert seq.completion[-1] in stops
    assert not set(seq.completion[:-1]) & set(stops)


def test_length_limit_finishes_with_reason_length(model: PolicyModel) -> None:
    seq = run_to_completion(model, [request("l", 6, 13, 9)])[0]
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.completion) == 13


def test_chunks_are_contiguous_bounded_and_end_with_one_final_chunk(model: PolicyModel) -> None:
    seq = Sequence(request("c", 4, 19, 2, chunk_tokens=4, prefix_ids=(5, 6)))
    batch = DecodeBatch(model)
    batch.admit([seq])
    chunks = []
    while batch.rows:
        batch.step()
        if (chunk := seq.take_chunk(3)) is not None:
            chunks.append(chunk)
    assert [c.start for c in chunks] == [2, 6, 10, 14, 18]
    assert [len(c.token_ids) for c in chunks] == [4, 4, 4, 4, 3]
    assert [c.finished for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].finish_reason == "length" and seq.take_chunk(3) is None
    assert [t for c in chunks for t in c.token_ids] == seq.completion[2:]


def test_first_chunk_reports_the_prefill_of_prompt_and_prefix_and_later_chunks_none(
        model: PolicyModel) -> None:
    seq = Sequence(request("p", 4, 6, 2, chunk_tokens=2, prefix_ids=(5, 6, 7)))
    batch = DecodeBatch(model)
    batch.admit([seq])
    chunks = []
    while batch.rows:
        batch.step()
        if (chunk := seq.take_chunk(0)) is not None:
            chunks.append(chunk)
    assert [c.prefill_tokens for c in chunks] == [4 + 3, 0, 0]


def test_a_re_admitted_sequence_reports_its_second_prefill_on_its_next_chunk(
        model: PolicyModel) -> None:
    seq = Sequence(request("w", 5, 8, 3, chunk_tokens=1))
    batch = DecodeBatch(model)
    batch.admit([seq])
    batch.step()
    first = seq.take_chunk(0)
    batch.admit(batch.release())   # what a weight update does: prefill again, now 5 + 1
    batch.step()
    second = seq.take_chunk(0)
    assert first is not None and second is not None
    assert (first.prefill_tokens, second.prefill_tokens) == (5, 6)


def test_prefix_ending_in_a_stop_token_is_finished_at_once() -> None:
    seq = Sequence(GenerationRequest("p", (4, 5), 10, 0, prefix_ids=(7, 2)))
    chunk = seq.take_chunk(0)
    assert chunk is not None and chunk.finished and chunk.finish_reason == "stop"
    assert chunk.token_ids == () and chunk.start == 2


def test_context_too_long_is_refused_naming_the_lengths() -> None:
    req = GenerationRequest("long", prompt(60), 30, 0, prefix_ids=(5,) * 10)
    with pytest.raises(ContextTooLong) as refused:
        validate_request(req, VOCAB, CONFIG.max_seq_len)
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    for number in ("70", "30", "100", "96"):
        assert number in message


def test_request_that_exactly_fills_the_context_is_served(model: PolicyModel) -> None:
    seq = run_to_completion(model, [request("full", 80, 16, 1)])[0]
    assert len(seq.completion) == 16  # 80 + 16 == max_seq_len: the learner can still score it


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        validate_request(GenerationRequest("v", (4, VOCAB), 3, 0), VOCAB, CONFIG.max_seq_len)
