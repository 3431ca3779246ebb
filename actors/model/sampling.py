"""Per-position seeded sampling: the noise for a token is a pure function of (seed, position).

Nothing here keeps RNG state.  The uniform draw for completion position ``p`` of a request with
sampling seed ``s`` is ``uniform(s, p)``, so any rollout can be regenerated exactly, and a
rollout resumed from a journaled prefix of length ``p`` on another engine continues with
position ``p`` and produces the same tokens the first engine would have.  Batch composition,
engine restarts and process boundaries do not enter the computation.

Sampling is inverse-CDF over the float64 softmax of ``logits / temperature``: the token is the
first whose cumulative probability exceeds ``u``.  Float64 keeps the CDF accurate enough that
the last-bit noise of batched float32 logits essentially never moves ``u`` across a boundary.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (Steele, Lea & Flood 2014): a strong 64-bit mixer."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) determined by ``(seed, position)`` alone.

    Counter-based: the seed is mixed first, then the position is folded in and mixed again, so
    neighbouring positions and neighbouring seeds give unrelated draws.  ``seed`` may be any
    int (it is taken modulo 2**64); ``position`` must be >= 0.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (z >> 11) * 2.0 ** -53  # the top 53 bits: every double in [0, 1) on a 2**-53 grid


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` on a uint64 array (numpy's uint64 arithmetic wraps mod 2**64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """:func:`uniform` for many (seed, position) pairs at once, bit-for-bit."""
    if any(p < 0 for p in positions):
        raise ValueError(f"positions must be >= 0, got {min(positions)}")
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _splitmix64_array(_splitmix64_array(s) ^ p)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def uniform_grid(seeds: list[int], starts: list[int], width: int) -> np.ndarray:
    """``[len(seeds), width]``: row ``i`` holds :func:`uniform` of ``seeds[i]`` at positions
    ``starts[i] .. starts[i] + width - 1``, bit-for-bit (the uniforms of a speculative step's
    fed positions), broadcast in numpy instead of flattened Python lists."""
    if any(p < 0 for p in starts):
        raise ValueError(f"positions must be >= 0, got {min(starts)}")
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)[:, None]
    p = np.array(starts, dtype=np.uint64)[:, None] + np.arange(width, dtype=np.uint64)[None]
    with np.errstate(over="ignore"):
        z = _splitmix64_array(_splitmix64_array(s) ^ p)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def sample_token(logits_row: torch.Tensor, temperature: float, seed: int,
                 position: int) -> tuple[int, float]:
    """Sample one token from ``logits_row`` (``[V]``) and return ``(token, logprob)``.

    With ``temperature > 0`` the token is drawn by inverse CDF with ``u = uniform(seed,
    position)`` over ``softmax(logits / temperature)`` in float64, and the logprob is the
    token's log-probability under that same tempered distribution: the behaviour logprob.
    A token of probability zero is never returned.

    With ``temperature == 0`` the token is the argmax (the lowest id among ties) and the
    logprob is taken under the *untempered* softmax (temperature 1).  The greedy policy is a
    point mass whose logprob would always be 0 and tell the learner nothing; the temperature-1
    value is what :func:`erlay.actors.model.policy.sequence_logprobs` computes for the same token,
    so it can be compared with the learner's logprob directly.

    Raises ValueError for a non-1-D row, a negative or non-finite temperature, or logits with
    no finite probability mass (NaN weights must fail loudly, not sample garbage).
    """
    if logits_row.dim() != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {tuple(logits_row.shape)}")
    return sample_token_f64(logits_row.detach().to(torch.float64).cpu().numpy(), temperature,
                            seed, position)


def sample_token_f64(logits_row: np.ndarray, temperature: float, seed: int,
                     position: int) -> tuple[int, float]:
    """:func:`sample_token` on a float64 numpy row: the same computation, minus the conversion.

    The engine converts a whole batch of logits once per step and samples each row with this;
    since float32 -> float64 is exact, the result is bit-for-bit what :func:`sample_token`
    returns for the same row.  (numpy, not torch, because per-call overhead dominates on rows
    this small.)
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    z = logits_row if temperature in (0, 1) else logits_row / temperature
    top = z.max()
    weights = np.exp(z - top)
    # Unnormalised CDF; scaling u by its total (rather than normalising) keeps the draw inside
    # the CDF despite rounding.
    cdf = np.cumsum(weights)
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0:
        raise ValueError("logits have no finite probability mass")
    if temperature == 0:
        token = int(np.argmax(z))
    else:
        token = int(np.searchsorted(cdf, total * uniform(seed, position), side="right"))
        # u * total can round up to total itself; fall back to the last token with mass
        # rather than the last id, which may have probability zero.
        token = min(token, int(np.searchsorted(cdf, total, side="left")))
    return token, float(z[token] - top) - math.log(total)


def sample_rows(logits: np.ndarray, temperatures: np.ndarray, seeds: list[int],
                positions: list[int], u: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample_token_f64` on every row of a float64 ``[N, V]`` matrix at once:
    (tokens ``[N]``, logprobs ``[N]``): the per-row tokens bit-for-bit, the logprobs up to the
    last bit of the logarithm (numpy's vectorised log vs ``math.log``).  ``u``, when given,
    is ``uniforms(seeds, positions)`` computed beforehand (speculative drafting draws for
    several positions in turn); ``seeds`` and ``positions`` are then not read.

    The same elementwise operations in the same order (a cumulative sum runs along each row
    sequentially either way); only the Python loop is gone, which dominates the engine's step
    at high concurrency and in speculative verification.
    """
    if logits.ndim != 2 or len(logits) != len(temperatures):
        raise ValueError(f"logits must be [N, V] with N temperatures, got {logits.shape} "
                         f"and {len(temperatures)}")
    temps = np.asarray(temperatures, dtype=np.float64)
    if not np.all(np.isfinite(temps)) or np.any(temps < 0):
        raise ValueError(f"temperatures must be finite and >= 0, got {temps}")
    plain = (temps == 0) | (temps == 1)
    greedy = temps == 0
    # Passes skipped when they cannot change a value (every row at temperature 0 or 1: no
    # division; no greedy row: no argmax): the same numbers, fewer passes over [N, V].
    if plain.all():
        z = logits
    else:
        scale = np.where(plain, 1.0, temps)
        z = np.where(scale[:, None] == 1.0, logits, logits / scale[:, None])
    top = z.max(axis=1)
    # torch's CPU cumsum adds each row's values one after another in float64, as numpy's
    # does (bit-for-bit, tests/actors/model/test_sampling.py), and is several times faster
    # along the last axis of an [N, V] matrix, where numpy strides.
    cdf_t = torch.from_numpy(np.exp(z - top[:, None])).cumsum(dim=1)
    cdf = cdf_t.numpy()
    total = cdf[:, -1]
    if not np.all(np.isfinite(total)) or np.any(total <= 0):
        raise ValueError("logits have no finite probability mass")
    if u is None:
        u = uniforms(seeds, positions)
    threshold = total * u
    # The count of CDF entries <= the threshold: the per-row rule's searchsorted(right), on
    # rows that never decrease (the weights are >= 0).
    tokens = torch.searchsorted(cdf_t, torch.from_numpy(threshold)[:, None],
                                right=True)[:, 0].numpy()
    if np.any(threshold >= total):
        # Only a threshold rounded up to the total mass can run past the last token with
        # mass (into a zero-probability tail, or to V): clip there, as the per-row rule does.
        tokens = np.minimum(tokens, (cdf < total[:, None]).sum(axis=1))
    if greedy.any():
        tokens = np.where(greedy, np.argmax(z, axis=1), tokens)
    rows = np.arange(len(z))
    return tokens, z[rows, tokens] - top - np.log(total)


def rollout_seed(base_seed: int, rollout_id: str) -> int:
    """The sampling seed of rollout ``rollout_id`` in a job seeded ``base_seed``.

    blake2b, not ``hash()``: the value must be the same in every process and on every run
    (Python salts string hashes per process).  The result is in [0, 2**63), so it also fits a
    signed 64-bit integer.
    """
    digest = hashlib.blake2b(f"{int(base_seed)}\x00{rollout_id}".encode(),
                             digest_size=8, person=b"erlay-seed").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
