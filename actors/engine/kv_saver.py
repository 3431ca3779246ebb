"""The torch engine's side of the KV hand-off (:mod:`erlay.actors.engine.kv_handoff`): what
to save after a decode step, and what to restore when a request is admitted.

- :meth:`KVHandoff.save` runs after each step, in the step's worker thread: every running
  request with a ``kv_key`` whose chunk is due (the points where its caller journals tokens)
  has the positions added since its last save copied into the node's slab, all requests in
  one batched copy (:meth:`~erlay.actors.engine.core.DecodeBatch.kv_tail`).
- :meth:`KVHandoff.adopt` runs before admission: a request with a ``kv_key`` and a prefix
  (a turn continued after a failover) looks for the cache another engine on the node saved
  under that key, at the version this engine serves, and takes what is a prefix of its
  context.  Which path it took is recorded on the sequence and reported on its first chunk.
- :meth:`finished` frees a request's slot; :meth:`weights_loaded` frees dead engines' caches
  of versions no engine serves any more.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from erlay.actors.engine.core import Adoption, DecodeBatch, Sequence
from erlay.actors.engine.kv_handoff import Found, HandoffStore
from erlay.actors.engine.kv_slab import DTYPES, Shape
from erlay.actors.model.build import Policy
from erlay.actors.model.policy import KVBuffer


@torch.inference_mode()
def probe_shape(model: Policy) -> Shape:
    """What ``model``'s KV cache holds per position, from a one-token forward pass."""
    tokens = torch.zeros((1, 1), dtype=torch.long)
    mask = torch.ones((1, 1), dtype=torch.bool)
    buffer = KVBuffer.empty(mask, spare=0)
    hidden, _ = model.hidden(tokens, torch.zeros((1, 1), dtype=torch.long), mask, buffer)
    k = buffer.keys[0]
    dtype = str(k.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"KV hand-off cannot save a {dtype} cache")
    return Shape(len(buffer.keys), int(k.shape[1]), int(k.shape[3]), int(hidden.shape[-1]),
                 dtype)


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


class KVHandoff:
    """One engine's saving and adopting (module docstring).  Called from one thread at a
    time (the decode loop's worker thread)."""

    def __init__(self, model: Policy, node_dir: Path, budget_bytes: int, slots: int) -> None:
        self.shape = probe_shape(model)
        self.store = HandoffStore(node_dir, budget_bytes, self.shape, slots,
                                  model.cfg.max_seq_len)
        self.reasons: Counter[str] = Counter()
        self.save_seconds = 0.0
        # (rows, their slots, positions saved, version) after a save of every row
        self._steady: tuple[list[Sequence], np.ndarray, np.ndarray, int] | None = None

    # --------------------------------------------------------------------- adoption
    def adopt(self, seqs: list[Sequence], version: int) -> Adoption | None:
        """The saved caches ``seqs`` can resume from, as one :class:`Adoption` (None: none
        can).  Each request that found a cache, or came with a prefix and found none, has
        its path recorded in ``seq.handoff`` and counted in :attr:`reasons`; a fresh
        request (no prefix, nothing saved) is not a resume and reports nothing."""
        keyed = [s for s in seqs if s.request.kv_key is not None]
        if not keyed:
            return None
        results = self.store.find([s.request.kv_key for s in keyed],  # type: ignore[misc]
                                  version, [s.context for s in keyed])
        rows: list[tuple[Sequence, Found, bool]] = []
        for seq, (found, reason) in zip(keyed, results, strict=True):
            if found is None and reason == "missing" and not seq.request.prefix_ids:
                continue
            seq.handoff = reason
            self.reasons[reason] += 1
            if found is not None:
                rows.append((seq, found, reason == "adopted"))
        return self._adoption(rows) if rows else None

    def _adoption(self, rows: list[tuple[Sequence, Found, bool]]) -> Adoption:
        """``rows``' caches, right-aligned in one left-padded layout (numpy, then torch)."""
        shape = self.shape
        width = max(len(found.kv) for _, found, _ in rows)
        dtype = DTYPES[shape.dtype]
        kv = np.zeros((2, shape.layers, len(rows), shape.heads, width, shape.head_dim), dtype)
        mask = np.zeros((len(rows), width), bool)
        hidden = np.zeros((len(rows), shape.hidden), dtype)
        for i, (_, found, whole) in enumerate(rows):
            n = len(found.kv)
            # [n, 2, L, H, Dh] -> [2, L, H, n, Dh]
            kv[:, :, i, :, width - n:] = found.kv.transpose(1, 2, 3, 0, 4)
            mask[i, width - n:] = True
            if whole and found.hidden is not None:
                hidden[i] = found.hidden
        keys, values = _torch(kv[0], shape.dtype), _torch(kv[1], shape.dtype)
        return Adoption([seq.request_id for seq, _, _ in rows],
                        [(keys[layer], values[layer]) for layer in range(shape.layers)],
                        torch.from_numpy(mask), [len(found.kv) for _, found, _ in rows],
                        _torch(hidden, shape.dtype), [whole for _, _, whole in rows])

    # ------------------------------------------------------------------------ saving
    def save(self, batch: DecodeBatch, version: int,
             admitted: list[Sequence] | None = None) -> None:
        """Save the new positions of every running request with a key whose chunk is due,
        or, with ``admitted``, of those just admitted (their context: what a resume before
        their first chunk needs, and the state its first token follows from)."""
        began = time.perf_counter()
        rows = batch.rows
        if admitted is None and self._steady_save(batch, version):
            self.save_seconds += time.perf_counter() - began
            return
        self._steady = None
        ids = {id(s) for s in admitted} if admitted is not None else None
        index: list[int] = []
        keys: list[str] = []
        lengths: list[int] = []
        for i, seq in enumerate(rows):   # one pass: this runs after every step
            key = seq.request.kv_key
            if key is not None and (seq.chunk_due if ids is None else id(seq) in ids):
                index.append(i)
                keys.append(key)
                lengths.append(len(seq.request.prompt_ids) + len(seq.completion))
        if not index:
            return
        slots, covered = self.store.claim(keys, version)
        new = np.asarray(lengths) - covered
        keep = (slots >= 0) & (new > 0)
        if not keep.all():
            index = [i for i, k in zip(index, keep, strict=True) if k]
            slots, covered, new = slots[keep], covered[keep], new[keep]
            if not index:
                return
        seqs = [rows[i] for i in index]
        caches, values, mask_t, hidden_t, width = batch.kv_views()
        # On the CPU a tensor's numpy view costs nothing and numpy's calls a fraction of
        # torch's: this runs once per step, on every row.
        mask = _numpy(mask_t)[:, :width]
        hidden = _numpy(hidden_t)
        every = len(index) == len(rows)
        rows_at = slice(None) if every else np.asarray(index)
        arrays = [(0, layer, _numpy(k)) for layer, k in enumerate(caches)] + \
                 [(1, layer, _numpy(v)) for layer, v in enumerate(values)]
        if (new == 1).all() and mask[rows_at, width - 1].all():   # plain decoding
            owner, positions = np.arange(len(index)), covered
            tokens = np.array([s.completion[-1] if s.completion else s.request.prompt_ids[-1]
                               for s in seqs], np.int32)
            parts = [(which, layer, a[rows_at, :, width - 1]) for which, layer, a in arrays]
        else:
            # Each row's new positions are its last `new` real slots (padding on the left
            # and rejected drafts are masked): count real slots from the right.
            sub = mask[rows_at]
            from_right = np.cumsum(sub[:, ::-1], axis=1)[:, ::-1]
            owner, src_cols = np.nonzero(sub & (from_right <= new[:, None]))
            src_rows = np.asarray(index)[owner]
            starts = np.cumsum(new) - new
            positions = covered[owner] + (np.arange(len(owner)) - starts[owner])
            flat: list[int] = []
            for seq, start in zip(seqs, covered.tolist(), strict=True):
                prompt = seq.request.prompt_ids
                if start < len(prompt):
                    flat += prompt[start:]
                    flat += seq.completion
                else:
                    flat += seq.completion[start - len(prompt):]
            tokens = np.array(flat, np.int32)
            parts = [(which, layer, a[src_rows, :, src_cols]) for which, layer, a in arrays]
        self.store.write(slots, owner, positions, tokens, parts, hidden[rows_at])
        if every and all(s.request.chunk_tokens == 1 for s in seqs):
            # Every row saved and due at every token: while the batch keeps these rows and
            # steps plainly, the next saves need no look at each row (_steady_save).
            self._steady = (list(rows), slots, covered + new, version)
        self.save_seconds += time.perf_counter() - began

    def _steady_save(self, batch: DecodeBatch, version: int) -> bool:
        """The save after a plain step of the same rows as the last save, each saved up to
        its context then and due at every token: one new position each, the last cache
        slot, the token it was fed.  False (nothing done) when that is not the case."""
        steady = self._steady
        fed = batch.fed
        if steady is None or fed is None or steady[3] != version or steady[0] != batch.rows:
            return False
        _, slots, covered, _ = steady
        if not (self.store.holds(slots, covered)):
            return False
        caches, values, mask_t, hidden_t, width = batch.kv_views()
        if not _numpy(mask_t)[:, width - 1].all():
            return False
        parts = [(0, layer, _numpy(k)[:, :, width - 1]) for layer, k in enumerate(caches)] + \
                [(1, layer, _numpy(v)[:, :, width - 1]) for layer, v in enumerate(values)]
        self.store.write(slots, np.arange(len(slots)), covered,
                         _numpy(fed).astype(np.int32), parts, _numpy(hidden_t))
        self._steady = (steady[0], slots, covered + 1, version)
        return True

    # ----------------------------------------------------------------------- cleanup
    def finished(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted by its caller: its cache is not needed again."""
        key = seq.request.kv_key
        if key is not None:
            self.store.release(key)

    def weights_loaded(self, version: int) -> None:
        """Dead engines' caches of versions before ``version - 1`` will never be adopted."""
        self.store.sweep(version - 1)

    def stats(self) -> dict[str, float]:
        return {**{f"kv_{r}": n for r, n in self.reasons.items()},
                "kv_saved_bytes": self.store.counts["saved_bytes"],
                "kv_evicted": self.store.counts["evicted"],
                "kv_save_seconds": round(self.save_seconds, 4)}

    def close(self) -> None:
        self.store.close(keep=True)
