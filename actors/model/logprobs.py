"""Log-probabilities of chosen tokens from hidden states, without the whole logits tensor.

A policy's output head maps each position's hidden state ``[D]`` to a row of logits over the
vocabulary ``[V]``; the learner needs only one entry of each row's log-softmax, the chosen
token's.  At Qwen's vocabulary (151,936) the fp32 rows of a 64 x 768-token minibatch are
30 GB, and autograd keeps copies of them for the backward pass.  :func:`target_logprobs`
computes the same numbers over chunks of positions, each chunk's rows made, reduced and
dropped before the next, in the forward and the backward pass alike:

- for a plain ``nn.Linear`` head (every HF causal LM erlay serves, and the built-in model)
  a custom autograd function keeps only the hidden states and each position's log-sum-exp
  between the passes, and recomputes a chunk's logits in backward to form its gradient in
  place: at most one chunk's ``[c, V]`` fp32 rows and their compute-dtype copy exist at once;
- any other head module runs under activation checkpointing per chunk (its own forward,
  recomputed in backward): a few chunks' worth of rows at once, whatever the head is.

The chunk holds ``chunk_bytes // (4 * V)`` positions (at least one), so the bound is a byte
budget, the same for every vocabulary: a small model's rows fit in one chunk and pay no
loop.  Numerically this equals ``log_softmax(head(h).float() / T)`` gathered at the targets,
to fp32 rounding (``tests/actors/model/test_logprobs.py``).

Temperature: logits are divided by ``temperature`` unless it is 0 or 1 (greedy decoding is
scored at 1, as the engines report it).  ``compute_dtype`` (bf16 under mixed precision): the
head's matmuls run in it, the softmax in fp32.

Contract: pure functions of tensors and modules; no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Bytes of one chunk's fp32 logits: 256 MiB is 441 positions at Qwen's vocabulary.
DEFAULT_CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TargetLogprobs:
    """The chosen tokens' logprobs ``[N]`` (differentiable) and, when asked for, each
    position's entropy ``[N]`` of the tempered distribution (no gradient: a statistic)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


def chunk_positions(vocab_size: int, chunk_bytes: int) -> int:
    """Positions per chunk: as many fp32 logits rows as fit ``chunk_bytes``, at least one.

    >>> chunk_positions(151936, 256 * 2**20)
    441
    >>> chunk_positions(300, 256 * 2**20) > 10**5
    True
    """
    return max(1, int(chunk_bytes) // (4 * max(1, int(vocab_size))))


def target_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *,
                    temperature: float = 1.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    compute_dtype: torch.dtype | None = None,
                    entropy: bool = False) -> TargetLogprobs:
    """``log softmax(head(hidden) / T)[targets]`` for ``hidden`` ``[N, D]``, ``targets``
    ``[N]`` (module docstring), and optionally the entropy of each row.  Differentiable in
    ``hidden`` and in the head's parameters."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, D] and targets [N]; got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    inv_t = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TargetLogprobs(empty + hidden.sum() * 0.0, empty if entropy else None)
    if type(head) is nn.Linear:
        vocab = head.weight.shape[0]
        ent = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) \
            if entropy else None
        logp = _LinearTargetLogprobs.apply(hidden, head.weight, head.bias, targets, inv_t,
                                           chunk_positions(vocab, chunk_bytes),
                                           compute_dtype, ent)
        return TargetLogprobs(logp, ent)
    return _checkpointed(hidden, head, targets, inv_t, chunk_bytes, compute_dtype, entropy)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            inv_t: float) -> torch.Tensor:
    """One chunk's fp32 logits, tempered, from weights already in the compute dtype."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight,
                                   None if bias is None else bias.to(weight.dtype)).float()
    return z.mul_(inv_t) if inv_t != 1.0 else z


def _row_entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``H = lse - sum softmax(z) * z`` per row of ``z`` ``[c, V]`` (``z`` is consumed)."""
    weighted = (z - lse[:, None]).exp_().mul_(z).sum(-1)
    return lse - weighted


class _LinearTargetLogprobs(torch.autograd.Function):
    """Chunked target logprobs of a linear head (module docstring); ``entropy`` (a
    preallocated ``[N]`` tensor, or None) is filled in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None, targets: torch.Tensor, inv_t: float, chunk: int,
                compute_dtype: torch.dtype | None, entropy: torch.Tensor | None
                ) -> torch.Tensor:
        dtype = compute_dtype or weight.dtype
        w = weight.detach().to(dtype)   # one cast per pass, not per chunk
        b = None if bias is None else bias.detach()
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _logits(hidden[s:e].detach(), w, b, inv_t)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            if entropy is not None:
                entropy[s:e] = _row_entropy(z, lse[s:e])
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_t, ctx.chunk, ctx.dtype = inv_t, chunk, dtype
        ctx.mark_non_differentiable(lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        inv_t, chunk, dtype = ctx.inv_t, ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.detach().to(dtype)
        b = None if bias is None else bias.detach()
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if need_b else None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e].detach()
            g = grad_out[s:e].float()
            # d logp_t / d z = onehot(t) - softmax(z), times the temperature's 1/T: the
            # softmax is made in place over the recomputed logits.
            dz = _logits(h, w, b, inv_t).sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(1, targets[s:e, None], g[:, None])
            if inv_t != 1.0:
                dz.mul_(inv_t)
            if grad_b is not None:
                grad_b += dz.sum(0)
            dzc = dz.to(dtype)
            del dz
            if grad_h is not None:
                grad_h[s:e] = (dzc @ w).to(hidden.dtype)
            if grad_w is not None:   # accumulated in fp32, as autograd does for fp32 weights
                if dtype == torch.float32:
                    grad_w.addmm_(dzc.t(), h.float())
                else:
                    grad_w.add_(dzc.t() @ h.to(dtype))
            del dzc
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None,
                None)


def _checkpointed(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                  inv_t: float, chunk_bytes: int, compute_dtype: torch.dtype | None,
                  entropy: bool) -> TargetLogprobs:
    """Any head: each chunk's logits under activation checkpointing (module docstring)."""
    probe = head(hidden[:1].to(compute_dtype) if compute_dtype else hidden[:1])
    chunk = chunk_positions(probe.shape[-1], chunk_bytes)

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        z = head(h.to(compute_dtype) if compute_dtype else h).float()
        z = z * inv_t if inv_t != 1.0 else z
        return z.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)

    parts, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s:s + chunk], targets[s:s + chunk]
        parts.append(checkpoint(piece, h, t, use_reentrant=False)
                     if torch.is_grad_enabled() else piece(h, t))
        if entropy:
            with torch.no_grad():
                z = head(h.to(compute_dtype) if compute_dtype else h).float()
                z = z * inv_t if inv_t != 1.0 else z
                ents.append(_row_entropy(z, torch.logsumexp(z, dim=-1)))
    return TargetLogprobs(torch.cat(parts), torch.cat(ents) if entropy else None)
