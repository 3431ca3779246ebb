"""The character tokenizer: one token per character, four specials, no surprises."""

from __future__ import annotations

import pytest

from erlay.actors.model.tokenizer import ALPHABET, BOS, EOS, PAD, UNK, CharTokenizer


def test_round_trip_of_every_alphabet_character() -> None:
    tok = CharTokenizer()
    assert tok.decode(tok.encode(ALPHABET)) == ALPHABET
    assert len(tok.encode(ALPHABET)) == len(ALPHABET)


def test_specials_are_added_on_request_and_dropped_on_decode() -> None:
    tok = CharTokenizer()
    ids = tok.encode("47+85=", bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and len(ids) == 8
    assert tok.decode([PAD, *ids, PAD]) == "47+85="


def test_unknown_characters_map_to_unk_or_raise_when_strict() -> None:
    tok = CharTokenizer()
    assert tok.encode("a\u00e9b") == [tok.encode("a")[0], UNK, tok.encode("b")[0]]
    with pytest.raises(ValueError, match="'\u00e9' is not in the tokenizer's alphabet"):
        tok.encode("a\u00e9b", strict=True)


def test_vocab_size_counts_specials_and_ids_stay_inside_it() -> None:
    tok = CharTokenizer("0123456789+=")
    assert tok.vocab_size == 4 + 12
    assert max(tok.encode("0123456789+=")) == tok.vocab_size - 1
    assert tok.decode([tok.vocab_size + 5]) == "\ufffd"


def test_repeated_alphabet_characters_are_rejected() -> None:
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aab")
