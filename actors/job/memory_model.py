"""What each role of a job holds in device memory, predicted from the config before anything
starts: ``erlay run --dry-run`` prints it, and the shipped configs state it.

A learner rank holds::

    learner = P x (w + g + o + c) / S                    training state
            + U x w                                      fsdp2: units gathered whole (2)
            + T x (L x D x a + D x b) + k x C            one micro-batch's activations
            + P x w / S   (only when kl_coef > 0)        the frozen reference policy

with ``P`` the parameters (exact: the HF config built on the meta device), ``w, g, o, c`` the
bytes per parameter of weights, gradients, AdamW's two moments and a compute copy
(:data:`BYTES_PER_PARAM`; with LoRA only the adapters have ``g`` and ``o``), ``S`` the
ranks the state is sharded over (fsdp2: ``learner.num_ranks``; megatron: tensor x
pipeline; replicated: 1), ``T`` ``learner.micro_batch_tokens``, ``L`` layers, ``D`` the
hidden size, ``C`` ``learner.logits_chunk_mb``.  ``a`` (bytes per token, per layer, per unit
of hidden size) and ``b`` (the embeddings' and final norm's share) are measured by
``python bench/learner_memory.py`` at Qwen2-0.5B's shape in fp32 (:data:`ACTIVATIONS`); the
scaling law is that activations grow as hidden x layers x tokens (the MLP's width moves with
the hidden size in the Qwen2 family: 5.3 to 5.8 x), and the logits never exceed ``k``
chunks (the chunk's fp32 logits and their gradient, :mod:`erlay.actors.model.logprobs`).
bf16 compute halves ``a`` and ``b`` (an assumption from the dtypes, not measured on a GPU);
activation checkpointing keeps one ``D``-wide input per layer (``4 x D`` bytes per token per
layer) plus one layer's activations while it is recomputed.

An engine holds its weights in the serving dtype (``engine.vllm.engine_args.dtype``, else
``model.dtype``) split over ``tensor_parallel_size`` GPUs, plus its KV cache: vLLM takes
``gpu_memory_utilization`` of each GPU for both (so its share of the GPU *is* the estimate),
the torch engine ``max_batch x max_seq_len`` tokens of keys and values.  A process on a GPU
adds :data:`CUDA_CONTEXT_BYTES`.  Colocated roles (``placement.colocate``) share one GPU:
their estimates add up, and ``placement.gpu_memory_gib`` is what they must fit.

Pure but for :func:`model_shape`, which reads a ``config.json`` (the model's directory, the
local HF cache, or a shape shipped in ``configs/models/shapes/``) and never downloads.

May import: erlay.actors.config, erlay.actors.model, erlay.actors.job.modelplan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.config import ConfigError, JobConfig

GIB = 2**30
MIB = 2**20
SHAPES = Path(__file__).resolve().parents[1].parent / "configs" / "models" / "shapes"
CUDA_CONTEXT_BYTES = GIB // 2        # CUDA context + allocator slack per GPU process
FSDP_GATHERED_UNITS = 2              # the unit computing and the one prefetched


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of one precision's training state."""

    weights: int
    grads: int
    optimizer: int       # AdamW's exp_avg and exp_avg_sq
    compute: int         # a compute-dtype copy alive during a micro-batch's passes

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.compute


# fp32: 4 + 4 + 8.  bf16-mixed: fp32 master weights, gradients and moments, plus the bf16
# copy torch.autocast casts each weight to and caches for the forward region (its weight
# cast cache holds leaf tensors that require grad), which the backward pass keeps as saved
# tensors until the micro-batch's backward ends: 2 more.  bf16: weights, gradients and
# AdamW's moments (torch keeps them in the parameter's dtype) all bf16.
BYTES_PER_PARAM: dict[str, ParamBytes] = {
    "fp32": ParamBytes(4, 4, 8, 0),
    "bf16-mixed": ParamBytes(4, 4, 8, 2),
    "bf16": ParamBytes(2, 2, 4, 0),
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}


@dataclass(frozen=True)
class Activations:
    """Measured activation bytes of one micro-batch (module docstring: ``a``, ``b``, ``k``)."""

    per_token_layer_hidden: float    # a
    per_token_hidden: float          # b
    logits_chunks: float             # k


# bench/learner_memory.py, Qwen2-0.5B's shape (hidden 896), fp32, no checkpointing, rows of
# 512 tokens (384 prompt), micro_batch_tokens 2048, logits_chunk_mb 256 (docs/scaling.md):
# 107,714 bytes per token per layer (/ 896 = a), and 843,499,333 bytes for the rest of a
# micro-batch, of which k = 2 chunks (the chunk's fp32 logits and their gradient, both alive
# in the head's backward) and the remainder per token (/ 2048 / 896 = b).
ACTIVATIONS = Activations(per_token_layer_hidden=120.2, per_token_hidden=167.1,
                          logits_chunks=2.0)


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of an HF model (:func:`model_shape`)."""

    params: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    largest_unit_params: int     # the largest FSDP2 unit: a block, or the root's own
    lora_params: int = 0         # adapter parameters (model.lora), else 0
    name: str = ""


def model_shape(cfg: JobConfig) -> ModelShape:
    """The job's model shape; :class:`ConfigError` (one line) when its ``config.json`` is
    nowhere local."""
    m = cfg.model
    if m.hf is None:
        return _builtin_shape(cfg)
    config = _hf_config(m.hf, m.trust_remote_code)
    return shape_of_config(config, m.lora.model_dump() if m.lora else None, name=m.hf)


def _hf_config(name: str, trust_remote_code: bool) -> Any:
    from erlay.actors.model.hf import ModelLoadError, load_hf_config, resolve_model
    try:
        return load_hf_config(resolve_model(name), trust_remote_code)
    except ModelLoadError:
        shipped = SHAPES / f"{name.rstrip('/').split('/')[-1]}.json"
        if not shipped.is_file():
            raise ConfigError(f"model.hf: {name}: no config.json in a local directory, the "
                              f"HF cache or {SHAPES} (memory estimates need the model's "
                              "shape; download the model or add its config.json there)"
                              ) from None
    from transformers import AutoConfig
    data = json.loads(shipped.read_text(encoding="utf-8"))
    return AutoConfig.for_model(data.pop("model_type"), **data)


def shape_of_config(config: Any, lora: dict[str, Any] | None = None, *,
                    name: str = "") -> ModelShape:
    """The exact parameter count and shape of ``config``, built on the meta device (no
    memory, no weights); ``lora`` counts the adapters peft would add (``r x (in + out)``
    per targeted ``nn.Linear``; ``all-linear``: every one but the output head)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM
    text = getattr(config, "text_config", config)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in lm.parameters())
    blocks = [m for n, m in lm.named_modules() if n.endswith("layers") or n.endswith(".h")]
    layers = list(blocks[0]) if blocks else []
    block = max((sum(p.numel() for p in b.parameters()) for b in layers), default=0)
    largest = max(block, params - sum(sum(p.numel() for p in b.parameters()) for b in layers))
    adapters = 0
    if lora:
        r, targets = int(lora.get("r", 8)), lora.get("target_modules", "all-linear")
        head = lm.get_output_embeddings()
        for mod_name, module in lm.named_modules():
            if not isinstance(module, nn.Linear) or module is head:
                continue
            if targets == "all-linear" or mod_name.split(".")[-1] in targets:
                adapters += r * (module.in_features + module.out_features)
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    return ModelShape(params=params, hidden=hidden, layers=int(text.num_hidden_layers),
                      kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                      head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
                      largest_unit_params=largest, lora_params=adapters, name=name)


def _builtin_shape(cfg: JobConfig) -> ModelShape:
    """The built-in character model, counted from its own module (cheap: a few MB)."""
    from erlay.actors.job.modelplan import plan_model
    from erlay.actors.model.build import build_policy
    model = build_policy(plan_model(cfg).spec)
    m = cfg.model
    return ModelShape(params=sum(p.numel() for p in model.parameters()), hidden=m.d_model,
                      layers=m.n_layers, kv_heads=m.n_heads, head_dim=m.d_model // m.n_heads,
                      largest_unit_params=0, name="built-in")


# -------------------------------------------------------------------------- the roles
@dataclass(frozen=True)
class RoleEstimate:
    """One role's predicted bytes per device, itemised."""

    role: str                    # learner rank / engine / reference
    device: str                  # "cpu" or "cuda"
    gpus: float                  # GPUs the role asks for (per rank, per engine)
    parts: dict[str, int]
    note: str = ""

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())


def learner_precision(cfg: JobConfig) -> str:
    """``learner.precision`` resolved (``auto``: bf16-mixed on cuda, fp32 on the CPU)."""
    p = cfg.learner.precision
    if p == "auto":
        return "bf16-mixed" if cfg.learner.device.startswith("cuda") else "fp32"
    return p


def activation_bytes(shape: ModelShape, tokens: int, precision: str, checkpointing: bool,
                     chunk_mb: int, act: Activations = ACTIVATIONS) -> int:
    """One micro-batch's activations (module docstring)."""
    scale = 0.5 if precision in ("bf16-mixed", "bf16") else 1.0
    per_layer = act.per_token_layer_hidden * shape.hidden * scale
    if checkpointing:   # each layer's input kept, one layer recomputed at a time
        layers = 4.0 * shape.hidden * shape.layers + per_layer
    else:
        layers = per_layer * shape.layers
    rest = act.per_token_hidden * shape.hidden * scale
    return int(tokens * (layers + rest) + act.logits_chunks * chunk_mb * MIB)


def learner_estimate(cfg: JobConfig, shape: ModelShape) -> list[RoleEstimate]:
    """A learner rank, and the reference policy it holds when ``kl_coef > 0``."""
    lr = cfg.learner
    precision = learner_precision(cfg)
    b = BYTES_PER_PARAM[precision]
    shards = {"fsdp2": lr.num_ranks,
              "megatron": lr.megatron.tensor_parallel * lr.megatron.pipeline_parallel
              }.get(lr.backend, 1)
    trained = shape.lora_params or shape.params
    weights = shape.params + shape.lora_params
    parts = {"weights": weights * b.weights // shards,
             "grads": trained * b.grads // shards,
             "optimizer": trained * b.optimizer // shards,
             "compute copy": weights * b.compute // shards}
    if lr.backend == "fsdp2" and shards > 1:
        parts["gathered units"] = FSDP_GATHERED_UNITS * shape.largest_unit_params * b.weights
    parts["activations"] = activation_bytes(shape, lr.micro_batch_tokens, precision,
                                            lr.activation_checkpointing, lr.logits_chunk_mb)
    on_gpu = lr.device.startswith("cuda")
    if on_gpu:
        parts["cuda context"] = CUDA_CONTEXT_BYTES
    note = (f"{precision}, {lr.backend}" + (f" over {shards} ranks" if shards > 1 else "")
            + f", micro_batch_tokens {lr.micro_batch_tokens}"
            + (", activation checkpointing" if lr.activation_checkpointing else ""))
    out = [RoleEstimate("learner rank", "cuda" if on_gpu else "cpu", lr.num_gpus, parts, note)]
    if lr.kl_coef > 0:
        out.append(RoleEstimate("reference", out[0].device, 0.0,
                                {"weights": shape.params * b.weights // shards},
                                "frozen copy on each learner rank (kl_coef > 0)"))
    return out


def engine_estimate(cfg: JobConfig, shape: ModelShape, gpu_bytes: int | None) -> RoleEstimate:
    """One engine: weights in the serving dtype plus its KV cache (module docstring)."""
    e = cfg.engine
    if e.backend == "vllm":
        args = e.vllm.engine_args
        tp = int(args.get("tensor_parallel_size", 1))
        dtype = str(args.get("dtype", cfg.model.dtype))
        bytes_per = _DTYPE_BYTES.get(dtype, 2)
        weights = shape.params * bytes_per // tp
        share = float(args.get("gpu_memory_utilization", 0.9))
        on_gpu = e.vllm.num_gpus > 0
        parts = {"weights": weights}
        note = f"vllm, {dtype}, tensor_parallel_size {tp}, gpu_memory_utilization {share:g}"
        if on_gpu and gpu_bytes is not None:
            parts["kv cache and runtime"] = max(0, int(share * gpu_bytes) - weights)
        elif on_gpu:
            note += " (+ the KV cache: the rest of that share; give placement.gpu_memory_gib)"
        return RoleEstimate("engine", "cuda" if on_gpu else "cpu", e.vllm.num_gpus, parts,
                            note)
    bytes_per = _DTYPE_BYTES.get(cfg.model.dtype, 4)
    seq = cfg.model.max_seq_len or cfg.model.builtin_seq_len
    kv = e.max_batch * seq * shape.layers * 2 * shape.kv_heads * shape.head_dim * bytes_per
    return RoleEstimate("engine", "cpu", 0.0,
                        {"weights": shape.params * bytes_per, "kv cache": kv},
                        f"torch, {cfg.model.dtype}, {e.max_batch} x {seq} tokens of KV")


@dataclass(frozen=True)
class Plan:
    """Every role's estimate and what must fit on one GPU."""

    roles: list[RoleEstimate]
    per_gpu: int                 # bytes the busiest GPU holds
    gpu_bytes: int | None        # placement.gpu_memory_gib
    colocated: bool


def plan(cfg: JobConfig, shape: ModelShape | None = None) -> Plan:
    """The job's memory plan; raises :class:`ConfigError` (one line) when a GPU is named
    with ``placement.gpu_memory_gib`` and a role, or a colocated pair, cannot fit it."""
    shape = shape or model_shape(cfg)
    gib = cfg.placement.gpu_memory_gib
    gpu_bytes = None if gib is None else int(gib * GIB)
    learner = learner_estimate(cfg, shape)
    engine = engine_estimate(cfg, shape, gpu_bytes)
    roles = [*learner, engine]
    on_learner_gpu = sum(r.bytes for r in learner if r.device == "cuda")
    engine_gpu = engine.bytes   # vLLM's share of the GPU counts its own context
    colocated = cfg.placement.colocate
    per_gpu = on_learner_gpu + engine_gpu if colocated else max(on_learner_gpu,
                                                                 engine_gpu if
                                                                 engine.device == "cuda"
                                                                 else 0)
    result = Plan(roles, per_gpu, gpu_bytes, colocated)
    if gpu_bytes is not None:
        check_fit(cfg, result, learner, engine)
    return result


def check_fit(cfg: JobConfig, p: Plan, learner: list[RoleEstimate],
              engine: RoleEstimate) -> None:
    """:class:`ConfigError` naming the role and the keys to change, when one does not fit."""
    assert p.gpu_bytes is not None
    gpu = f"placement.gpu_memory_gib {p.gpu_bytes / GIB:g}"
    need = sum(r.bytes for r in learner if r.device == "cuda")
    if p.colocated and engine.device == "cuda":
        share = float(cfg.engine.vllm.engine_args.get("gpu_memory_utilization", 0.9))
        if p.per_gpu > p.gpu_bytes:
            raise ConfigError(f"placement.colocate: a learner rank ({need / GIB:.1f} GiB) and "
                              f"an engine ({share:g} of the GPU) need {p.per_gpu / GIB:.1f} "
                              f"GiB, more than {gpu}: lower engine.vllm.engine_args."
                              f"gpu_memory_utilization or learner.micro_batch_tokens")
    elif need > p.gpu_bytes:
        raise ConfigError(f"learner: a rank needs {need / GIB:.1f} GiB "
                          f"({learner[0].note}), more than {gpu}: use backend fsdp2 over "
                          "more ranks, a lower learner.micro_batch_tokens, "
                          "learner.activation_checkpointing or model.lora")
    weights = engine.parts["weights"]
    if engine.device == "cuda":
        share = float(cfg.engine.vllm.engine_args.get("gpu_memory_utilization", 0.9))
        if weights + CUDA_CONTEXT_BYTES > share * p.gpu_bytes:
            raise ConfigError(f"engine: its weights ({weights / GIB:.1f} GiB per GPU) leave "
                              f"no KV cache in gpu_memory_utilization {share:g} of {gpu}: "
                              "raise engine.vllm.engine_args.tensor_parallel_size or "
                              "gpu_memory_utilization")


def render(cfg: JobConfig, p: Plan) -> str:
    """The dry-run's table: each role's GiB, its device and what it is made of."""
    lines = [f"{'role':<14}{'device':<22}{'GiB':>7}  parts (GiB)"]
    for r in p.roles:
        count = cfg.learner.num_ranks if r.role == "learner rank" else \
            cfg.engine.num_engines if r.role == "engine" else cfg.learner.num_ranks
        where = "host memory" if r.device == "cpu" else (
            f"{r.gpus:g} GPU" + ("" if r.gpus == 1 else "s") if r.gpus else "the rank's GPU")
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in r.parts.items())
        lines.append(f"{r.role:<14}{(f'{count} x ' + where):<22}{r.bytes / GIB:>7.2f}  "
                     f"{parts}; {r.note}")
    gpu = "unknown (placement.gpu_memory_gib not set)" if p.gpu_bytes is None else \
        f"{p.gpu_bytes / GIB:g} GiB"
    lines.append(f"busiest GPU: {p.per_gpu / GIB:.2f} GiB"
                 + (" (a learner rank and an engine, colocated)" if p.colocated else "")
                 + f" of {gpu}")
    return "\n".join(lines)
