"""Tokenizers: a built-in character tokenizer for the tiny preset, HF `tokenizers` for real models.

Both expose the same small surface used everywhere else:
  encode(text) -> ids, decode(ids) -> text, vocab_size, and the special ids
  bos_id / eos_id / pad_id (declared in one place per tokenizer, never guessed elsewhere),
  plus prompt_ids(text): the ids a policy is conditioned on (chat template for instruct models).
"""
from __future__ import annotations

import string

# ---------------------------------------------------------------- character tokenizer

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")
CHAR_ALPHABET = string.digits + string.ascii_letters + " +-*/=().,:;?!'\"#\n_<>%$&[]{}^|~@\\`"


class CharTokenizer:
    """One id per character; specials first. Unknown characters map to '?' (never raise)."""

    def __init__(self, alphabet: str = CHAR_ALPHABET):
        self.specials = CHAR_SPECIALS
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.alphabet = alphabet
        self._to_id = {ch: i + len(CHAR_SPECIALS) for i, ch in enumerate(alphabet)}
        self._unk = self._to_id["?"]
        self.vocab_size = len(CHAR_SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(ch, self._unk) for ch in text]

    def decode(self, ids) -> str:
        n = len(CHAR_SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if n <= i < self.vocab_size)

    def prompt_ids(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)
