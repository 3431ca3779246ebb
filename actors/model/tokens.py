"""The tokenizer a job uses: the model's own ``AutoTokenizer``, or the built-in characters.

Every tokenizer erlay drives offers the same small surface (:class:`Tokenizer`): ``encode``
(with optional BOS/EOS), ``decode``, the special ids, the stop ids and ``prompt_ids`` (the
prompt of an episode, through the chat template when the job is chat-formatted).

:class:`HFTokenizer` adapts a ``PreTrainedTokenizerBase``:

- text is encoded without the tokenizer's automatic specials; ``bos=True`` prepends the BOS
  token if the tokenizer has one (Qwen2's has none) and ``eos=True`` appends its EOS;
- with ``chat=True`` a prompt becomes ``[system] + user`` messages (or the episode's own
  ``messages``, which get the system prompt unless they carry their own), with the
  environment's tool schemas, through ``apply_chat_template`` with the generation prompt
  added;
- ``stop_ids`` are EOS plus the model's ``generation_config.eos_token_id`` (chat models end a
  turn with their own token, e.g. ``<|im_end|>``); stop strings (``engine.stop``) are matched
  on decoded text: :func:`stop_cut` says which token ends a turn, :func:`stop_at` where its
  text ends.

Contract: pure; loads tokenizer files from a local directory only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from erlay.actors.model.errors import ModelLoadError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False,
               strict: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def prompt_ids(self, prompt: str, messages: Sequence[dict[str, Any]] | None = None,
                   tools: Sequence[dict[str, Any]] | None = None) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer behind :class:`Tokenizer` (module docstring)."""

    def __init__(self, tok: Any, *, chat: bool = False, system_prompt: str | None = None,
                 extra_stop_ids: Sequence[int] = ()) -> None:
        if tok.eos_token_id is None:
            raise ModelLoadError("the tokenizer has no EOS token, so a completion could "
                                 "never stop; set eos_token in tokenizer_config.json")
        if chat and not getattr(tok, "chat_template", None):
            raise ModelLoadError("data.chat is true but the tokenizer has no chat template "
                                 "(tokenizer_config.json chat_template)")
        self.tok = tok
        self.chat = chat
        self.system_prompt = system_prompt
        self.vocab_size = len(tok)
        self.bos_id: int | None = tok.bos_token_id
        self.eos_id: int = int(tok.eos_token_id)
        self.pad_id: int = int(tok.pad_token_id if tok.pad_token_id is not None else self.eos_id)
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *map(int, extra_stop_ids)]))
        self._specials = frozenset(tok.all_special_ids)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False,
               strict: bool = False) -> list[int]:
        """Token ids of ``text``; ``strict`` raises ValueError if it holds an unknown token."""
        ids = list(self.tok.encode(text, add_special_tokens=False))
        if strict and self.tok.unk_token_id is not None and self.tok.unk_token_id in ids:
            raise ValueError(f"{text!r} has characters the tokenizer cannot encode")
        if bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(t) for t in ids if t not in self._specials])

    def prompt_ids(self, prompt: str, messages: Sequence[dict[str, Any]] | None = None,
                   tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """An episode's prompt as ids: plain text after BOS, or the chat template's rendering."""
        if not self.chat:
            return self.encode(prompt, bos=True)
        messages = list(messages) if messages else [{"role": "user", "content": prompt}]
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        out = self.tok.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                           add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):   # BatchEncoding in 5.x
            out = out["input_ids"]
        return [int(t) for t in out]


def stop_at(text: str, stop: Sequence[str]) -> int | None:
    """The index where the first stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def stop_cut(tok: Tokenizer, token_ids: Sequence[int], stop: Sequence[str]) -> int | None:
    """How many of ``token_ids`` a turn keeps when it meets a stop string: the length of the
    shortest prefix whose decoded text contains one (the token that completes it is kept),
    or None when the decoded text holds none.

    A function of the tokens alone, so a turn replayed from the journal, or continued from a
    journaled prefix that already holds the stop string, is cut at the same token.  It relies
    on decoding being prefix-monotone (the text of a prefix of the tokens is a prefix of the
    text, up to an incomplete character at its end), which holds for the WordLevel, BPE and
    SentencePiece decoders; that makes the shortest prefix a binary search: ``log2(n) + 1``
    decodes instead of ``n``.
    """
    stop = [s for s in stop if s]
    if not stop or not token_ids:
        return None
    ids = list(token_ids)

    def holds(n: int) -> bool:
        return stop_at(tok.decode(ids[:n]), stop) is not None

    if not holds(len(ids)):
        return None
    lo, hi = 0, len(ids)   # holds(hi); the empty prefix holds nothing
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi


def load_hf_tokenizer(path: str | Path, *, trust_remote_code: bool = False, chat: bool = False,
                      system_prompt: str | None = None) -> HFTokenizer:
    """The model directory's tokenizer, with its generation config's stop ids.  Raises
    :class:`ModelLoadError` (one line) when the directory has none or it is unusable."""
    from transformers import AutoTokenizer, GenerationConfig
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            local_files_only=True)
    except Exception as exc:   # noqa: BLE001 - any loader failure is "no usable tokenizer"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"model.hf: {path} has no usable tokenizer ({first[:200]})"
                             ) from None
    if isinstance(tok, bool) or not hasattr(tok, "encode"):
        raise ModelLoadError(f"model.hf: {path} has no tokenizer")
    extra: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        eos = gen.eos_token_id
        extra = [eos] if isinstance(eos, int) else list(eos or [])
    except Exception:   # noqa: BLE001 - generation_config.json is optional
        pass
    return HFTokenizer(tok, chat=chat, system_prompt=system_prompt, extra_stop_ids=extra)
