"""HF policies as Hugging Face model directories: what vLLM serves and what ``erlay export``
writes.

- :func:`write_served_dir` writes the directory a vLLM engine starts on when the model's
  own directory has no weights to serve (``model.init: random``, or no weight files): the
  model's ``config.json`` (and ``generation_config.json``) with the weights of an engine-side
  policy (:func:`erlay.actors.model.build.build_policy` with ``for_engine=True``, the same
  seeded initialisation the learner starts from), as ``save_pretrained`` writes them.
- :func:`served_shapes` gives the HF-named parameter shapes of a model directory without
  loading its weights (the model is built on the ``meta`` device): what a weight update must
  match.
- :func:`write_merged` writes a learner policy as a plain HF model directory (LoRA adapters
  merged into their base weights by ``peft``'s ``merge_and_unload``), with the tokenizer
  and generation config of the model it was trained from; :func:`write_adapter` writes the
  LoRA adapter alone, as ``peft`` saves it (``adapter_config.json`` and
  ``adapter_model.safetensors``), for ``PeftModel.from_pretrained`` on the base model.

Names are the HF model's own throughout; erlay's ``mtp.*`` draft heads are never written
(no HF architecture has them).  Contract: model code and model directories only; no Ray.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from erlay.actors.model.hf import HFPolicy, ModelLoadError, load_hf_config, resolve_model

# The files a tokenizer is saved as, across tokenizer kinds (fast, sentencepiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files of model directory ``source`` into ``out`` byte for byte
    (the tokenizer the run trained with); returns the names copied.  Raises
    :class:`ModelLoadError` when ``source`` has none."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not copied:
        raise ModelLoadError(f"{source} has no tokenizer files to export")
    for name in copied:
        shutil.copyfile(source / name, out / name)
    return copied


def _copy_generation_config(source: Path, out: Path, lm: torch.nn.Module) -> None:
    """The source's generation config if it has one, else one derived from the model's
    config (``save_pretrained`` of a model built from a config would write defaults)."""
    if (source / GENERATION_CONFIG).is_file():
        shutil.copyfile(source / GENERATION_CONFIG, out / GENERATION_CONFIG)
    elif getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)


def _plain_lm(policy: HFPolicy) -> torch.nn.Module:
    """The policy's HF model without adapters: a LoRA model merged (``merge_and_unload``
    changes the policy's module in place: call it on a policy that is not used afterwards)."""
    lm = policy.lm
    return lm.merge_and_unload() if hasattr(lm, "peft_config") else lm


def write_merged(policy: HFPolicy, source: str | Path, out: str | Path, *,
                 tokenizer: bool = True) -> Path:
    """Write ``policy`` as an HF model directory at ``out``: ``config.json``,
    ``model.safetensors`` (adapters merged), ``generation_config.json`` and, with
    ``tokenizer``, the tokenizer files of the model directory ``source``.  Consumes a LoRA
    policy (its adapters are merged in place)."""
    source, out = resolve_model(str(source)), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm = _plain_lm(policy)
    lm.save_pretrained(out, safe_serialization=True)
    _copy_generation_config(source, out, lm)
    if tokenizer:
        copy_tokenizer(source, out)
    return out


def write_adapter(policy: HFPolicy, source: str | Path, out: str | Path) -> Path:
    """Write ``policy``'s LoRA adapter at ``out`` as ``peft`` saves it, naming ``source``
    as its base model, with the base's tokenizer.  Raises :class:`ModelLoadError` when the
    policy has no adapter."""
    lm = policy.lm
    if not hasattr(lm, "peft_config"):
        raise ModelLoadError("the run trained no LoRA adapter (model.lora is not set); "
                             "export the full model instead (without --adapter)")
    source, out = resolve_model(str(source)), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for config in lm.peft_config.values():
        config.base_model_name_or_path = str(source)
    lm.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(source, out)
    return out


def write_served_dir(policy: HFPolicy, source: str | Path, out: str | Path) -> Path:
    """The directory a vLLM engine serves for ``policy`` (module docstring): config,
    generation config and weights; no tokenizer (erlay tokenizes)."""
    return write_merged(policy, source, out, tokenizer=False)


def served_shapes(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF-named parameter shapes of the model ``spec`` names, built on the ``meta`` device
    (no memory, no weights read): the names and shapes ``HFPolicy.engine_state`` yields,
    without ``mtp.*``."""
    from transformers import AutoModelForCausalLM
    remote = bool(spec.get("trust_remote_code", False))
    config = load_hf_config(resolve_model(spec["hf"]), remote)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    return {k: tuple(v.shape) for k, v in lm.state_dict().items()}
