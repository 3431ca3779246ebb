"""megatron-core model helpers of the megatron learner backend
(:mod:`erlay.actors.learner.megatron_backend`): build a ``GPTModel`` from a
:class:`~erlay.actors.model.megatron_convert.MegatronShape` with the local (no Transformer
Engine) layer spec, load converted weights strictly, and score completions from its logits.

megatron-core is imported inside the functions, so this module imports without the
``megatron`` extra.  ``build_gpt_model`` and ``load_megatron_state`` run on the CPU
(``use_cpu_initialization``); megatron-core 0.16's forward pass (``megatron_logits``) needs
CUDA (its rotary embedding and attention call ``torch.cuda`` directly).

May import: erlay.actors.model.
"""

from __future__ import annotations

from typing import Any

import torch

from erlay.actors.model.logprobs import DEFAULT_CHUNK_BYTES, target_logprobs
from erlay.actors.model.megatron_convert import (
    MegatronShape,
    gpt_model_kwargs,
    transformer_config_kwargs,
)


def init_parallel_state(tp: int, pp: int) -> None:
    """megatron's ``parallel_state`` over the current ``torch.distributed`` group (which
    must exist): tensor size ``tp``, pipeline size ``pp``, data size the rest."""
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp)


def build_gpt_model(shape: MegatronShape, *, tp: int = 1, pp: int = 1,
                    dtype: torch.dtype = torch.float32, cpu_init: bool = False) -> Any:
    """A megatron-core ``GPTModel`` of ``shape`` with the local (no Transformer Engine) layer
    spec; ``parallel_state`` must be initialised with the same ``tp`` and ``pp``.  With
    ``pp > 1`` it is this rank's pipeline stage: its contiguous block of ``layers / pp``
    layers (megatron numbers them from the stage's offset, its state dict from 0), the
    embedding on the first stage, the final norm and output layer on the last."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(**transformer_config_kwargs(shape),
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               fp16=dtype == torch.float16, use_cpu_initialization=cpu_init,
                               pipeline_dtype=dtype if pp > 1 else None)
    first = pp == 1 or parallel_state.is_pipeline_first_stage()
    last = pp == 1 or parallel_state.is_pipeline_last_stage()
    return GPTModel(config=config, pre_process=first, post_process=last,
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    **gpt_model_kwargs(shape, tp))


def load_megatron_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load converted tensors into ``model`` with ``strict=True``: every parameter must be
    given, with its shape, and nothing else.  Only megatron's ``_extra_state`` entries (no
    tensors: Transformer Engine's FP8 metadata slot) are taken from the model itself."""
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**extra, **state}, strict=True)


def causal_mask(length: int, device: Any = None) -> torch.Tensor:
    """megatron's attention mask ``[1, 1, S, S]``: True where a query must not look."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


def right_pad(seqs: list[list[int]], device: Any = None) -> torch.Tensor:
    """``[B, S]`` token ids, each sequence from slot 0 and zeros after it: with a causal mask
    and RoPE positions ``0 .. S-1`` the padding can change no real token's logits."""
    width = max(len(s) for s in seqs)
    out = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device) if device is not None else out


def megatron_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S, V']`` logits of right-padded ``tokens`` (gathered over tensor ranks)."""
    s = tokens.shape[1]
    positions = torch.arange(s, device=tokens.device)[None].expand_as(tokens)
    return model(tokens, positions, causal_mask(s, tokens.device))


def completion_logprobs(logits: torch.Tensor, prompts: list[list[int]],
                        completions: list[list[int]], vocab_size: int,
                        temperature: float = 1.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, mask)`` ``[B, L]`` of each completion token given what precedes it, from
    right-padded ``logits`` ``[B, S, V']``; the padded vocabulary (ids ``>= vocab_size``)
    is dropped before the softmax, and logits are divided by ``temperature`` unless it is 0
    or 1, as :func:`erlay.actors.model.policy.sequence_logprobs` scores them.

    Only the rows that predict a completion token are read, and their log-softmax is taken
    over chunks of ``chunk_bytes`` of fp32 under activation checkpointing
    (:func:`erlay.actors.model.logprobs.target_logprobs`): megatron's own logits (in its
    compute dtype, one micro-batch's) are the only ``[tokens, vocabulary]`` tensor."""
    device = logits.device
    width = max((len(c) for c in completions), default=0)
    rows = [b for b, c in enumerate(completions) for _ in c]
    cols = [i for c in completions for i in range(len(c))]
    slots = [len(p) - 1 + i for p, c in zip(prompts, completions, strict=True)
             for i in range(len(c))]
    targets = torch.tensor([t for c in completions for t in c], dtype=torch.long,
                           device=device)
    picked = logits[torch.tensor(rows, device=device), torch.tensor(slots, device=device),
                    :vocab_size] if rows else logits.new_zeros((0, vocab_size))
    scored = target_logprobs(picked, torch.nn.Identity(), targets, temperature=temperature,
                             chunk_bytes=chunk_bytes).logprobs
    out = torch.zeros((len(completions), width), device=device)
    mask = torch.zeros((len(completions), width), dtype=torch.bool, device=device)
    if rows:
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        out = out.index_put(index, scored)
        mask[index] = True
    return out, mask


def read_hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    """The HF weights of ``model_dir`` (any format ``from_pretrained`` reads), float32, loaded
    through ``AutoModelForCausalLM`` on the default device."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch.float32)
    return {k: v.detach() for k, v in lm.state_dict().items()}
