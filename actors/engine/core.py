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

Batch invariants (what ``admit`` and ``step`` keep true between calls):

- every row's real tokens are right-aligned in the cache and marked in ``key_mask``; padding
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
from erlay.actors.model.mtp import Verify, draft_token, verify_draft
from erlay.actors.model.policy import KVCache, left_pad
from erlay.actors.model.sampling import sample_rows


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

    def finish(self, reason: FinishReason) -> None:
        """End the sequence now (an abort); a reason already set is kept."""
        if self.finish_reason is None:
            self.finish_reason = reason

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
                           self.finish_reason, prefill_tokens=self.prefill_unreported)
        self.chunk_start = len(self.completion)
        self._unstreamed_logprobs = []
        self.prefill_unreported = 0
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


class DecodeBatch:
    """Sequences decoded together with one KV cache (see the module docstring for invariants).

    Not thread-safe: one owner calls its methods, one at a time.
    """

    def __init__(self, model: Policy) -> None:
        self.model = model
        self.rows: list[Sequence] = []
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None          # [B, S] real-token mask of the cache
        self._next_logits: torch.Tensor | None = None   # [B, V]
        self._next_hidden: torch.Tensor | None = None   # [B, D]: what produced them
        self.drafted = 0    # MTP drafts proposed, and accepted, since the batch was made
        self.accepted = 0

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def admit(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` and add them to the batch; each gets its next-token logits."""
        if not seqs:
            return
        if any(s.finished for s in seqs):
            raise ValueError("a finished sequence cannot be admitted")
        contexts = [s.context for s in seqs]
        for seq, context in zip(seqs, contexts, strict=True):
            seq.prefill_unreported += len(context)   # no prefix cache: all of it
        tokens, positions, mask = left_pad(contexts)
        hidden, cache = self.model.hidden(tokens, positions, mask)
        next_hidden = hidden[:, -1]
        next_logits = self.model.head(next_hidden)
        if self._cache is None or self._mask is None or self._next_logits is None \
                or self._next_hidden is None:
            self._cache, self._mask = cache, mask
            self._next_logits, self._next_hidden = next_logits, next_hidden
        else:
            width = max(self._mask.shape[1], mask.shape[1])
            old_cache, old_mask = _pad_left(self._cache, self._mask, width)
            new_cache, new_mask = _pad_left(cache, mask, width)
            self._cache = [(torch.cat([ko, kn]), torch.cat([vo, vn]))
                           for (ko, vo), (kn, vn) in zip(old_cache, new_cache, strict=True)]
            self._mask = torch.cat([old_mask, new_mask])
            self._next_logits = torch.cat([self._next_logits, next_logits])
            self._next_hidden = torch.cat([self._next_hidden, next_hidden])
        self.rows.extend(seqs)

    @torch.inference_mode()
    def step(self, k: int = 0, verify: Verify = "coupled") -> list[Sequence]:
        """Sample one token for every row, then advance the rows that go on by one position.
        With ``k > 0`` and MTP heads, each row also drafts up to ``k`` more tokens, verified in
        the same forward pass (:meth:`_speculate`; the rules are in :mod:`erlay.actors.model.mtp`).

        Returns the sequences that finished in this step (already removed from the batch).
        """
        if not self.rows:
            return []
        if k > 0 and len(self.model.mtp) > 0:
            return self._speculate(min(k, len(self.model.mtp)), verify)
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
        logits = self._next_logits.to(torch.float64).cpu().numpy()
        tokens, logprobs = self._sample(logits, self.rows, [s.position for s in self.rows])
        for i, seq in enumerate(self.rows):
            if seq.forced is not None:
                seq.record(*seq.forced)
                seq.forced = None
            else:
                seq.record(int(tokens[i]), float(logprobs[i]))

    @staticmethod
    def _sample(logits: np.ndarray, seqs: list[Sequence],
                positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i`` of ``logits`` sampled for ``seqs[i]`` at ``positions[i]``."""
        return sample_rows(logits, np.array([s.request.temperature for s in seqs]),
                           [s.request.seed for s in seqs], positions)

    def _advance(self) -> None:
        assert self._cache is not None and self._mask is not None
        # The token fed is each row's last one; positions count real tokens, so its position
        # is the context length minus one.
        tokens = torch.tensor([[s.completion[-1]] for s in self.rows], dtype=torch.long)
        positions = torch.tensor([[len(s.request.prompt_ids) + s.position - 1]
                                  for s in self.rows], dtype=torch.long)
        mask = torch.cat([self._mask, self._mask.new_ones((len(self.rows), 1))], dim=1)
        hidden, self._cache = self.model.hidden(tokens, positions, mask, self._cache)
        self._mask = mask
        self._next_hidden = hidden[:, -1]
        self._next_logits = self.model.head(self._next_hidden)

    def _speculate(self, k: int, verify: Verify) -> list[Sequence]:
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
        assert self._cache is not None and self._mask is not None \
            and self._next_hidden is not None
        cfg = self.model.cfg
        # Each row drafts no further than its token budget and the model's context allow.
        budgets = [max(0, min(k, s.request.max_new_tokens - s.generated,
                              cfg.max_seq_len - len(s.context))) for s in self.rows]
        h = self._next_hidden
        token = torch.tensor([s.completion[-1] for s in self.rows], dtype=torch.long)
        drafts: list[list[int]] = [[] for _ in self.rows]
        draft_logits: list[np.ndarray] = []
        for j in range(k):
            h, q = self.model.draft_step(j, h, token)
            q64 = q.to(torch.float64).cpu().numpy()
            draft_logits.append(q64)
            if verify == "coupled":   # the draw plain decoding makes at that position
                drawn = self._sample(q64, self.rows, [s.position + j for s in self.rows])[0]
            else:
                drawn = [draft_token(q64[i], s.request.temperature, s.request.seed,
                                     s.position + j, verify) for i, s in enumerate(self.rows)]
            for i in range(len(self.rows)):
                drafts[i].append(int(drawn[i]))
            token = torch.tensor([d[-1] for d in drafts], dtype=torch.long)
        fed = torch.tensor([[s.completion[-1], *d] for s, d in zip(self.rows, drafts,
                                                                   strict=True)])
        base = torch.tensor([[len(s.context) - 1] for s in self.rows])
        positions = (base + torch.arange(k + 1)[None, :]).clamp(max=cfg.max_seq_len - 1)
        mask = torch.cat([self._mask, self._mask.new_ones((len(self.rows), k + 1))], dim=1)
        hidden, self._cache = self.model.hidden(fed, positions, mask, self._cache)
        p64 = self.model.head(hidden).to(torch.float64).cpu().numpy()
        if verify == "coupled":
            return finished + self._accept_coupled(k, drafts, budgets, p64, hidden, mask)
        keep = []
        for i, seq in enumerate(self.rows):
            req, accepted = seq.request, 0
            for j in range(budgets[i]):
                tok, logprob, ok = verify_draft(p64[i, j], draft_logits[j][i], drafts[i][j],
                                                req.temperature, req.seed, seq.position,
                                                verify)
                self.drafted += 1
                if not ok:
                    # Coupled: the replacement is what the next step samples anyway.
                    # Rejection: it was drawn from the residual, so the next step must
                    # take it as its token instead of sampling (it is not in the cache).
                    if verify == "rejection":
                        seq.forced = (tok, logprob)
                    break
                self.accepted += 1
                accepted += 1
                seq.record(tok, logprob)
                if seq.finished:
                    break
            keep.append(accepted)
            mask[i, mask.shape[1] - k + accepted:] = False    # the unaccepted drafts' slots
        self._mask = mask
        rows = torch.arange(len(self.rows))
        last = torch.tensor(keep)
        self._next_hidden = hidden[rows, last]
        self._next_logits = self.model.head(self._next_hidden)
        return finished + self.drop_finished()

    def _accept_coupled(self, k: int, drafts: list[list[int]], budgets: list[int],
                        p64: np.ndarray, hidden: torch.Tensor,
                        mask: torch.Tensor) -> list[Sequence]:
        """Coupled verification for every row and draft at once: the base model's own draw at
        each drafted position (one vectorised sample); a row keeps its drafts up to the first
        that differs from that draw, its budget, or its stop token."""
        n = len(self.rows)
        rows = [s for s in self.rows for _ in range(k)]
        positions = [s.position + j for s in self.rows for j in range(k)]
        base, logprobs = self._sample(p64[:, :k].reshape(n * k, -1), rows, positions)
        base, logprobs = base.reshape(n, k), logprobs.reshape(n, k)
        keep = []
        for i, seq in enumerate(self.rows):
            accepted = 0
            for j in range(budgets[i]):
                self.drafted += 1
                if int(base[i, j]) != drafts[i][j]:
                    break
                self.accepted += 1
                accepted += 1
                seq.record(drafts[i][j], float(logprobs[i, j]))
                if seq.finished:
                    break
            keep.append(accepted)
            mask[i, mask.shape[1] - k + accepted:] = False    # the unaccepted drafts' slots
        self._mask = mask
        last = torch.tensor(keep)
        self._next_hidden = hidden[torch.arange(n), last]
        self._next_logits = self.model.head(self._next_hidden)
        return self.drop_finished()

    @torch.inference_mode()
    def drop_finished(self) -> list[Sequence]:
        """Remove finished rows (sampled a stop, hit the length, or aborted) and return them."""
        keep = [i for i, s in enumerate(self.rows) if not s.finished]
        if len(keep) == len(self.rows):
            return []
        gone = [s for s in self.rows if s.finished]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._next_logits = self._next_hidden = None
            return gone
        assert self._cache is not None and self._mask is not None \
            and self._next_logits is not None and self._next_hidden is not None
        index = torch.tensor(keep, dtype=torch.long)
        mask = self._mask.index_select(0, index)
        # Columns that are padding in every remaining row are dead weight: trim them.
        first = int(mask.any(dim=0).long().argmax())
        self._mask = mask[:, first:]
        self._cache = [(k.index_select(0, index)[:, :, first:],
                        v.index_select(0, index)[:, :, first:]) for k, v in self._cache]
        self._next_logits = self._next_logits.index_select(0, index)
        self._next_hidden = self._next_hidden.index_select(0, index)
        return gone

    def release(self) -> list[Sequence]:
        """Empty the batch and return its sequences; re-admitting them prefills from scratch."""
        rows, self.rows = self.rows, []
        self._cache = self._mask = self._next_logits = self._next_hidden = None
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
