"""The bytes each token id stands for: what a token mask is computed over.

A grammar constrains *text*, but the model picks *token ids*. A token is
allowed when the bytes it stands for can extend the text so far towards a
valid output; so every twin first needs, for each id the model can produce
(``vocab_size``, the logits' width, which may exceed ``len(tokenizer)``), its
bytes. Both twins read them from here, so they constrain the same vocabulary.

How a vocabulary entry's string becomes bytes depends on the tokenizer:

- **byte-level BPE** (GPT-2, SmolLM2, Llama 3, Qwen): every byte is spelled
  as one printable character (``Ġ`` is the space byte 0x20, ``Ċ`` is ``\\n``);
  the inverse of GPT-2's ``bytes_to_unicode`` table maps them back. A token
  may hold part of a multi-byte character (``Ã`` alone is the byte 0xC3).
- **SentencePiece with byte fallback** (Llama 2, Mistral): ``▁`` is a space,
  and ``<0xAB>`` is the single byte 0xAB.
- anything else: the entry's UTF-8.

**Special tokens** (``<|im_end|>``, ``<|endoftext|>``, ``<repo_name>``...)
stand for no text: their bytes are ``None`` and a grammar never allows them,
except the EOS ids, which are allowed exactly where the output may end. Ids
the tokenizer does not define (padding up to ``vocab_size``) are ``None`` too.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: byte -> the printable character that spells it in the vocabulary."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))  # fmt: skip
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # unprintable bytes go to code points 256, 257, ... in order
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = MappingProxyType({ch: b for b, ch in _bytes_to_unicode().items()})


@dataclass(frozen=True)
class TokenVocabulary:
    """What every token id means to a grammar.

    Attributes:
        token_bytes: ``vocab_size`` entries: the bytes of each id, or ``None``
            for a special or undefined id (never allowed as text).
        eos_token_ids: ids allowed exactly where the output may end.
        kind: ``"byte_level"``, ``"byte_fallback"`` or ``"raw"`` (how entries were read).
    """

    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    kind: str

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def check_ids(self, token_ids) -> list[int]:
        """``token_ids`` as a list of ints; ``ValueError`` naming it if one is not an id."""
        ids = list(token_ids)
        v = self.vocab_size
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < v
               for t in ids):
            raise ValueError(f"token_ids must be token ids in [0, {v}), got {ids!r}")
        return [int(t) for t in ids]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int,
                       eos_token_ids: int | list[int] | None = None) -> TokenVocabulary:
        """Read a Hugging Face tokenizer; ``vocab_size`` is the model's logits width.

        ``eos_token_ids`` default to ``tokenizer.eos_token_id``.
        """
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_id
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
        if not eos or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be token ids in [0, {vocab_size}), "
                             f"got {eos_token_ids!r}")
        kind = vocabulary_kind(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []))
        added = getattr(tokenizer, "added_tokens_decoder", {})
        special |= {i for i, tok in added.items() if getattr(tok, "special", False)}
        special |= set(eos)  # EOS is allowed by the end-of-output rule, never as text
        entries: list[bytes | None] = [None] * vocab_size
        for text, i in tokenizer.get_vocab().items():
            if i >= vocab_size or i in special:
                continue
            # An added (non-special) token is matched on its content, never re-spelled.
            data = text.encode() if i in added else decode_entry(text, kind)
            entries[i] = data or None  # an empty entry stands for no text: never allowed
        return cls(tuple(entries), tuple(dict.fromkeys(eos)), kind)


def vocabulary_kind(tokenizer: Any) -> str:
    """How the tokenizer spells bytes in its vocabulary (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "raw"
    config = json.loads(backend.to_str())
    decoders = [config.get("decoder") or {}]
    if decoders[0].get("type") == "Sequence":
        decoders = decoders[0].get("decoders", [])
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    return "raw"


def decode_entry(text: str, kind: str) -> bytes:
    """The bytes a vocabulary entry stands for under ``kind``."""
    if kind == "byte_level":
        try:
            return bytes(_BYTE_DECODER[ch] for ch in text)
        except KeyError:  # a character outside the byte alphabet: an added token's text
            return text.encode()
    if kind == "byte_fallback":
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode()
    return text.encode()
