"""Tiny Hugging Face models and tokenizers, built locally: the CPU default's model, and the
fixtures of tests and benchmarks (nothing is ever downloaded).

- :func:`char_tokenizer` is a character-level ``PreTrainedTokenizerFast`` built with the
  ``tokenizers`` library (a WordLevel model over one token per character, with BOS, EOS, PAD
  and UNK), carrying a small ChatML-style chat template that renders a system prompt, the
  messages and any tool schemas;
- :func:`byte_bpe_tokenizer` is a byte-level BPE one (Qwen2's kind), same template;
- :func:`tiny_config` is a ``transformers`` config of a Llama, Qwen2 or GPT-2 architecture at
  toy size;
- :func:`write_tiny_model` writes a model directory (config, tokenizer, generation config and,
  unless ``weights=False``, seeded random weights as safetensors) that
  ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load, and vLLM serves.

``python -m erlay.actors.model.tiny OUT_DIR --arch qwen2`` writes the CPU default's model
directory, ``configs/models/tiny-qwen2`` (``--arch llama``: ``configs/models/tiny-llama``, which
``configs/gsm8k-tiny.yaml`` uses); ``tests/actors/model/test_shipped_models.py`` checks that the
shipped files are what this writes.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path
from typing import Any

ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Role markers of the chat template: single tokens, so a chat prompt stays short.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] if "
    "t['function'] is defined else t['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

ARCHITECTURES = ("llama", "qwen2", "gpt2")


def char_tokenizer(alphabet: str = ALPHABET, *, chat_template: str | None = CHAT_TEMPLATE
                   ) -> Any:
    """A character-level ``PreTrainedTokenizerFast``: ids 0-3 are PAD, BOS, EOS, UNK, then
    the chat markers, then one id per character of ``alphabet``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *CHAT_TOKENS, *alphabet))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return _wrap(core, chat_template)


def _wrap(core: Any, chat_template: str | None) -> Any:
    """``core`` (a ``tokenizers.Tokenizer``) as a ``PreTrainedTokenizerFast`` with erlay's
    specials, the chat markers and ``chat_template``."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=list(CHAT_TOKENS))
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def byte_bpe_tokenizer(*, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` in the style of GPT-2's and Qwen2's: the
    256 byte symbols and no merges (so one token per byte), plus the four specials and the
    chat markers.  Qwen2 models need this kind: ``AutoTokenizer`` rebuilds a Qwen2 model's
    tokenizer with Qwen2's byte-level pipeline, whatever the saved one was."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *CHAT_TOKENS, *byte_symbols))}
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return _wrap(core, chat_template)


def tiny_config(arch: str = "llama", *, vocab_size: int, hidden: int = 96, layers: int = 2,
                heads: int = 4, kv_heads: int | None = None, ffn: int = 256,
                max_positions: int = 64, bos_id: int = 1, eos_id: int = 2,
                pad_id: int = 0) -> Any:
    """A toy ``transformers`` config of ``arch`` (llama, qwen2 or gpt2), untied head."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    ids = dict(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
               tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                          n_inner=ffn, n_positions=max_positions, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads or heads, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, **ids)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")


def write_tiny_model(out: str | Path, arch: str = "llama", *, weights: bool = True,
                     seed: int = 0, tokenizer: Any = None, **shape: Any) -> Path:
    """Write a loadable model directory of ``arch`` at ``out`` (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = byte_bpe_tokenizer() if arch == "qwen2" else char_tokenizer()
    tok = tokenizer
    config = tiny_config(arch, vocab_size=len(tok), bos_id=tok.bos_token_id,
                         eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **shape)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    if weights:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(out)
    else:
        config.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--weights", action="store_true", help="also write random weights")
    args = parser.parse_args(argv)
    write_tiny_model(args.out, args.arch, weights=args.weights)
    print(args.out)


if __name__ == "__main__":
    main()
