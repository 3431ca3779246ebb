"""The policy: one small decoder-only transformer shared by the learner and the torch engine.

One model definition serves both sides, so the engine's behaviour logprobs and the learner's
logprobs come from the same function of the same weights.

Shapes: ``tokens`` and ``positions`` are ``[B, T]``; ``key_mask`` is ``[B, S]`` over every
key the new tokens may attend to (the cache, then the new tokens), True for real tokens.
Sequences may be left-padded; positions then count real tokens only.

The KV cache is a list with one ``(k, v)`` pair per layer, each ``[B, H, S, Dh]`` (the
learner's and the prefill's form), or a :class:`KVBuffer`, the decode loop's preallocated form:
the model writes the new tokens' keys and values into its free slots instead of concatenating
a new cache every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from erlay.actors.model.logprobs import DEFAULT_CHUNK_BYTES, target_logprobs

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class KVBuffer:
    """A preallocated KV cache for decoding, with its key mask.

    ``keys[l]``/``values[l]`` are ``[B, H, capacity, Dh]``, ``mask`` is ``[B, capacity]``; the
    first ``width`` slots are in use (the cache's ``S``).  A forward pass over ``t`` new tokens
    calls :meth:`reserve` (``t`` more slots, marked real in ``mask``), then the model calls
    :meth:`write` once per layer, which stores the new keys and values at slots
    ``width .. width + t`` and returns every key and value so far (views, no copy), and finally
    :meth:`commit` advances ``width``.  Growing past the capacity reallocates with room to
    spare, so a decode loop allocates O(log length) times instead of every step.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 mask: torch.Tensor, width: int) -> None:
        self.keys, self.values, self.mask, self.width = keys, values, mask, width
        self._pending = 0

    @classmethod
    def from_cache(cls, cache: KVCache, mask: torch.Tensor, spare: int = 32) -> KVBuffer:
        """A buffer holding ``cache`` (``S`` slots, ``mask`` ``[B, S]``) with ``spare`` free."""
        width = mask.shape[1]
        out = cls([], [], mask.new_zeros((mask.shape[0], width + spare)), width)
        out.mask[:, :width] = mask
        for k, v in cache:
            kb = k.new_zeros((k.shape[0], k.shape[1], width + spare, k.shape[3]))
            vb = v.new_zeros((v.shape[0], v.shape[1], width + spare, v.shape[3]))
            kb[:, :, :width] = k
            vb[:, :, :width] = v
            out.keys.append(kb)
            out.values.append(vb)
        return out

    @classmethod
    def empty(cls, mask: torch.Tensor, spare: int = 32) -> KVBuffer:
        """A buffer for a prefill with key mask ``mask`` ``[B, S]``: its ``S`` slots reserved
        (as :meth:`reserve` would, with ``mask``'s padding), ``spare`` more free; each layer's
        keys and values are allocated by its first :meth:`write`."""
        out = cls([], [], mask.new_zeros((mask.shape[0], mask.shape[1] + spare)), 0)
        out.mask[:, :mask.shape[1]] = mask
        out._pending = mask.shape[1]
        return out

    def __len__(self) -> int:
        return self.width

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def reserve(self, t: int) -> torch.Tensor:
        """Make room for ``t`` new slots, mark them real; the key mask ``[B, width + t]``."""
        if self.width + t > self.capacity:
            grow = max(t, self.capacity // 2, 16)
            self.mask = torch.cat([self.mask, self.mask.new_zeros((len(self.mask), grow))], 1)
            for store in (self.keys, self.values):
                for i, z in enumerate(store):
                    store[i] = torch.cat([z, z.new_zeros((*z.shape[:2], grow, z.shape[3]))], 2)
        self.mask[:, self.width:self.width + t] = True
        self._pending = t
        return self.mask[:, :self.width + t]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[B, H, t, Dh]`` of the reserved slots; all keys/values so far."""
        end = self.width + k.shape[2]
        if layer == len(self.keys):   # an empty buffer's first write to this layer
            self.keys.append(k.new_zeros((*k.shape[:2], self.capacity, k.shape[3])))
            self.values.append(v.new_zeros((*v.shape[:2], self.capacity, v.shape[3])))
        self.keys[layer][:, :, self.width:end] = k
        self.values[layer][:, :, self.width:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self) -> None:
        self.width += self._pending
        self._pending = 0

    def legacy(self) -> KVCache:
        """The used slots as a list cache (views)."""
        return [(k[:, :, :self.width], v[:, :, :self.width])
                for k, v in zip(self.keys, self.values, strict=True)]

    def select(self, rows: torch.Tensor, first: int = 0) -> KVBuffer:
        """Rows ``rows`` only, without slots before ``first`` (copies)."""
        return KVBuffer([k.index_select(0, rows)[:, :, first:] for k in self.keys],
                        [v.index_select(0, rows)[:, :, first:] for v in self.values],
                        self.mask.index_select(0, rows)[:, first:], self.width - first)


@dataclass(frozen=True)
class PolicyConfig:
    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq_len: int = 96
    mtp_heads: int = 0   # multi-token-prediction modules (drafts for speculative decoding)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.mtp_heads < 0:
            raise ValueError(f"mtp_heads must be >= 0, got {self.mtp_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(),
                                 nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None,
                buffer: KVBuffer | None = None, layer: int = 0
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if buffer is not None:
            k, v = buffer.write(layer, k, v)
        elif cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.norm2(x))
        return x, (k, v)


# Largest vocabulary x width x MTP heads (elements) for which drafting keeps per-token tables
# (MTPModule.draft): 16M float32 values, 64 MB; a larger model drafts without them.
DRAFT_TABLE_LIMIT = 16 * 2**20


class MTPModule(nn.Module):
    """One multi-token-prediction module, in the style of DeepSeek-V3's: it combines the
    previous depth's representation ``h`` of position ``t`` with the embedding of the token
    at ``t + k`` and predicts the token at ``t + k + 1`` through the shared output head.
    No attention: it reads only position ``t``, so drafting costs a few small matmuls."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm_h = nn.LayerNorm(d_model)
        self.norm_e = nn.LayerNorm(d_model)
        self.proj = nn.Linear(2 * d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        # A narrow MLP (d_model wide, not d_ff): drafting runs k of these per decode step,
        # so their cost is the speculation's overhead.
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(),
                                 nn.Linear(d_model, d_model))
        self.out = nn.LayerNorm(d_model)
        self._flat: Any = None   # forward's parameter lists, gathered on first use
        self._draft_cache: Any = None   # (sources' stamp, draft table, h's projection)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``h`` and ``emb`` are ``[..., D]``; returns the next depth's ``[..., D]``.

        The submodules' own functions on their parameters (the same ops, so the same
        numbers), gathered once: drafting runs this k times per decode step on a few rows,
        where module calls and attribute lookups would be most of its cost.  The parameters
        are referenced, not copied (in-place updates and ``load_state_dict`` keep them)."""
        (n_h, n_e, n_z, n_out), (proj, up, down) = self._params()
        norm = torch.layer_norm   # F.layer_norm's kernel, without its Python wrapper
        z = F.linear(torch.cat([norm(h, *n_h), norm(emb, *n_e)], dim=-1), *proj)
        return norm(z + F.linear(F.gelu(F.linear(norm(z, *n_z), *up)), *down), *n_out)

    def _params(self) -> Any:
        if self._flat is None:
            norms = (self.norm_h, self.norm_e, self.norm, self.out)
            self._flat = ([(m.normalized_shape, m.weight, m.bias, m.eps) for m in norms],
                          [(m.weight, m.bias) for m in (self.proj, self.mlp[0], self.mlp[2])])
        return self._flat

    def draft(self, h: torch.Tensor, token: torch.Tensor,
              embed_weight: torch.Tensor) -> torch.Tensor:
        """``forward(h, embedding(token))`` for drafting, ``h`` ``[B, D]``, ``token`` ``[B]``,
        without gradients: the token's half of the input projection,
        ``proj(norm_e(embedding))`` with the bias, is a per-token table over the vocabulary
        computed once (and again whenever the embedding, ``norm_e`` or ``proj`` changed:
        ``_version``), so a draft step looks its row up instead of normalising,
        concatenating and projecting it.  Equal to :meth:`forward` up to float32 rounding
        (the matmul is split in two); drafts are proposals that the base model verifies, so
        rounding can cost an acceptance, never a token."""
        (n_h, _, n_z, n_out), (_, up, down) = self._params()
        table, w_h = self._draft_table(embed_weight)
        norm = torch.layer_norm
        z = torch.addmm(F.embedding(token, table), norm(h, *n_h), w_h)
        return norm(z + F.linear(F.gelu(F.linear(norm(z, *n_z), *up)), *down), *n_out)

    def _draft_table(self, embed_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (_, n_e, _, _), (proj, _, _) = self._params()
        stamp = [(p.data_ptr(), p._version) for p in (embed_weight, *n_e[1:3], *proj)]
        if self._draft_cache is None or self._draft_cache[0] != stamp:
            d = self.proj.out_features
            with torch.no_grad():
                e = F.layer_norm(embed_weight, self.norm_e.normalized_shape,
                                 self.norm_e.weight, self.norm_e.bias, self.norm_e.eps)
                table = F.linear(e, self.proj.weight[:, d:], self.proj.bias)
                w_h = self.proj.weight[:, :d].t().contiguous()
            self._draft_cache = (stamp, table, w_h)
        return self._draft_cache[1], self._draft_cache[2]


class PolicyModel(nn.Module):
    """Decoder-only transformer with learned positions and an untied output head, plus
    ``cfg.mtp_heads`` optional MTP modules (:class:`MTPModule`) that draft tokens t+2 ... for
    speculative decoding; they never change the policy's own logits."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg.d_model) for _ in range(cfg.mtp_heads))
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
               cache: KVCache | KVBuffer | None = None, *, keep_cache: bool = True
               ) -> tuple[torch.Tensor, KVCache | KVBuffer]:
        """Final hidden states ``[B, T, D]`` and the updated cache (a :class:`KVBuffer`
        cache is updated in place, after :meth:`KVBuffer.reserve`, and returned);
        ``keep_cache=False`` (scoring: no decode follows) returns an empty one."""
        t = tokens.shape[1]
        s = key_mask.shape[1]
        if int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        # Query i (absolute slot s - t + i) may attend to key j when j <= that slot and key j
        # is a real token.  A fully masked row (a pad query) would give NaN, so each query
        # may always see its own slot.
        slots = torch.arange(s, device=tokens.device)
        query_slots = slots[s - t:]
        causal = slots[None, :] <= query_slots[:, None]                      # [T, S]
        allowed = causal[None] & key_mask[:, None, :]                        # [B, T, S]
        allowed = allowed | (slots[None, None, :] == query_slots[None, :, None])
        mask = allowed[:, None]                                              # [B, 1, T, S]
        x = self.embed(tokens) + self.pos(positions)
        if isinstance(cache, KVBuffer):
            for i, block in enumerate(self.blocks):
                x, _ = block(x, mask, None, cache, i)
            cache.commit()
            return self.norm(x), cache
        new_cache: KVCache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, mask, cache[i] if cache is not None else None)
            if keep_cache:
                new_cache.append(kv)
        return self.norm(x), new_cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
                cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Logits ``[B, T, V]`` and the updated cache."""
        h, new_cache = self.hidden(tokens, positions, key_mask, cache)
        return self.head(h), new_cache

    def draft_step(self, k: int, h: torch.Tensor, token: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module ``k`` (0-based) on ``h`` ``[B, D]`` and the tokens ``[B]`` at offset
        ``k + 1``: (its representation ``[B, D]``, logits ``[B, V]`` of the token after)."""
        if torch.is_grad_enabled() or self.embed.weight.numel() * len(self.mtp) \
                > DRAFT_TABLE_LIMIT:
            nxt = self.mtp[k](h, self.embed(token))
        else:
            nxt = self.mtp[k].draft(h, token, self.embed.weight)
        return nxt, self.head(nxt)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def left_pad(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """Left-pad ``seqs`` to one length: (tokens, positions, mask), each ``[B, T]``."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, seq in enumerate(seqs):
        if seq:
            tokens[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = True
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return tokens, positions, mask


@dataclass(frozen=True)
class CompletionScores:
    """:func:`score_completions`'s answer: ``logprobs`` and ``mask`` ``[B, L]`` (``L`` the
    longest completion; entry ``[b, i]`` is completion ``b``'s token ``i``, the mask True
    where it exists) and, when asked for, ``entropy`` ``[B, L]`` (no gradient)."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None


def score_completions(model: PolicyModel, prompts: list[list[int]],
                      completions: list[list[int]], temperature: float = 1.0, *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      compute_dtype: torch.dtype | None = None,
                      entropy: bool = False) -> CompletionScores:
    """Per-token logprobs of each completion given its prompt, in one forward pass of the
    decoder stack.

    Entry ``[b, i]`` is log p(completion_b[i] | prompt_b, completion_b[:i]) under
    ``softmax(logits / temperature)``, the distribution the engine sampled from (a
    temperature of 0, greedy decoding, is scored at 1 as the engine does).  Only the
    positions that predict a completion token reach the output head, and their logits are
    made in chunks of ``chunk_bytes`` (:func:`erlay.actors.model.logprobs.target_logprobs`):
    no ``[tokens, vocabulary]`` tensor exists whole.  Differentiable.
    """
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    tokens, positions, mask = left_pad(seqs)
    # No cache: scoring decodes nothing after, and an HF model's no-grad pass would otherwise
    # keep every layer's keys and values of the whole batch.
    hidden, _ = model.hidden(tokens, positions, mask, keep_cache=False)
    device = hidden.device
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long, device=device)
    width = int(lengths.max()) if len(completions) else 0
    n = int(lengths.sum())
    rows = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    cols = torch.arange(n, device=device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)
    # Completion b's token i sits at slot total - len(c_b) + i and is predicted from the
    # slot before.
    slots = tokens.shape[1] - lengths[rows] + cols - 1
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long,
                           device=device)
    scored = target_logprobs(hidden[rows, slots], model.head, targets, temperature=temperature,
                             chunk_bytes=chunk_bytes, compute_dtype=compute_dtype,
                             entropy=entropy)
    out = torch.zeros((len(seqs), width), dtype=torch.float32, device=device)
    out = out.index_put((rows, cols), scored.logprobs)
    out_mask = torch.zeros((len(seqs), width), dtype=torch.bool, device=device)
    out_mask[rows, cols] = True
    ent = None
    if scored.entropy is not None:
        ent = torch.zeros((len(seqs), width), dtype=torch.float32, device=device)
        ent[rows, cols] = scored.entropy
    return CompletionScores(out, out_mask, ent)


def sequence_logprobs(model: PolicyModel, prompts: list[list[int]],
                      completions: list[list[int]],
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, mask)`` of :func:`score_completions`, both ``[B, L]``.  Differentiable."""
    scores = score_completions(model, prompts, completions, temperature)
    return scores.logprobs, scores.mask


def state_to_numpy(model: nn.Module) -> dict[str, Any]:
    """Weights as numpy arrays: what travels through the Ray object store."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_numpy_state(model: nn.Module, state: dict[str, Any]) -> None:
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
