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

from erlay.actors.model.policy import KVCache, MTPModule
from erlay.supervisor.errors import ErlayError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelLoadError(ErlayError, ValueError):
    """A model named by ``model.hf`` cannot be found or loaded; the message says which."""


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

    @property
    def backbone(self) -> nn.Module:
        """The decoder stack (``model``, ``transformer``, ...): hidden states, no head."""
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        return base.get_decoder() if hasattr(base, "get_decoder") else base.base_model

    @property
    def head(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    @property
    def embed(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
               cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Final hidden states ``[B, T, D]`` and the updated cache (module docstring)."""
        from transformers import DynamicCache
        if int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        use_cache = not torch.is_grad_enabled() or cache is not None
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
        nxt = self.mtp[k](h, self.embed(token))
        return nxt, self.head(nxt)

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
