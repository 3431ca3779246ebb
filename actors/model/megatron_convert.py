"""Hugging Face <-> megatron-core weights for Llama- and Qwen2-style decoders: pure functions
of state dicts, no megatron import (preflight and the CPU tests use them without the extra).

The target is megatron-core 0.16's ``GPTModel`` built with the *local* layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``: no Transformer Engine, so the norms
are modules of their own, not folded into the following linear).  :func:`megatron_shape`
reads what the conversion needs from the HF config and refuses what the local spec cannot
express; :func:`transformer_config_kwargs` and :func:`gpt_model_kwargs` are the arguments
that build the matching model.  Names, for layer ``i`` (``D`` hidden, ``Dh`` head size, ``H``
query heads, ``G`` key-value heads, ``r = H / G``; ``hf.`` is ``model.layers.i.``, ``mg.`` is
``decoder.layers.i.``):

=============================================  =============================================
HF                                             megatron-core (local spec)
=============================================  =============================================
``model.embed_tokens.weight`` ``[V, D]``       ``embedding.word_embeddings.weight`` ``[V', D]``
``hf.input_layernorm.weight``                  ``mg.input_layernorm.weight``
``hf.self_attn.{q,k,v}_proj.weight`` (+bias)   ``mg.self_attention.linear_qkv.weight`` (+bias)
``hf.self_attn.o_proj.weight``                 ``mg.self_attention.linear_proj.weight``
``hf.post_attention_layernorm.weight``         ``mg.pre_mlp_layernorm.weight``
``hf.mlp.{gate,up}_proj.weight``               ``mg.mlp.linear_fc1.weight`` (gate, then up)
``hf.mlp.down_proj.weight``                    ``mg.mlp.linear_fc2.weight``
``model.norm.weight``                          ``decoder.final_layernorm.weight``
``lm_head.weight`` ``[V, D]`` (untied only)    ``output_layer.weight`` ``[V', D]``
=============================================  =============================================

The fused QKV weight is laid out per query group: for group ``g``, the ``r`` query heads it
serves (HF heads ``g*r .. g*r + r - 1``), then key head ``g``, then value head ``g``, each
``Dh`` rows; so tensor parallelism splits it into contiguous blocks of whole groups.  The
vocabulary is padded with zero rows to ``V'``, a multiple of the tensor-parallel size (the
vocab-parallel embedding and output layer split it evenly); the learner drops the padded
logits, and the conversion back drops the rows.  Every conversion copies nothing it does not
have to: an HF -> Megatron -> HF round trip returns bit-identical tensors.

Tensor parallelism (:func:`split_tp`, :func:`merge_tp`): column-parallel weights (QKV, fc1,
embedding, output layer) split along rows, fc1 as its gate half and up half separately, since
each rank holds ``[gate_r; up_r]``; row-parallel weights (``linear_proj``, ``linear_fc2``)
split along columns; norms are replicated, and merging refuses replicas that differ.
Pipeline parallelism (:func:`split_pp`, :func:`merge_pp`): contiguous blocks of layers,
renumbered from 0 on each stage as megatron numbers them; the embedding on the first stage,
the final norm and output layer on the last.

May import: (nothing of erlay).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

ARCHITECTURES = ("llama", "qwen2")
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
# Per layer: HF name -> megatron name for the tensors that map one to one.
_DIRECT = {"input_layernorm.weight": "input_layernorm.weight",
           "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
           "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
           "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                    "embedding.word_embeddings.weight", "output_layer.weight")


class MegatronConfigError(ValueError):
    """The model or the parallel sizes cannot run on the megatron backend; one line."""


@dataclass(frozen=True)
class MegatronShape:
    """What the conversion and the megatron model need to know of an HF config."""

    arch: str
    vocab_size: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    tied: bool
    rope_theta: float
    norm_eps: float
    max_positions: int

    @property
    def group(self) -> int:
        """Query heads per key-value head."""
        return self.heads // self.kv_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary rounded up to a multiple of ``tp``."""
        return math.ceil(self.vocab_size / tp) * tp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_theta(config: Any) -> tuple[float, str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = params if isinstance(params, dict) else {}
    kind = str(params.get("rope_type") or params.get("type") or "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0), kind


def megatron_shape(config: Any) -> MegatronShape:
    """The :class:`MegatronShape` of an HF ``config``; raises :class:`MegatronConfigError` for
    an architecture or a variant the conversion does not cover (one line, naming it)."""
    config = getattr(config, "text_config", config)
    arch = getattr(config, "model_type", None)
    if arch not in ARCHITECTURES:
        raise MegatronConfigError(f"the megatron backend converts Llama- and Qwen2-style "
                                  f"models ({', '.join(ARCHITECTURES)}); this model is "
                                  f"{arch!r}")
    refused = []
    theta, kind = _rope_theta(config)
    if kind != "default":
        refused.append(f"rope scaling {kind!r}")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        refused.append(f"activation {config.hidden_act!r}")
    if arch == "llama" and (getattr(config, "attention_bias", False)
                            or getattr(config, "mlp_bias", False)):
        refused.append("attention_bias/mlp_bias")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        refused.append("sliding-window attention")
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        refused.append("non-full attention layers")
    if refused:
        raise MegatronConfigError(f"the megatron backend does not convert {arch} models with "
                                  f"{', '.join(refused)}")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    if heads % kv_heads:
        raise MegatronConfigError(f"{heads} attention heads do not split into {kv_heads} "
                                  f"key-value groups")
    return MegatronShape(
        arch=arch, vocab_size=int(config.vocab_size), hidden=hidden,
        ffn=int(config.intermediate_size), layers=int(config.num_hidden_layers), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, qkv_bias=arch == "qwen2",
        tied=bool(getattr(config, "tie_word_embeddings", False)), rope_theta=theta,
        norm_eps=float(config.rms_norm_eps),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0))


def check_parallel(shape: MegatronShape, tp: int, pp: int) -> None:
    """Tensor-parallel size ``tp`` must divide the query and key-value head counts (and
    the MLP width); pipeline size ``pp`` must divide the layer count.  Raises
    :class:`MegatronConfigError` naming the key and both numbers."""
    if shape.heads % tp or shape.kv_heads % tp:
        raise MegatronConfigError(
            f"learner.megatron.tensor_parallel {tp} must divide the attention heads "
            f"({shape.heads}) and the key-value heads ({shape.kv_heads})")
    if shape.ffn % tp:
        raise MegatronConfigError(f"learner.megatron.tensor_parallel {tp} must divide the MLP "
                                  f"width (intermediate_size {shape.ffn})")
    if shape.layers % pp:
        raise MegatronConfigError(f"learner.megatron.pipeline_parallel {pp} must divide the "
                                  f"layer count ({shape.layers})")


# ---------------------------------------------------------------------------- the model
def transformer_config_kwargs(shape: MegatronShape) -> dict[str, Any]:
    """``TransformerConfig`` arguments of the model (add the parallel sizes, dtype and
    ``use_cpu_initialization`` at the call): RMSNorm, SwiGLU (``gated_linear_unit`` with
    SiLU), no linear biases but Qwen2's QKV bias, no dropout, and every fusion off, because
    the local spec runs without Transformer Engine or Apex."""
    return dict(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim, normalization="RMSNorm", layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


def gpt_model_kwargs(shape: MegatronShape, tp: int = 1) -> dict[str, Any]:
    """``GPTModel`` arguments besides ``config`` and ``transformer_layer_spec``: RoPE with the
    HF theta, the padded vocabulary, tied or untied output embeddings, and logits gathered
    over the tensor-parallel group (``parallel_output=False``)."""
    return dict(vocab_size=shape.padded_vocab(tp), max_sequence_length=shape.max_positions,
                position_embedding_type="rope", rotary_base=shape.rope_theta,
                rotary_percent=1.0, share_embeddings_and_output_weights=shape.tied,
                parallel_output=False)


# ------------------------------------------------------------------------ HF <-> megatron
def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))])


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: MegatronShape) -> Tensor:
    """HF's separate q, k, v (weights ``[n*Dh, D]`` or biases ``[n*Dh]``) as megatron's fused
    per-group layout (module docstring)."""
    rest = q.shape[1:]
    dh, g, r = shape.head_dim, shape.kv_heads, shape.group
    blocks = [q.reshape(g, r * dh, *rest), k.reshape(g, dh, *rest), v.reshape(g, dh, *rest)]
    return torch.cat(blocks, dim=1).reshape(g * (r + 2) * dh, *rest)


def unfuse_qkv(qkv: Tensor, shape: MegatronShape) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`fuse_qkv`: ``(q, k, v)``."""
    rest = qkv.shape[1:]
    dh, g, r = shape.head_dim, shape.kv_heads, shape.group
    grouped = qkv.reshape(g, (r + 2) * dh, *rest)
    q, k, v = grouped.split([r * dh, dh, dh], dim=1)
    return (q.reshape(g * r * dh, *rest).contiguous(), k.reshape(g * dh, *rest).contiguous(),
            v.reshape(g * dh, *rest).contiguous())


def _take(state: StateDict, name: str, used: set[str]) -> Tensor:
    if name not in state:
        raise KeyError(f"the HF state dict has no {name}")
    used.add(name)
    return state[name]


def hf_to_megatron(state: StateDict, shape: MegatronShape, tp: int = 1) -> StateDict:
    """The megatron-core state dict (whole model, before any split) of an HF state dict.

    The vocabulary is padded for ``tp`` ranks.  Raises KeyError when a tensor is missing
    and ValueError when the HF state has tensors the mapping does not place (an architecture
    variant this conversion would silently drop)."""
    used: set[str] = set()
    vocab = shape.padded_vocab(tp)
    out: StateDict = {"embedding.word_embeddings.weight":
                      _pad_rows(_take(state, "model.embed_tokens.weight", used), vocab)}
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for src, dst in _DIRECT.items():
            out[mg + dst] = _take(state, hf + src, used)
        qkv = [_take(state, f"{hf}self_attn.{p}_proj.weight", used) for p in "qkv"]
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv, shape)
        if shape.qkv_bias:
            bias = [_take(state, f"{hf}self_attn.{p}_proj.bias", used) for p in "qkv"]
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(*bias, shape)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(state, hf + "mlp.gate_proj.weight", used),
             _take(state, hf + "mlp.up_proj.weight", used)])
    out["decoder.final_layernorm.weight"] = _take(state, "model.norm.weight", used)
    if shape.tied:
        used.add("lm_head.weight")   # present in a tied model's state_dict, or not
    else:
        out["output_layer.weight"] = _pad_rows(_take(state, "lm_head.weight", used), vocab)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"HF tensors the megatron conversion does not place: "
                         f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return out


def megatron_to_hf(state: StateDict, shape: MegatronShape, *, with_tied_head: bool = True
                   ) -> StateDict:
    """The HF state dict of a whole megatron-core state dict (merged over ranks).

    Padded vocabulary rows are dropped.  A tied model gets ``lm_head.weight`` as the same
    tensor as ``model.embed_tokens.weight`` (as HF's ``state_dict`` lists it) unless
    ``with_tied_head`` is False.  ``_extra_state`` entries are ignored; any other unplaced
    tensor raises ValueError."""
    used: set[str] = set()

    def take(name: str) -> Tensor:
        if name not in state:
            raise KeyError(f"the megatron state dict has no {name}")
        used.add(name)
        return state[name]

    v = shape.vocab_size
    out: StateDict = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[:v]}
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for src, dst in _DIRECT.items():
            out[hf + src] = take(mg + dst)
        q, k, w = unfuse_qkv(take(mg + "self_attention.linear_qkv.weight"), shape)
        out.update({hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                    hf + "self_attn.v_proj.weight": w})
        if shape.qkv_bias:
            q, k, w = unfuse_qkv(take(mg + "self_attention.linear_qkv.bias"), shape)
            out.update({hf + "self_attn.q_proj.bias": q, hf + "self_attn.k_proj.bias": k,
                        hf + "self_attn.v_proj.bias": w})
        gate, up = take(mg + "mlp.linear_fc1.weight").chunk(2)
        out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf + "mlp.up_proj.weight"] = up.contiguous()
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not shape.tied:
        out["lm_head.weight"] = take("output_layer.weight")[:v]
    elif with_tied_head:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    left = sorted(k for k in set(state) - used if not k.endswith("_extra_state"))
    if shape.tied:   # a last pipeline stage's copy of the tied embedding
        left = [k for k in left if k != "output_layer.weight"]
    if left:
        raise ValueError(f"megatron tensors the HF conversion does not place: "
                         f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return out


# ------------------------------------------------------------------ tensor parallelism
def _suffix(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(3)[1:] if match else name


def split_tp(state: StateDict, shape: MegatronShape, tp: int) -> list[StateDict]:
    """The ``tp`` tensor-parallel shards of a whole megatron state dict (same names on every
    rank; module docstring for which tensor splits how).  The vocabulary must already be
    padded for ``tp`` (``hf_to_megatron(..., tp=tp)``)."""
    check_parallel(shape, tp, 1)
    shards: list[StateDict] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        kind = _suffix(name)
        if kind == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp),
                                                       strict=True)]
        elif kind in _COLUMN_PARALLEL:
            if tensor.shape[0] % tp:
                raise ValueError(f"{name}: {tensor.shape[0]} rows do not split over {tp} "
                                 f"ranks (pad the vocabulary for tp={tp})")
            parts = list(tensor.chunk(tp))
        elif kind in _ROW_PARALLEL:
            parts = list(tensor.chunk(tp, dim=1))
        else:   # norms: replicated
            parts = [tensor] * tp
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part.contiguous()
    return shards


def merge_tp(shards: list[StateDict], shape: MegatronShape) -> StateDict:
    """The inverse of :func:`split_tp`.  Raises ValueError when the shards name different
    tensors or a replicated tensor differs between ranks."""
    names = set(shards[0])
    for r, shard in enumerate(shards[1:], 1):
        if set(shard) != names:
            raise ValueError(f"tensor-parallel shard {r} names different tensors than "
                             f"shard 0: {sorted(names ^ set(shard))[:3]}")
    out: StateDict = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        kind = _suffix(name)
        if kind.endswith("_extra_state"):
            out[name] = parts[0]
        elif kind == "mlp.linear_fc1.weight":
            halves = [p.chunk(2) for p in parts]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]),
                                   torch.cat([h[1] for h in halves])])
        elif kind in _COLUMN_PARALLEL:
            out[name] = torch.cat(parts)
        elif kind in _ROW_PARALLEL:
            out[name] = torch.cat(parts, dim=1)
        else:
            for r, part in enumerate(parts[1:], 1):
                if not torch.equal(part, parts[0]):
                    raise ValueError(f"{name} is replicated over tensor-parallel ranks but "
                                     f"rank {r}'s copy differs from rank 0's")
            out[name] = parts[0]
    return out


# ---------------------------------------------------------------- pipeline parallelism
def split_pp(state: StateDict, shape: MegatronShape, pp: int) -> list[StateDict]:
    """The ``pp`` pipeline stages of a megatron state dict: stage ``s`` holds layers
    ``s*L/pp .. (s+1)*L/pp - 1`` renumbered from 0; the first stage the embedding, the
    last the final norm and the output layer (a tied model's last stage gets a copy of the
    embedding as ``output_layer.weight``, as megatron keeps one there)."""
    check_parallel(shape, 1, pp)
    per = shape.layers // pp
    stages: list[StateDict] = [{} for _ in range(pp)]
    for name, tensor in state.items():
        match = _LAYER.match(name)
        if match:
            index = int(match.group(2))
            stages[index // per][f"{match.group(1)}{index % per}{match.group(3)}"] = tensor
        elif name.startswith("embedding."):
            stages[0][name] = tensor
        else:
            stages[-1][name] = tensor
    if shape.tied and pp > 1:
        stages[-1]["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return stages


def merge_pp(stages: list[StateDict], shape: MegatronShape) -> StateDict:
    """The inverse of :func:`split_pp`.  A tied model's last-stage output copy must equal
    the first stage's embedding (ValueError otherwise) and is dropped."""
    pp = len(stages)
    per = shape.layers // pp
    out: StateDict = {}
    for s, stage in enumerate(stages):
        for name, tensor in stage.items():
            match = _LAYER.match(name)
            if match:
                index = int(match.group(2))
                if index >= per:
                    raise ValueError(f"stage {s} holds layer {index}; {per} per stage")
                out[f"{match.group(1)}{s * per + index}{match.group(3)}"] = tensor
            elif shape.tied and pp > 1 and name == "output_layer.weight" and s == pp - 1:
                if not torch.equal(tensor, stages[0]["embedding.word_embeddings.weight"]):
                    raise ValueError("the last stage's tied output layer differs from the "
                                     "first stage's embedding")
            else:
                out[name] = tensor
    return out
