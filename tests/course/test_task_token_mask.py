"""Course task: the DFA walk that builds a token mask, called directly.

``token_mask(dfa, state, vocab)`` must allow exactly the tokens whose bytes
keep the text a *prefix* of some valid output, EOS exactly when the text is a
*full* output, and special tokens never. For a finite language (a list of
choices) the oracle needs no automaton at all: a token is allowed after text
``p`` when some choice starts with ``p + token``. The vocabularies are byte
strings cut from the choices (so many tokens are allowed, some only by their
first bytes), partial UTF-8 characters, junk, and special ids.
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import examples

from minivllm import backend
from minivllm.structured_output.automata import compile_dfa
from minivllm.structured_output.constraint import choice_regex
from minivllm.structured_output.regex import parse_regex
from minivllm.structured_output.vocab import TokenVocabulary


def prefix_oracle(words: list[bytes], prefix: bytes, vocab: TokenVocabulary) -> torch.Tensor:
    """Allowed ids after ``prefix``, from the definition (no automaton)."""
    allowed = torch.zeros(vocab.vocab_size, dtype=torch.bool)
    for i, data in enumerate(vocab.token_bytes):
        if data is not None and any(w.startswith(prefix + data) for w in words):
            allowed[i] = True
    if prefix in words:
        allowed[list(vocab.eos_token_ids)] = True
    return allowed


def make_vocab(words: list[bytes], rng: random.Random) -> TokenVocabulary:
    pieces = {w[i:j] for w in words for i in range(len(w)) for j in range(i + 1, len(w) + 1)}
    pieces |= {bytes([b]) for b in range(256) if rng.random() < 0.2}  # junk single bytes
    pieces |= {w + b"!" for w in words[:2]}  # a whole word and then one byte too many
    entries: list[bytes | None] = sorted(pieces)
    rng.shuffle(entries)
    for _ in range(3):  # special ids scattered among the rest
        entries.insert(rng.randrange(len(entries) + 1), None)
    eos = rng.randrange(len(entries) + 1)
    entries.insert(eos, None)
    return TokenVocabulary(tuple(entries), (eos,), "raw")


@settings(max_examples=examples(30), deadline=None)
@given(choices=st.lists(st.text(alphabet="abc é中😀", min_size=0, max_size=5), min_size=1,
                        max_size=4, unique=True),
       seed=st.integers(0, 2**16))
def test_token_mask_is_the_prefix_rule(choices, seed):
    token_mask = backend.get("structured_output").token_mask
    rng = random.Random(seed)
    words = [c.encode() for c in choices]
    vocab = make_vocab(words, rng)
    dfa = compile_dfa(parse_regex(choice_regex(choices)))
    word = rng.choice(words)
    for cut in range(len(word) + 1):  # every prefix of one word, byte by byte
        prefix = word[:cut]
        state = dfa.walk(0, prefix)
        got = token_mask(dfa, state, vocab)
        assert got.dtype == torch.bool and got.shape == (vocab.vocab_size,)
        want = prefix_oracle(words, prefix, vocab)
        extra = [vocab.token_bytes[i] for i in (got & ~want).nonzero().flatten().tolist()]
        missing = [vocab.token_bytes[i] for i in (want & ~got).nonzero().flatten().tolist()]
        assert not extra and not missing, (
            f"choices {choices}, after {prefix!r}: wrongly allowed {extra}, wrongly refused "
            f"{missing} (None is EOS or a special token)")


def test_token_mask_small_example():
    """``ab|ac|é`` over a hand-written vocabulary, state by state."""
    token_mask = backend.get("structured_output").token_mask
    entries = [b"a", b"ab", b"abc", b"b", b"c", b"\xc3", b"\xc3\xa9", b"\xa9", None, b"x", None]
    vocab = TokenVocabulary(tuple(entries), (10,), "raw")
    dfa = compile_dfa(parse_regex("ab|ac|é"))

    def names(mask):
        return sorted("EOS" if i == 10 else entries[i] for i in mask.nonzero().flatten().tolist())

    start = token_mask(dfa, 0, vocab)
    assert names(start) == sorted([b"a", b"ab", b"\xc3", b"\xc3\xa9"]), (
        "at the start: 'abc' dies at 'c', 'b' and the lone continuation byte cannot start")
    assert names(token_mask(dfa, dfa.walk(0, b"a"), vocab)) == [b"b", b"c"]
    assert names(token_mask(dfa, dfa.walk(0, b"\xc3"), vocab)) == [b"\xa9"], (
        "half a character: only its second byte may follow")
    assert names(token_mask(dfa, dfa.walk(0, b"ab"), vocab)) == ["EOS"], (
        "a full match with nothing after it: only EOS")
