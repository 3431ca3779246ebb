"""Any Hugging Face causal LM as erlay's policy: the same interface as the built-in model.

:class:`HFPolicy` wraps an ``AutoModelForCausalLM`` (Llama, Qwen2, GPT-2, Mistral, ... or
``trust_remote_code`` models) so that the learner, the torch engine's
:class:`~erlay.actors.engine.core.DecodeBatch` and the MTP code drive it exactly as they drive
:class:`~erlay.actors.model.policy.PolicyModel`:

- ``hidden(tokens, positions, key_mask, cache)`` -> final hidden states ``[B, T, D]`` and the
  cache as one ``(k, v)`` pair per layer, each ``[B, H_kv, S, Dh]``; ``key_mask`` is ``[B, S]``
  over the cache then the new tokens (HF's 2-D ``attention_mask``), ``positions`` count real
  tokens (HF's ``position_ids``), so left padding and masked-out draft slots work as they do
  for the built-in model;
- ``forward`` -> logits; ``head`` and ``embed`` are the model's own output and input
  embeddings; ``mtp`` holds optional draft heads on the hidden states
  (:class:`~erlay.actors.model.policy.MTPModule`), trained by the learner;
- ``cfg`` carries ``vocab_size``, ``max_seq_len`` (the model's position limit, or the job's
  lower cap) and ``mtp_heads``.

Parameter names are the HF model's own (``model.layers.0.self_attn.q_proj.weight``), because
the wrapper registers the HF model's children under their names; MTP heads add ``mtp.*``.
:meth:`HFPolicy.engine_state` is what a weight update sends to an engine: those HF names, with
LoRA adapters merged in, and no renaming.

Contract: pure model code; reads model directories, never downloads (``local_files_only``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from erlay.actors.model.errors import ModelLoadError
from erlay.actors.model.policy import DRAFT_TABLE_LIMIT, KVBuffer, KVCache, MTPModule

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HFShape:
    """What the job needs to know of an HF policy (the ``cfg`` of :class:`HFPolicy`)."""

    vocab_size: int
    max_seq_len: int
    hidden_size: int
    mtp_heads: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_model(name: str) -> Path:
    """The local directory of ``name``: an existing directory, or a hub id already in the
    user's HF cache (never downloaded).  Raises :class:`ModelLoadError` naming what is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.hf: {path} has no config.json (not a Hugging Face "
                                 "model directory)")
        return path.resolve()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelLoadError(f"model.hf: {name} does not exist (a local directory, or a hub "
                             "id such as Qwen/Qwen2.5-0.5B-Instruct already in the HF cache)")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as exc:   # noqa: BLE001 - every hub failure is the same user error
        raise ModelLoadError(f"model.hf: {name} is neither a directory nor a model in the "
                             f"local Hugging Face cache ({type(exc).__name__}); download it "
                             "first (huggingface-cli download)") from None


def has_weights(path: Path) -> bool:
    return any((path / f).is_file() for f in WEIGHT_FILES)


def load_hf_config(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                          local_files_only=True)
    except Exception as exc:   # noqa: BLE001 - report any loader failure as one line
        raise ModelLoadError(f"model.hf: cannot read {path}/config.json: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from None


def position_limit(config: Any) -> int | None:
    """The model's longest sequence, from its config (``max_position_embeddings`` and aliases)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class HFPolicy(nn.Module):
    """An HF causal LM behind the policy interface (module docstring)."""

    def __init__(self, lm: nn.Module, *, mtp_heads: int = 0,
                 max_seq_len: int | None = None) -> None:
        super().__init__()
        config = lm.config
        # Register the HF model's children under their own names, so this module's state
        # dict is the HF model's (plus mtp.*).  The HF module itself is held outside the
        # module tree to call its forward without registering its parameters twice.
        for name, child in lm.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "lm", lm)
        limit = position_limit(getattr(config, "text_config", config)) or max_seq_len
        if limit is None:
            raise ModelLoadError("model.hf: the config names no position limit "
                                 "(max_position_embeddings); set model.max_seq_len")
        hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
        self.cfg = HFShape(vocab_size=int(lm.get_output_embeddings().weight.shape[0]),
                           max_seq_len=min(limit, max_seq_len or limit), hidden_size=hidden,
                           mtp_heads=mtp_heads)
        self.mtp = nn.ModuleList(MTPModule(hidden) for _ in range(mtp_heads))
        for module in self.mtp.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        self.mtp.to(next(lm.parameters()).dtype)
        self._lean: bool | None = None   # lean_layers(lm), decided on first use
        self._parts: dict[str, nn.Module] = {}   # plain dict: not registered as submodules
        self._rope_table: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self._plan_cache: tuple[list[nn.Parameter], list[tuple[int, int]], list[Any]] | None \
            = None

    def _rotary(self, stack: nn.Module, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``stack.rotary_emb``'s cos and sin at ``positions``, ``[B, 1, T, Dh]``, looked up in
        a table it computed once for every position (element for element the same values;
        dynamic RoPE variants, whose frequencies depend on the length, are computed each
        call).  The sin comes with its first half negated, so that HF's
        ``x * cos + rotate_half(x) * sin`` is ``x * cos + x.roll(Dh / 2) * sin`` (exactly:
        negation is exact)."""
        rotary = stack.rotary_emb
        if "dynamic" in str(getattr(rotary, "rope_type", "")):
            cos, sin = rotary(x, positions)
            return cos[:, None], _sign_first_half(sin)[:, None]
        key = (x.dtype, x.device)
        if self._rope_table is None or self._rope_table[0] != key:
            every = torch.arange(self.cfg.max_seq_len, device=x.device)[None]
            cos, sin = rotary(x, every)
            self._rope_table = (key, cos[0], _sign_first_half(sin[0]))
        _, cos, sin = self._rope_table
        return cos[positions][:, None], sin[positions][:, None]

    def _plan(self, stack: nn.Module) -> list[Any]:
        """The tensors :meth:`_lean_hidden` reads, gathered once: per layer the RMSNorm
        weights and epsilons, the q, k and v projections (one fused weight and bias for a
        model under ``FUSE_LIMIT``), the MLP's gate and up projections (likewise), the output
        projections, and the attention's shape; then the final norm.  Reading them through the
        module tree costs more than the arithmetic on a few rows.  Rebuilt whenever a source
        parameter was replaced or changed in place (a weight update, an optimiser step:
        ``_version``)."""
        if self._plan_cache is not None:
            sources, stamp, plan = self._plan_cache
            if stamp == [(p.data_ptr(), p._version) for p in sources]:
                return plan
        sources = list(stack.parameters())
        # Fused copies of the q/k/v and gate/up weights save two thirds of those matmul
        # calls; they double those weights' memory, so a large model keeps them apart.
        fuse = sum(p.numel() for layer in stack.layers for p in (
            layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
            layer.self_attn.v_proj.weight, layer.mlp.gate_proj.weight,
            layer.mlp.up_proj.weight)) <= FUSE_LIMIT
        layers = []
        with torch.no_grad():
            for layer in stack.layers:
                a, m = layer.self_attn, layer.mlp
                projections = (a.q_proj, a.k_proj, a.v_proj)
                if fuse:
                    bias = None if all(p.bias is None for p in projections) else torch.cat(
                        [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                         for p in projections])
                    qkv = [(torch.cat([p.weight for p in projections]), bias)]
                    gate_up = [(torch.cat([m.gate_proj.weight, m.up_proj.weight]), None)]
                else:
                    qkv = [(p.weight, p.bias) for p in projections]
                    gate_up = [(m.gate_proj.weight, None), (m.up_proj.weight, None)]
                layers.append((
                    layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, qkv,
                    [p.out_features for p in projections], a.head_dim, a.num_key_value_groups,
                    a.scaling, a.o_proj.weight, a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon, gate_up,
                    m.down_proj.weight, m.down_proj.bias))
        plan = [stack.embed_tokens.weight, layers, stack.norm.weight,
                stack.norm.variance_epsilon]
        self._plan_cache = (sources, [(p.data_ptr(), p._version) for p in sources], plan)
        return plan

    def _lean_hidden(self, tokens: torch.Tensor, positions: torch.Tensor,
                     key_mask: torch.Tensor, buffer: KVBuffer) -> torch.Tensor:
        """The HF Llama-style decoder forward (embedding, per layer: RMSNorm, rotary q/k,
        attention, residual, RMSNorm, gated SiLU MLP, residual; final norm) in torch's
        functions on the weights of :meth:`_plan`, with the new keys and values written into
        ``buffer`` and the attention mask built directly (:func:`_attention_bias`).  Equal to
        HF's forward up to float32 rounding (fused projections;
        ``tests/actors/model/test_decode_path.py``)."""
        stack = self.backbone
        embed_w, layers, norm_w, norm_eps = self._plan(stack)
        b, t = tokens.shape
        bias = _attention_bias(key_mask, t, prefill=buffer.width == 0)
        x = F.embedding(tokens, embed_w)
        cos, sin = self._rotary(stack, x, positions)
        half = cos.shape[-1] // 2
        width = (x.shape[-1],)
        for i, (ln1, eps1, qkv, sizes, head_dim, groups, scaling, w_o, b_o, ln2, eps2,
                gate_up, w_down, b_down) in enumerate(layers):
            h = torch.rms_norm(x, width, ln1, eps1)
            q, k, v = F.linear(h, *qkv[0]).split(sizes, -1) if len(qkv) == 1 else \
                (F.linear(h, *p) for p in qkv)
            q = q.view(b, t, -1, head_dim).transpose(1, 2)
            k = k.view(b, t, -1, head_dim).transpose(1, 2)
            v = v.view(b, t, -1, head_dim).transpose(1, 2)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            k, v = buffer.write(i, k, v)
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            # Attention as two matmuls: on these shapes (a few query rows per sequence, tens
            # of keys) faster on the CPU than torch's fused kernel, which tiles for long ones.
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).add_(bias)
            out = torch.matmul(scores.softmax(dim=-1), v)
            x = x + F.linear(out.transpose(1, 2).reshape(b, t, -1), w_o, b_o)
            h = torch.rms_norm(x, width, ln2, eps2)
            gate, up = F.linear(h, *gate_up[0]).chunk(2, -1) if len(gate_up) == 1 else \
                (F.linear(h, *p) for p in gate_up)
            x = x + F.linear(F.silu(gate) * up, w_down, b_down)
        buffer.commit()
        return torch.rms_norm(x, width, norm_w, norm_eps)

    # The three submodules below are looked up once: HF's getters walk the model each call,
    # which costs more than a draft step's arithmetic.  The module tree is fixed after
    # construction (LoRA wraps before it), so the lookups cannot go stale.
    @property
    def backbone(self) -> nn.Module:
        """The decoder stack (``model``, ``transformer``, ...): hidden states, no head."""
        if "backbone" not in self._parts:
            base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
            self._parts["backbone"] = base.get_decoder() if hasattr(base, "get_decoder") \
                else base.base_model
        return self._parts["backbone"]

    @property
    def head(self) -> nn.Module:
        if "head" not in self._parts:
            self._parts["head"] = self.lm.get_output_embeddings()
        return self._parts["head"]

    @property
    def embed(self) -> nn.Module:
        if "embed" not in self._parts:
            self._parts["embed"] = self.lm.get_input_embeddings()
        return self._parts["embed"]

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
               cache: KVCache | KVBuffer | None = None, *, keep_cache: bool = True
               ) -> tuple[torch.Tensor, KVCache | KVBuffer]:
        """Final hidden states ``[B, T, D]`` and the updated cache (module docstring);
        ``keep_cache=False`` (scoring: no decode follows) builds none.

        A :class:`~erlay.actors.model.policy.KVBuffer` cache (the decode loop's, after its
        ``reserve``) is updated in place and returned; for a Llama-style decoder stack
        (:func:`lean_layers`) it runs :meth:`_lean_hidden`, the same computation as the HF
        forward without its per-call mask building and cache objects."""
        from transformers import DynamicCache
        # Not under torch.compile: reading a tensor's value breaks the graph (a traced
        # engine's requests were already checked against max_seq_len by validate_request).
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        if isinstance(cache, KVBuffer):
            if self._lean is None:
                self._lean = lean_layers(self.lm)
            if self._lean:
                return self._lean_hidden(tokens, positions, key_mask, cache), cache
            t = tokens.shape[1]
            h, full = self.hidden(tokens, positions, key_mask, cache.legacy())
            for i, (k, v) in enumerate(full):
                cache.write(i, k[:, :, -t:], v[:, :, -t:])
            cache.commit()
            return h, cache
        use_cache = cache is not None or (keep_cache and not torch.is_grad_enabled())
        past = None
        if use_cache:
            past = DynamicCache(ddp_cache_data=cache, config=self.lm.config) if cache \
                else DynamicCache(config=self.lm.config)
        out = self.backbone(input_ids=tokens, attention_mask=key_mask.long(),
                            position_ids=positions, past_key_values=past, use_cache=use_cache)
        new_cache: KVCache = []
        if use_cache and out.past_key_values is not None:
            new_cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out.last_hidden_state, new_cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
                cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Logits ``[B, T, V]`` and the updated cache."""
        h, new_cache = self.hidden(tokens, positions, key_mask, cache)
        return self.head(h), new_cache

    def draft_step(self, k: int, h: torch.Tensor, token: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module ``k`` on ``h`` ``[B, D]`` and the tokens ``[B]`` at offset ``k + 1``."""
        embed, head = self.embed, self.head
        if type(embed) is not nn.Embedding:   # scaled, LoRA-wrapped, ...: its own forward
            nxt = self.mtp[k](h, embed(token))
        elif torch.is_grad_enabled() or embed.weight.numel() * len(self.mtp) \
                > DRAFT_TABLE_LIMIT:
            nxt = self.mtp[k](h, F.embedding(token, embed.weight))
        else:   # the per-token table of MTPModule.draft
            nxt = self.mtp[k].draft(h, token, embed.weight)
        return nxt, (F.linear(nxt, head.weight, head.bias) if type(head) is nn.Linear
                     else head(nxt))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def engine_state(self) -> dict[str, np.ndarray]:
        """HF-named float32 weights (LoRA merged in) plus ``mtp.*``: what engines load.

        Tied weights appear under both names, as ``state_dict`` gives them; vLLM's
        ``load_weights`` and :meth:`load_engine_state` both accept that.
        """
        from erlay.actors.model.lora import merged_state
        state = merged_state(self.lm) if hasattr(self.lm, "peft_config") else {
            k: v for k, v in self.lm.state_dict().items()}
        state.update({f"mtp.{k}": v for k, v in self.mtp.state_dict().items()})
        return {k: v.detach().to(torch.float32).cpu().numpy().copy() for k, v in state.items()}


def _attention_bias(key_mask: torch.Tensor, t: int, *, prefill: bool) -> torch.Tensor:
    """The additive attention mask ``[B, 1, T, S]`` (0 or -inf) of ``t`` new tokens over
    ``key_mask`` ``[B, S]``: query ``i`` (slot ``S - T + i``) sees real keys up to its own
    slot.  A prefill's left padding puts queries on pad slots, which would attend to nothing
    (NaN), so there each query always sees its own slot; after it, every fed token is real
    (``DecodeBatch`` feeds real tokens only), so the mask is the keys' and, for ``t > 1``,
    the causal triangle over the new slots: a few small ops rather than a full mask."""
    s = key_mask.shape[1]
    if prefill:
        slots = torch.arange(s)
        own = slots[s - t:, None]
        allowed = (slots[None, None, :] <= own[None]) & key_mask[:, None, :]
        allowed = (allowed | (slots[None, None, :] == own[None]))[:, None]
        return torch.where(allowed, 0.0, float("-inf"))
    keys = torch.where(key_mask, 0.0, float("-inf"))[:, None, None, :]
    if t == 1:
        return keys
    causal = F.pad(torch.full((t, t), float("-inf")).triu_(1), (s - t, 0))
    return keys + causal


def _sign_first_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., :half], x[..., half:]), dim=-1)


LEAN_TYPES = ("llama", "qwen2", "mistral")
FUSE_LIMIT = 16 * 2**20   # parameters: fused projection copies up to ~64 MB in float32


def lean_layers(lm: nn.Module) -> bool:
    """Whether :meth:`HFPolicy._lean_hidden` computes ``lm``'s decoder forward: a plain (no
    LoRA, no remote code) float32 Llama, Qwen2 or Mistral whose every layer is full attention
    with rotary q/k, no extra q/k norms, and a SiLU-gated MLP.  Anything else runs HF's own
    forward."""
    config = lm.config
    if next(lm.parameters()).dtype != torch.float32:   # HF normalises in float32 and casts
        return False
    if getattr(config, "model_type", None) not in LEAN_TYPES or hasattr(lm, "peft_config") \
            or type(lm).__module__.split(".")[0] != "transformers":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()) \
            or getattr(config, "hidden_act", None) not in ("silu", "swish") \
            or (getattr(config, "sliding_window", None)
                and getattr(config, "use_sliding_window", True)):
        return False
    stack = getattr(lm, "model", None)
    if stack is None or not all(hasattr(stack, n) for n in ("embed_tokens", "rotary_emb",
                                                            "layers", "norm")):
        return False
    return all(hasattr(layer, "self_attn") and not hasattr(layer.self_attn, "q_norm")
               and hasattr(layer.self_attn, "num_key_value_groups")
               and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
               and all(hasattr(norm, "variance_epsilon") for norm in
                       (layer.input_layernorm, layer.post_attention_layernorm, stack.norm))
               for layer in stack.layers)


def _dtype(name: str, config: Any) -> torch.dtype:
    if name == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(found, str):
            found = _DTYPES.get(found)
        return found if isinstance(found, torch.dtype) else torch.float32
    return _DTYPES[name]


def build_hf_policy(spec: dict[str, Any], *, seed: int = 0,
                    with_lora: bool = True) -> HFPolicy:
    """The policy a ``model_config`` dict with ``hf`` describes (see
    :func:`erlay.actors.model.build.model_spec`): pretrained weights from the directory, or,
    with ``init: random`` (or a directory without weights), a seeded random initialisation
    from its config.  ``with_lora=False`` builds the plain model an engine serves."""
    from transformers import AutoModelForCausalLM
    path = resolve_model(spec["hf"])
    remote = bool(spec.get("trust_remote_code", False))
    config = load_hf_config(path, remote)
    dtype = _dtype(spec.get("dtype", "float32"), config)
    random_init = spec.get("init", "pretrained") == "random" or not has_weights(path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            if random_init:
                lm = AutoModelForCausalLM.from_config(config, trust_remote_code=remote,
                                                      dtype=dtype)
            else:
                lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote,
                                                          dtype=dtype, local_files_only=True)
        except Exception as exc:   # noqa: BLE001 - one line naming the model
            raise ModelLoadError(f"model.hf: cannot load {path}: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        lm.config.use_cache = True
        lora = spec.get("lora")
        if lora and with_lora:
            from erlay.actors.model.lora import wrap_lora
            lm = wrap_lora(lm, lora)
        policy = HFPolicy(lm, mtp_heads=int(spec.get("mtp_heads", 0)),
                          max_seq_len=spec.get("max_seq_len"))
    return policy
