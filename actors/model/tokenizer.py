"""A character-level tokenizer for erlay's built-in tasks.

Every printable ASCII character is one token, plus four specials.  Unknown characters map to
``UNK`` rather than raising, because the tokenizer also reads model output and tool output,
which may contain anything; ``encode(strict=True)`` raises instead, for prompts that must be
exact.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from typing import Any

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


class CharTokenizer:
    """Maps characters of ``alphabet`` to ids after the four special tokens."""

    pad_id, bos_id, eos_id, unk_id = PAD, BOS, EOS, UNK
    stop_ids = (EOS,)

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False,
               strict: bool = False) -> list[int]:
        """Token ids for ``text``; with ``strict`` an unknown character raises ValueError."""
        ids = [BOS] if bos else []
        for ch in text:
            tid = self._ids.get(ch)
            if tid is None:
                if strict:
                    raise ValueError(f"character {ch!r} is not in the tokenizer's alphabet")
                tid = UNK
            ids.append(tid)
        if eos:
            ids.append(EOS)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``; specials are dropped, unknown ids become U+FFFD."""
        out = []
        for tid in ids:
            if tid < len(SPECIALS):
                continue
            idx = tid - len(SPECIALS)
            out.append(self.alphabet[idx] if idx < len(self.alphabet) else "\ufffd")
        return "".join(out)

    def prompt_ids(self, prompt: str, messages: Any = None, tools: Any = None) -> list[int]:
        """An episode's prompt: BOS, then its characters (no chat template here)."""
        return self.encode(prompt, bos=True)
