"""What the job's ``model`` section resolves to, checked before anything starts.

:func:`plan_model` turns the config into a :class:`ModelPlan`: the ``model_config`` dict every
learner rank and engine builds its policy from (:mod:`erlay.actors.model.build`), the
tokenizer the coordinator uses, and the sequence limit.  For an HF model it reads only the
directory's ``config.json`` and tokenizer files (no weights), so ``erlay run`` can refuse a
bad model in one line, exit 2, before Ray starts:

- a model path that does not exist, or a hub id that is not in the local HF cache;
- a directory with no usable tokenizer, or a tokenizer without EOS;
- ``data.chat: true`` with a tokenizer that has no chat template;
- a tokenizer whose ids do not fit the model's vocabulary;
- for the vllm backend: a head size vLLM's CPU attention does not support (below 32), or
  ``engine.vllm.model_dir`` (the built-in model's GPT-2 directory) beside ``model.hf``.

May import: erlay.supervisor, erlay.actors.config, erlay.actors.model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from erlay.actors.config import ConfigError, JobConfig
from erlay.actors.model.hf import ModelLoadError, load_hf_config, position_limit, resolve_model
from erlay.actors.model.tokenizer import CharTokenizer
from erlay.actors.model.tokens import Tokenizer, load_hf_tokenizer


@dataclass(frozen=True)
class ModelPlan:
    spec: dict[str, Any]     # the model_config of every learner rank and engine
    tokenizer: Tokenizer
    max_seq_len: int         # prompt + completion, in tokens

    @property
    def is_hf(self) -> bool:
        return bool(self.spec.get("hf"))


def plan_model(cfg: JobConfig) -> ModelPlan:
    """The job's model plan; raises :class:`ConfigError` (one line) for a bad model."""
    m = cfg.model
    chat, system = cfg.data.chat, cfg.data.system_prompt
    if m.hf is None:
        if chat:
            raise ConfigError("data.chat: the built-in character model has no chat template; "
                              "name an HF model (model.hf) or set data.chat: false")
        tok = CharTokenizer()
        spec = {"vocab_size": tok.vocab_size, "d_model": m.d_model, "n_layers": m.n_layers,
                "n_heads": m.n_heads, "d_ff": m.d_ff, "max_seq_len": m.builtin_seq_len,
                "mtp_heads": m.mtp_heads}
        return ModelPlan(spec, tok, m.builtin_seq_len)
    try:
        path = resolve_model(m.hf)
        config = load_hf_config(path, m.trust_remote_code)
        tok = load_hf_tokenizer(path, trust_remote_code=m.trust_remote_code, chat=chat,
                                system_prompt=system)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    text = getattr(config, "text_config", config)
    limit = position_limit(text) or m.max_seq_len
    if limit is None:
        raise ConfigError(f"model.hf: {path}/config.json names no position limit "
                          "(max_position_embeddings); set model.max_seq_len")
    if m.max_seq_len is not None and m.max_seq_len > limit:
        raise ConfigError(f"model.max_seq_len: {m.max_seq_len} exceeds the model's position "
                          f"limit {limit} ({path.name})")
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab and tok.vocab_size > vocab:
        raise ConfigError(f"model.hf: the tokenizer has {tok.vocab_size} tokens but the model's "
                          f"vocabulary is {vocab}")
    _check_vllm(cfg, text, path.name)
    seq_len = min(limit, m.max_seq_len or limit)
    spec = {"hf": str(path), "init": m.init, "dtype": m.dtype,
            "trust_remote_code": m.trust_remote_code,
            "lora": m.lora.model_dump() if m.lora else None, "mtp_heads": m.mtp_heads,
            "max_seq_len": seq_len}
    return ModelPlan(spec, tok, seq_len)


def _check_vllm(cfg: JobConfig, text: Any, name: str) -> None:
    """The vllm backend's limits on an HF model, said before its ~30 s start would."""
    if cfg.engine.backend != "vllm":
        return
    if cfg.engine.vllm.model_dir is not None:
        raise ConfigError("engine.vllm.model_dir: serves the built-in model's GPT-2 directory; "
                          "with model.hf the engines serve that model, drop model_dir")
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head = getattr(text, "head_dim", None) or (
        int(getattr(text, "hidden_size", 0) or 0) // heads if heads else None)
    if head is not None and int(head) < 32:
        raise ConfigError(f"engine.backend vllm needs a head size of at least 32 (vLLM's CPU "
                          f"attention supports 32, 64, 80, 96, 112, 128, ...); {name} has "
                          f"{head}")
