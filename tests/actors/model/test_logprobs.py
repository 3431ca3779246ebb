"""Chunked target logprobs: the same numbers and gradients as the whole-vocabulary
log-softmax, and no tensor of shape [tokens, vocabulary] alive while they are made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from erlay.actors.model.build import build_policy
from erlay.actors.model.logprobs import chunk_positions, target_logprobs
from erlay.actors.model.policy import left_pad, score_completions
from tests.actors.model.hf_tiny import spec, tiny_dirs

N, D, V = 37, 16, 101


def reference(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary formula the chunked one replaces: (logprobs, entropy)."""
    z = head(hidden).float()
    if temperature not in (0, 1):
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def grads(fn, hidden: torch.Tensor, head: nn.Module, weights: torch.Tensor
          ) -> list[torch.Tensor]:
    """Gradients of ``sum(weights * fn())`` with respect to hidden and the head."""
    params = [hidden, *head.parameters()]
    for p in params:
        p.grad = None
    (fn() * weights).sum().backward()
    return [p.grad.clone() for p in params]


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produced (element count) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture
def case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    weights = torch.randn(N, generator=g)   # an arbitrary upstream gradient
    return hidden, targets, weights


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_head_in_chunks_gives_the_whole_softmax_values_and_gradients(
        case, temperature: float, bias: bool) -> None:
    hidden, targets, weights = case
    head = nn.Linear(D, V, bias=bias)
    chunk_bytes = 4 * V * 5   # five positions a chunk: eight chunks, the last one short
    got = target_logprobs(hidden, head, targets, temperature=temperature,
                          chunk_bytes=chunk_bytes, entropy=True)
    want, want_entropy = reference(hidden, head, targets, temperature)
    torch.testing.assert_close(got.logprobs, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=1e-5, atol=1e-6)
    chunked = grads(lambda: target_logprobs(hidden, head, targets, temperature=temperature,
                                            chunk_bytes=chunk_bytes).logprobs,
                    hidden, head, weights)
    whole = grads(lambda: reference(hidden, head, targets, temperature)[0], hidden, head,
                  weights)
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_any_other_head_is_checkpointed_per_chunk_with_the_same_values_and_gradients(
        case) -> None:
    hidden, targets, weights = case
    head = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    chunk_bytes = 4 * V * 8
    got = target_logprobs(hidden, head, targets, chunk_bytes=chunk_bytes, entropy=True)
    want, want_entropy = reference(hidden, head, targets)
    torch.testing.assert_close(got.logprobs, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=1e-5, atol=1e-6)
    chunked = grads(lambda: target_logprobs(hidden, head, targets,
                                            chunk_bytes=chunk_bytes).logprobs,
                    hidden, head, weights)
    whole = grads(lambda: reference(hidden, head, targets)[0], hidden, head, weights)
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_no_tensor_of_tokens_by_vocabulary_exists_in_forward_or_backward(
        case, head_kind: str) -> None:
    hidden, targets, weights = case
    head = nn.Linear(D, V) if head_kind == "linear" else nn.Sequential(nn.Linear(D, V))
    chunk = 4
    with LargestTensor() as seen:
        out = target_logprobs(hidden, head, targets, chunk_bytes=4 * V * chunk, entropy=True)
        (out.logprobs * weights).sum().backward()
    # A chunk's rows, never every position's (the head's own weight is D x V).
    assert seen.largest <= max(chunk * V, D * V) < N * V
    with LargestTensor() as planted:   # the whole-vocabulary formula is what it catches
        (reference(hidden, head, targets)[0] * weights).sum().backward()
    assert planted.largest >= N * V


def test_bf16_compute_stays_within_bf16_rounding_of_fp32(case) -> None:
    hidden, targets, _ = case
    head = nn.Linear(D, V)
    got = target_logprobs(hidden, head, targets, compute_dtype=torch.bfloat16,
                          chunk_bytes=4 * V * 7)
    want, _ = reference(hidden, head, targets)
    assert got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs, want, rtol=0.0, atol=0.1)
    assert not torch.equal(got.logprobs, want)   # the matmul did run in bf16


def test_chunks_hold_a_byte_budget_whatever_the_vocabulary() -> None:
    assert chunk_positions(151_936, 256 * 2**20) == 441
    assert chunk_positions(151_936, 1) == 1
    assert chunk_positions(96, 256 * 2**20) == 256 * 2**20 // (4 * 96)


def _old_sequence_logprobs(model, prompts, completions, temperature=1.0):
    """The learner's formula before chunking: every position's full log-softmax."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    tokens, positions, mask = left_pad(seqs)
    logits, _ = model(tokens, positions, mask)
    if temperature not in (0, 1):
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    width = max(len(c) for c in completions)
    out = torch.zeros((len(seqs), width))
    for b, comp in enumerate(completions):
        for i, tok in enumerate(comp):
            out[b, i] = logp[b, tokens.shape[1] - len(comp) + i - 1, tok]
    return out


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dirs(tmp_path_factory)["qwen2"]


@pytest.mark.parametrize("kind", ["hf", "builtin"])
def test_scored_completions_equal_the_whole_vocabulary_formula(qwen2: Path, kind: str) -> None:
    model = build_policy(spec(qwen2) if kind == "hf" else
                         {"vocab_size": 40, "d_model": 16, "n_layers": 2, "n_heads": 2,
                          "d_ff": 32, "max_seq_len": 32}, seed=1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    completions = [[10, 11], [12, 13, 14, 15], [16]]
    scores = score_completions(model, prompts, completions, 0.9, chunk_bytes=4 * 3 * 40,
                               entropy=True)
    want = _old_sequence_logprobs(model, prompts, completions, 0.9)
    torch.testing.assert_close(scores.logprobs, want, rtol=1e-5, atol=1e-6)
    assert scores.mask.tolist() == [[True, True, False, False], [True] * 4,
                                    [True, False, False, False]]
    assert bool((scores.entropy[scores.mask] > 0).all())
    assert bool((scores.entropy[~scores.mask] == 0).all())
    params = [p for p in model.parameters() if p.requires_grad]
    g_new = torch.autograd.grad(score_completions(model, prompts, completions, 0.9,
                                                  chunk_bytes=4 * 3 * 40).logprobs.sum(),
                                params, allow_unused=True)
    g_old = torch.autograd.grad(_old_sequence_logprobs(model, prompts, completions, 0.9).sum(),
                                params, allow_unused=True)
    for a, b in zip(g_new, g_old, strict=True):
        if b is None:
            assert a is None or not bool(a.any())
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
