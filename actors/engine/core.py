"""Batched decoding with a KV cache: the torch engine's core, with no Ray and no asyncio.

:class:`Sequence` is one request's decoding state (its completion so far and the tokens not
yet streamed).  :class:`DecodeBatch` decodes a set of sequences together:

- ``admit`` prefills new sequences (prompt + prefix + anything generated so far, left-padded)
  and merges their cache into the running batch, so requests can join between any two steps
  (continuous batching);
- ``step`` samples one token per running sequence from its pending logits, drops the ones that
  finished, and feeds the rest one token through the model with the cache;
- ``release`` hands every sequence back and forgets the cache, e.g. before a weight update, so
  that re-admitting them prefills with the new weights.

The cache is a :class:`~erlay.actors.model.policy.KVBuffer`: preallocated keys and values with
their key mask, into which each forward pass writes its new slots in place (no per-step
concatenation of the whole cache, no conversion to and from a library's cache object).

Batch invariants (what ``admit`` and ``step`` keep true between calls):

- every row's real tokens are right-aligned in the cache and marked in its key mask; padding
  sits on the left and is never attended to;
- row ``i``'s cache holds exactly ``len(rows[i].context)`` tokens, and ``_next_logits[i]`` is
  its distribution for completion position ``rows[i].position``.

Sampling uses :func:`erlay.actors.model.sampling.sample_rows` (row by row, exactly
:func:`~erlay.actors.model.sampling.sample_token_f64`) with the request's seed and the completion
position, so the tokens a request gets do not depend on what else is in the batch, on whether
speculation drafted them (coupled verification), on whether the cache was used, or on which
engine resumed it (up to float32 rounding of the logits, which moves a sampled token only if
``u`` lands within ~1e-7 of a CDF boundary).

Every method runs under ``torch.inference_mode()`` itself, because inference mode is
thread-local and the engine calls these methods from a worker thread.

The batch's tensors live where torch's default device puts them (the model's inputs are
made with no device), and logits are copied to the host only for sampling, so a caller that
sets ``torch.set_default_device("cuda")`` before building the model decodes on the GPU
(``bench/gpu/hf_smoke.py``); the engine actor runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from erlay.actors.engine.api import (
    ContextTooLong,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    TokenChunk,
)
from erlay.actors.model.build import Policy
from erlay.actors.model.mtp import Draft, Verify, draft_token, point_mass_logits, verify_draft
from erlay.actors.model.policy import KVBuffer, KVCache, left_pad
from erlay.actors.model.sampling import sample_rows, uniform_grid


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Refuse a request the model cannot serve, before it can reach (and crash) a batch.

    Raises :class:`ContextTooLong` when ``prompt + prefix + max_new_tokens > max_seq_len`` and
    :class:`InvalidRequest` for a token id outside the vocabulary.
    """
    context = len(request.prompt_ids) + len(request.prefix_ids)
    if context + request.max_new_tokens > max_seq_len:
        raise ContextTooLong(request.request_id, context, request.max_new_tokens, max_seq_len)
    for name in ("prompt_ids", "prefix_ids"):
        bad = [t for t in getattr(request, name) if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"request {request.request_id}: {name} has token id(s) "
                                 f"{bad[:5]} outside the vocabulary [0, {vocab_size})")


def drafts_for_step(spec_k: int, running: int, max_concurrency: int) -> int:
    """Drafts per row for the next step: ``spec_k`` while at most ``max_concurrency``
    requests run (0: at every width), else 0 (a plain step).  The engine's rule, shared
    with the benchmarks so that they decode as it does."""
    return spec_k if spec_k and (not max_concurrency or running <= max_concurrency) else 0


@dataclass(frozen=True)
class Adoption:
    """Saved KV caches that some sequences resume from (``request_ids``, in order), laid out
    as a prefill's would be: each layer's keys and values ``[R, heads, width, head_dim]``
    with row ``i``'s first ``positions[i]`` context positions right-aligned, their key mask
    ``[R, width]``, and ``hidden`` ``[R, D]``, the state after each row's last position where
    ``whole[i]`` (its cache is its whole context), else unused."""

    request_ids: list[str]
    cache: KVCache
    mask: torch.Tensor
    positions: list[int]
    hidden: torch.Tensor
    whole: list[bool]


class Sequence:
    """One request's decoding state.

    ``completion`` is ``prefix_ids`` plus every token sampled so far; ``position`` (its length)
    is the completion position of the next token.  Tokens from ``chunk_start`` on have not been
    streamed yet.  Mutated only by its batch's owner.
    """

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.completion: list[int] = list(request.prefix_ids)
        self.chunk_start = len(request.prefix_ids)
        self._unstreamed_logprobs: list[float] = []
        self.finish_reason: FinishReason | None = None
        self.closed = False           # the final chunk has been taken
        self.abort_requested = False  # set by anyone; applied by the batch owner between steps
        # The next token and its logprob, already chosen by a speculative verification (the
        # rejection rule's residual draw); the batch records it instead of sampling.
        self.forced: tuple[int, float] | None = None
        # Context tokens prefilled since the last chunk: reported on the next one
        # (TokenChunk.prefill_tokens), so a caller learns what admitting it cost.
        self.prefill_unreported = 0
        # How a resumed request's cache was restored (a kv_handoff REASONS value), reported
        # on its first chunk (TokenChunk.kv_handoff); None when no hand-off was tried.
        self.handoff: str | None = None
        if request.prefix_ids and request.prefix_ids[-1] in request.stop_ids:
            # The completion already ended before the interruption; nothing left to generate.
            self.finish_reason = FinishReason.STOP

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def position(self) -> int:
        return len(self.completion)

    @property
    def context(self) -> list[int]:
        return [*self.request.prompt_ids, *self.completion]

    @property
    def generated(self) -> int:
        """Tokens sampled by this request (beyond ``prefix_ids``)."""
        return len(self.completion) - len(self.request.prefix_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record(self, token: int, logprob: float) -> None:
        """Append a sampled token and decide whether the sequence is finished."""
        self.completion.append(token)
        self._unstreamed_logprobs.append(logprob)
        if token in self.request.stop_ids:
            self.finish_reason = FinishReason.STOP
        elif self.generated >= self.request.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def record_many(self, tokens: list[int], logprobs: list[float]) -> int:
        """:meth:`record` each token in turn until the sequence finishes, in one go; returns
        how many were recorded."""
        stops = self.request.stop_ids
        n = min(len(tokens), max(1, self.request.max_new_tokens - self.generated))
        for j in range(n):
            if tokens[j] in stops:
                n = j + 1
                break
        self.completion.extend(tokens[:n])
        self._unstreamed_logprobs.extend(logprobs[:n])
        if n and tokens[n - 1] in stops:
            self.finish_reason = FinishReason.STOP
        elif n and self.generated >= self.request.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return n

    def finish(self, reason: FinishReason) -> None:
        """End the sequence now (an abort); a reason already set is kept."""
        if self.finish_reason is None:
            self.finish_reason = reason

    @property
    def chunk_due(self) -> bool:
        """A chunk will be taken after this step: the points where the caller journals."""
        return self.finished or len(self._unstreamed_logprobs) >= self.request.chunk_tokens

    def take_chunk(self, version: int, *, flush: bool = False) -> TokenChunk | None:
        """The next chunk to stream, or None when there is nothing to send yet.

        A chunk is due when ``chunk_tokens`` tokens are waiting, when ``flush`` is set and any
        are waiting, and always once when the sequence finished (possibly with no tokens).
        """
        if self.closed:
            return None
        waiting = len(self._unstreamed_logprobs)
        due = self.finished or waiting >= self.request.chunk_tokens or (flush and waiting)
        if not due:
            return None
        chunk = TokenChunk(self.request_id, self.chunk_start,
                           tuple(self.completion[self.chunk_start:]),
                           tuple(self._unstreamed_logprobs), version, self.finished,
                           self.finish_reason, prefill_tokens=self.prefill_unreported,
                           kv_handoff=self.handoff)
        self.chunk_start = len(self.completion)
        self._unstreamed_logprobs = []
        self.prefill_unreported = 0
        self.handoff = None
        self.closed = self.finished
        return chunk

    def final_abort_chunk(self, version: int) -> TokenChunk:
        """A zero-token abort chunk that closes the stream at once (for shutdown).

        Unstreamed tokens are dropped rather than read while a worker thread may be appending
        to them; they are not lost, since a resume from the streamed prefix regenerates them
        token-for-token.
        """
        self.finish(FinishReason.ABORT)
        self.closed = True
        return TokenChunk(self.request_id, self.chunk_start, (), (), version, True,
                          FinishReason.ABORT)


def _pad_left(cache: KVCache, mask: torch.Tensor, width: int) -> tuple[KVCache, torch.Tensor]:
    """Widen a cache and its key mask to ``width`` slots with masked padding on the left."""
    extra = width - mask.shape[1]
    if extra == 0:
        return cache, mask
    padded = []
    for k, v in cache:
        pad = k.new_zeros((k.shape[0], k.shape[1], extra, k.shape[3]))
        padded.append((torch.cat([pad, k], dim=2), torch.cat([pad, v], dim=2)))
    return padded, torch.cat([mask.new_zeros((mask.shape[0], extra)), mask], dim=1)


def _draft_draw(q: torch.Tensor, scale: torch.Tensor | None, greedy: torch.Tensor | None,
                u: torch.Tensor) -> torch.Tensor:
    """Coupled drafts from head logits ``q`` ``[B, V]``: the inverse-CDF draw at ``u``
    ``[B, 1]`` of ``softmax(q / scale)`` (``scale`` None: 1), argmax where ``greedy`` (None:
    no row), in torch on the logits' device, in their precision.

    The rule of :func:`~erlay.actors.model.sampling.sample_rows` without its bit-exact
    host-side float64 pass: a draft is only a proposal, verified by the exact draw, so a
    rounding difference at a CDF boundary can at worst cost one acceptance, never a token.
    """
    z = q if scale is None else q / scale
    drawn = torch.searchsorted(z.softmax(dim=-1).cumsum(dim=-1), u, right=True)[:, 0]
    drawn = drawn.clamp_(max=q.shape[-1] - 1)
    return drawn if greedy is None else torch.where(greedy, z.argmax(dim=-1), drawn)


class DecodeBatch:
    """Sequences decoded together with one KV cache (see the module docstring for invariants).

    Not thread-safe: one owner calls its methods, one at a time.
    """

    def __init__(self, model: Policy) -> None:
        self.model = model
        self.rows: list[Sequence] = []
        self._cache: KVBuffer | None = None             # with its [B, S] real-token mask
        self._next_logits: torch.Tensor | None = None   # [B, V]
        self._next_hidden: torch.Tensor | None = None   # [B, D]: what produced them
        self.drafted = 0    # MTP drafts verified, and accepted, since the batch was made
        self.accepted = 0
        self.drafted_at: list[int] = []    # the same per draft position (0: the first draft)
        self.accepted_at: list[int] = []
        # The token each row was fed in the last step, when it was a plain step (one new
        # cache slot per row, the last): what the KV hand-off saves without a row loop.
        self.fed: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def admit(self, seqs: list[Sequence], adoption: Adoption | None = None) -> None:
        """Prefill ``seqs`` and add them to the batch; each gets its next-token logits.

        The sequences ``adoption`` names start from saved caches of their first context
        positions instead (:mod:`erlay.actors.engine.kv_handoff`): only the positions a cache
        lacks are prefilled, none when it is the whole context."""
        if not seqs:
            return
        if any(s.finished for s in seqs):
            raise ValueError("a finished sequence cannot be admitted")
        adopted = set(adoption.request_ids) if adoption is not None else set()
        fresh = [s for s in seqs if s.request_id not in adopted]
        if fresh:
            contexts = [s.context for s in fresh]
            for seq, context in zip(fresh, contexts, strict=True):
                seq.prefill_unreported += len(context)   # no prefix cache: all of it
            tokens, positions, mask = left_pad(contexts)
            buffer = KVBuffer.empty(mask)
            hidden, _ = self.model.hidden(tokens, positions, mask, buffer)
            self._merge(buffer, mask, hidden[:, -1])
            self.rows.extend(fresh)
        if adoption is not None:
            by_id = {s.request_id: s for s in seqs}
            resumed = [by_id[r] for r in adoption.request_ids]
            buffer, next_hidden = self._resume(resumed, adoption)
            self._merge(buffer, buffer.mask[:, :buffer.width], next_hidden)
            self.rows.extend(resumed)

    def _resume(self, seqs: list[Sequence], adoption: Adoption
                ) -> tuple[KVBuffer, torch.Tensor]:
        """The cache of ``seqs`` rebuilt from ``adoption``, the rest of each context
        prefilled in one pass (a row's padding sits between its cache and its rest); and
        the hidden states their next tokens follow from."""
        rests = []
        for seq, n, whole in zip(seqs, adoption.positions, adoption.whole, strict=True):
            context = seq.context
            if not 0 < n <= len(context) or (whole and n != len(context)) or \
                    (not whole and n == len(context)):
                raise ValueError(f"{seq.request_id}: an adopted cache of {n} positions "
                                 f"(whole={whole}) for a context of {len(context)}")
            rests.append(context[n:])
        buffer = KVBuffer.from_cache(adoption.cache, adoption.mask)
        t = max(len(r) for r in rests)
        if t == 0:
            return buffer, adoption.hidden
        width = buffer.width
        mask = buffer.reserve(t)
        tokens = torch.zeros((len(seqs), t), dtype=torch.long)
        positions = torch.zeros((len(seqs), t), dtype=torch.long)
        for i, (rest, n) in enumerate(zip(rests, adoption.positions, strict=True)):
            pad = t - len(rest)
            mask[i, width:width + pad] = False
            if rest:
                tokens[i, pad:] = torch.tensor(rest)
                positions[i, pad:] = torch.arange(n, n + len(rest))
            seqs[i].prefill_unreported += len(rest)
        hidden, _ = self.model.hidden(tokens, positions, mask, buffer)
        whole = torch.tensor(adoption.whole)[:, None]
        return buffer, torch.where(whole, adoption.hidden.to(hidden.dtype), hidden[:, -1])

    def _merge(self, buffer: KVBuffer, mask: torch.Tensor, next_hidden: torch.Tensor) -> None:
        """Add prefilled rows (their cache ``buffer`` with key mask ``mask``) to the batch."""
        next_logits = self.model.head(next_hidden)
        if self._cache is None or self._next_logits is None or self._next_hidden is None:
            self._cache = buffer
            self._next_logits, self._next_hidden = next_logits, next_hidden
            return
        old = self._cache
        width = max(old.width, mask.shape[1])
        old_cache, old_mask = _pad_left(old.legacy(), old.mask[:, :old.width], width)
        new_cache, new_mask = _pad_left(buffer.legacy(), mask, width)
        merged = [(torch.cat([ko, kn]), torch.cat([vo, vn]))
                  for (ko, vo), (kn, vn) in zip(old_cache, new_cache, strict=True)]
        self._cache = KVBuffer.from_cache(merged, torch.cat([old_mask, new_mask]))
        self._next_logits = torch.cat([self._next_logits, next_logits])
        self._next_hidden = torch.cat([self._next_hidden, next_hidden])

    def kv_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor,
                                torch.Tensor, int]:
        """The cache as it stands, for reading between steps (no copies): each layer's keys
        and values ``[B, heads, capacity, head_dim]`` and the key mask ``[B, capacity]``
        (False: padding or a rejected draft), of which the first ``width`` slots are in use
        (the last value), and the hidden states the rows' next tokens follow from ``[B, D]``.
        A slot once written is never written again, so a view of the used slots stays
        valid through later steps."""
        assert self._cache is not None and self._next_hidden is not None
        cache = self._cache
        return cache.keys, cache.values, cache.mask, self._next_hidden, cache.width

    @torch.inference_mode()
    def step(self, k: int = 0, verify: Verify = "coupled",
             draft: Draft = "argmax") -> list[Sequence]:
        """Sample one token for every row, then advance the rows that go on by one position.
        With ``k > 0`` and MTP heads, each row also drafts up to ``k`` more tokens by the
        ``draft`` rule, verified in the same forward pass by the ``verify`` rule
        (:meth:`_speculate`; the rules are in :mod:`erlay.actors.model.mtp`).

        Returns the sequences that finished in this step (already removed from the batch).
        """
        if not self.rows:
            return []
        self.fed = None
        if k > 0 and len(self.model.mtp) > 0:
            return self._speculate(min(k, len(self.model.mtp)), verify, draft)
        assert self._next_logits is not None
        self._sample_next()
        finished = self.drop_finished()
        if self.rows:
            self._advance()
        return finished

    def _sample_next(self) -> None:
        """Record each row's next token: sampled from its pending logits, or the token a
        rejected draft's verification already chose (``Sequence.forced``)."""
        assert self._next_logits is not None
        rows = self.rows
        if all(s.forced is not None for s in rows):
            tokens: list[int] = []    # nothing left to sample
            logprobs: list[float] = []
        else:
            logits = self._next_logits.to(torch.float64).cpu().numpy()
            drawn, scores = self._sample(logits, rows, [len(s.completion) for s in rows])
            tokens, logprobs = drawn.tolist(), scores.tolist()
        for i, seq in enumerate(rows):
            if seq.forced is not None:
                seq.record(*seq.forced)
                seq.forced = None
            else:
                seq.record(tokens[i], logprobs[i])

    @staticmethod
    def _sample(logits: np.ndarray, seqs: list[Sequence],
                positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i`` of ``logits`` sampled for ``seqs[i]`` at ``positions[i]``."""
        return sample_rows(logits, np.array([s.request.temperature for s in seqs]),
                           [s.request.seed for s in seqs], positions)

    def _advance(self) -> None:
        assert self._cache is not None
        # The token fed is each row's last one; positions count real tokens, so its position
        # is the context length minus one.
        tokens = torch.tensor([s.completion[-1] for s in self.rows])[:, None]
        positions = torch.tensor([len(s.request.prompt_ids) + len(s.completion) - 1
                                  for s in self.rows])[:, None]
        mask = self._cache.reserve(1)
        hidden, _ = self.model.hidden(tokens, positions, mask, self._cache)
        self.fed = tokens[:, 0]
        self._next_hidden = hidden[:, -1]
        self._next_logits = self.model.head(self._next_hidden)

    def _speculate(self, k: int, verify: Verify, draft: Draft) -> list[Sequence]:
        """One speculative step: sample each row's next token ``x0`` as :meth:`step` does,
        draft up to ``k`` tokens after it with the MTP heads, feed ``x0`` and the drafts
        through the model in one pass (one cache slot each), and keep the drafts the base
        model's verification accepts, up to the first rejection.

        The rejected drafts' slots stay in the cache, masked out of every later attention,
        so rows can accept different numbers of drafts.  A rejection's replacement token is
        not recorded here: the row's next logits are those that follow its last accepted
        token, and the next step samples the replacement from them as plain decoding would.
        """
        self._sample_next()
        finished = self.drop_finished()
        if not self.rows:
            return finished
        assert self._cache is not None and self._next_hidden is not None
        cfg = self.model.cfg
        n = len(self.rows)
        # Each row drafts no further than its token budget and the model's context allow.
        lengths = [len(s.request.prompt_ids) + len(s.completion) for s in self.rows]
        budgets = [max(0, min(k, s.request.max_new_tokens - s.generated,
                              cfg.max_seq_len - length))
                   for s, length in zip(self.rows, lengths, strict=True)]
        temps = np.array([s.request.temperature for s in self.rows])
        seeds = [s.request.seed for s in self.rows]
        starts = [s.position for s in self.rows]
        last = [s.completion[-1] for s in self.rows]
        h = self._next_hidden
        token = torch.tensor(last, dtype=torch.long)
        # The uniforms of the k + 1 positions fed, drawn once: drafting and verification use
        # the same ones (coupled).
        u = uniform_grid(seeds, starts, k + 1)                            # [B, k + 1]
        columns = [token]
        draft_logits: list[np.ndarray] = []
        if verify == "coupled" and draft == "sample":
            like = self._next_hidden
            u_t = torch.tensor(np.ascontiguousarray(u.T)[:, :, None], dtype=like.dtype,
                               device=like.device)                # [k + 1, B, 1]
            scale = None if np.all((temps == 0) | (temps == 1)) else \
                torch.from_numpy(np.where(temps > 0, temps, 1.0)).to(like)[:, None]
            greedy = torch.from_numpy(temps == 0).to(like.device) if np.any(temps == 0) \
                else None
        for j in range(k):
            h, q = self.model.draft_step(j, h, columns[-1])
            if draft == "argmax":
                columns.append(q.argmax(dim=-1))
                if verify == "rejection":   # the proposal is the point mass on the draft
                    draft_logits.append(point_mass_logits(columns[-1].cpu().numpy(),
                                                          q.shape[-1]))
                continue
            if verify == "coupled":   # the draw plain decoding makes there, near enough
                columns.append(_draft_draw(q, scale, greedy, u_t[j]))
                continue
            q64 = q.to(torch.float64).cpu().numpy()
            draft_logits.append(q64)
            columns.append(torch.tensor([draft_token(q64[i], s.request.temperature,
                                                     s.request.seed, s.position + j, verify)
                                         for i, s in enumerate(self.rows)]))
        fed = torch.stack(columns, dim=1)
        top = cfg.max_seq_len - 1
        positions = torch.tensor([[min(length - 1 + j, top) for j in range(k + 1)]
                                  for length in lengths])
        mask = self._cache.reserve(k + 1)
        hidden, _ = self.model.hidden(fed, positions, mask, self._cache)
        logits = self.model.head(hidden)                                  # [B, k + 1, V]
        p64 = logits.to(torch.float64).cpu().numpy()
        drafts = fed[:, 1:].tolist()
        if verify == "coupled":
            keep = self._accept_coupled(k, drafts, budgets, p64, temps, u)
        else:
            keep = []
            for i, seq in enumerate(self.rows):
                req, accepted = seq.request, 0
                for j in range(budgets[i]):
                    tok, logprob, ok = verify_draft(p64[i, j], draft_logits[j][i],
                                                    drafts[i][j], req.temperature, req.seed,
                                                    seq.position, verify)
                    self._count(j, ok)
                    if not ok:
                        # Coupled: the replacement is what the next step samples anyway.
                        # Rejection: it was drawn from the residual, so the next step must
                        # take it as its token instead of sampling (it is not in the cache).
                        if verify == "rejection":
                            seq.forced = (tok, logprob)
                        break
                    accepted += 1
                    seq.record(tok, logprob)
                    if seq.finished:
                        break
                keep.append(accepted)
        # The unaccepted drafts' slots: masked out of every later attention (one small
        # tensor each from Python lists: on a few rows, fewer tensor ops is what saves time).
        width = self._cache.width
        if any(a < k for a in keep):
            self._cache.mask[:, width - k:width] &= torch.tensor(
                [[j < a for j in range(k)] for a in keep])
        at = torch.tensor([i * (k + 1) + a for i, a in enumerate(keep)])
        self._next_hidden = hidden.reshape(n * (k + 1), -1).index_select(0, at)
        self._next_logits = logits.reshape(n * (k + 1), -1).index_select(0, at)
        return finished + self.drop_finished()

    def _tally(self, accepted: int, rejected: bool) -> None:
        """Tally drafts 0 .. accepted - 1 as accepted and, if ``rejected``, draft ``accepted``
        as verified and rejected."""
        verified = accepted + rejected
        while len(self.drafted_at) < verified:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for j in range(verified):
            self.drafted_at[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1
        self.drafted += verified
        self.accepted += accepted

    def _count(self, j: int, accepted: bool) -> None:
        """Tally one verified draft at draft position ``j`` (0-based)."""
        while len(self.drafted_at) <= j:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        self.drafted += 1
        self.drafted_at[j] += 1
        if accepted:
            self.accepted += 1
            self.accepted_at[j] += 1

    def _accept_coupled(self, k: int, drafts: list[list[int]], budgets: list[int],
                        p64: np.ndarray, temps: np.ndarray, u: np.ndarray) -> list[int]:
        """Coupled verification for every row and draft at once: the base model's own draw at
        each of the ``k + 1`` positions fed (one vectorised sample with their uniforms ``u``
        ``[B, k + 1]``); a row keeps its drafts up to the first that differs
        from that draw, its budget, or its stop token.  The draw after its last kept draft
        is plain decoding's next token, from the very logits the next step would sample:
        it becomes the row's ``forced`` token, so that step samples nothing.  Returns the
        drafts kept per row."""
        n = len(self.rows)
        base, logprobs = sample_rows(p64.reshape(n * (k + 1), -1), np.repeat(temps, k + 1),
                                     [], [], u=u.reshape(-1))
        base, logprobs = base.reshape(n, k + 1).tolist(), logprobs.reshape(n, k + 1).tolist()
        keep = []
        for i, seq in enumerate(self.rows):
            drawn, draft, budget = base[i], drafts[i], budgets[i]
            agree = 0
            while agree < budget and drawn[agree] == draft[agree]:
                agree += 1
            accepted = seq.record_many(draft[:agree], logprobs[i][:agree]) if agree else 0
            # Verified: the accepted drafts, and the first disagreement unless the row
            # finished (a stop among them) or ran out of budget first.
            rejected = not seq.finished and agree < budget
            self._tally(accepted, rejected)
            if not seq.finished:
                seq.forced = (drawn[accepted], logprobs[i][accepted])
            keep.append(accepted)
        return keep

    @torch.inference_mode()
    def drop_finished(self) -> list[Sequence]:
        """Remove finished rows (sampled a stop, hit the length, or aborted) and return them."""
        keep = [i for i, s in enumerate(self.rows) if not s.finished]
        if len(keep) == len(self.rows):
            return []
        gone = [s for s in self.rows if s.finished]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._cache = self._next_logits = self._next_hidden = None
            return gone
        assert self._cache is not None and self._next_logits is not None \
            and self._next_hidden is not None
        index = torch.tensor(keep, dtype=torch.long)
        used = self._cache.mask[:, :self._cache.width].index_select(0, index)
        # Columns that are padding in every remaining row are dead weight: trim them.
        first = int(used.any(dim=0).long().argmax())
        self._cache = self._cache.select(index, first)
        self._next_logits = self._next_logits.index_select(0, index)
        self._next_hidden = self._next_hidden.index_select(0, index)
        return gone

    def release(self) -> list[Sequence]:
        """Empty the batch and return its sequences; re-admitting them prefills from scratch."""
        rows, self.rows = self.rows, []
        self._cache = self._next_logits = self._next_hidden = None
        for seq in rows:
            seq.forced = None   # chosen under the weights being replaced: sample it again
        return rows


def run_to_completion(model: Policy, requests: Iterable[GenerationRequest], *,
                      max_batch: int = 64) -> list[Sequence]:
    """Decode ``requests`` synchronously with continuous batching; sequences in input order.

    The reference driver for tests and benchmarks; the engine actor adds streaming, aborts
    and weight updates around the same :class:`DecodeBatch`.
    """
    cfg = model.cfg
    seqs = []
    for request in requests:
        validate_request(request, cfg.vocab_size, cfg.max_seq_len)
        seqs.append(Sequence(request))
    waiting = [s for s in seqs if not s.finished]
    batch = DecodeBatch(model)
    while waiting or batch.rows:
        room = max_batch - len(batch)
        if waiting and room > 0:
            batch.admit(waiting[:room])
            waiting = waiting[room:]
        batch.step()
    return seqs
