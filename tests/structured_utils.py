"""Helpers for the structured-output tests: a small real tokenizer, guided walks, oracles.

- :func:`synthetic_tokenizer`: a byte-level BPE trained on JSON and mixed-script
  text (a few hundred tokens, merges such as ``", "`` and partial UTF-8), with
  special tokens: a real Hugging Face tokenizer on which the ref's per-state
  walk of the vocabulary takes a millisecond, so hypothesis can try many cases.
- :func:`walk`: drive the implementation under test and the oracle twin with
  the same tokens, comparing their masks at every step. Tokens are chosen at
  random among the allowed ones, more and more often the one that brings the
  text closest to a full match (measured on a guide DFA), so walks end.
- :func:`python_regex`: a regex tree as a Python ``re`` pattern with explicit
  code-point ranges: an independent check that sampled text matches.
"""

from __future__ import annotations

import functools
import json
import random
import re

import torch

from minivllm.structured_output.automata import DEAD, DFA
from minivllm.structured_output.bitmask import unpack_bitmask
from minivllm.structured_output.regex import Alt, CharSet, Concat, Repeat

_CORPUS_WORDS = ["name", "age", "value", "true", "false", "null", "héllo", "straße", "中文",
                 "😀", "price", "items", "0.5", "-12", "1e3", "\\n", "\\u00e9", "a-z", "[1, 2]"]


@functools.cache
def synthetic_tokenizer(vocab_size: int = 700):
    """A byte-level BPE tokenizer trained on JSON-like text, with ``<eos>`` and two other
    special tokens (``<pad>``, ``<|tool|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = []
    for _ in range(400):
        words = rng.sample(_CORPUS_WORDS, 4)
        corpus.append(json.dumps({words[0]: words[1], words[2]: [words[3], rng.randint(0, 99)]},
                                 ensure_ascii=False))
        corpus.append(" ".join(words))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<eos>", "<pad>", "<|tool|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def distances(dfa: DFA) -> list[float]:
    """Fewest bytes from each state to an accepting one (BFS on reversed edges)."""
    incoming: list[set[int]] = [set() for _ in range(dfa.num_states)]
    for s, row in enumerate(dfa.transitions):
        for t in row:
            if t != DEAD:
                incoming[t].add(s)
    dist = [float("inf")] * dfa.num_states
    frontier = [s for s in range(dfa.num_states) if dfa.accepting[s]]
    for s in frontier:
        dist[s] = 0
    while frontier:
        nxt = []
        for t in frontier:
            for s in incoming[t]:
                if dist[s] == float("inf"):
                    dist[s] = dist[t] + 1
                    nxt.append(s)
        frontier = nxt
    return dist


def mask_of(grammar, vocab_size: int, row: int = 1, rows: int = 3) -> torch.Tensor:  # (V,) bool
    """``grammar.fill_bitmask`` into row ``row`` of a fresh (``rows``, W) bitmask, unpacked.

    The other rows are filled with a pattern first and must come back unchanged.
    """
    bitmask = torch.full((rows, (vocab_size + 31) // 32), 0x5A5A5A5A, dtype=torch.int32)
    before = bitmask.clone()
    grammar.fill_bitmask(bitmask, row)
    others = [r for r in range(rows) if r != row]
    assert torch.equal(bitmask[others], before[others]), "fill_bitmask wrote another row"
    return unpack_bitmask(bitmask[row], vocab_size)


def describe_diff(a: torch.Tensor, b: torch.Tensor, token_bytes, text: bytes) -> str:
    only_a = torch.nonzero(a & ~b).flatten().tolist()[:8]
    only_b = torch.nonzero(b & ~a).flatten().tolist()[:8]
    show = lambda ids: [(i, token_bytes[i]) for i in ids]  # noqa: E731
    return (f"after {text!r}: only the implementation allows {show(only_a)}; "
            f"only the oracle allows {show(only_b)}")


def walk(params, impl_backend, oracle_backend, guide: DFA | None, seed: int,
         max_steps: int = 40, compare: bool = True) -> tuple[bytes, bool, list[int]]:
    """Generate under ``params`` with both backends; return (text, terminated, token ids).

    At every step: the same ``is_terminated``, and (``compare``) the same mask.
    Tokens come from the implementation's mask; EOS is written ``b""`` in the text.
    """
    rng = random.Random(seed)
    impl, oracle = impl_backend.compile(params), oracle_backend.compile(params)
    vocab = impl_backend.vocab
    v = vocab.vocab_size
    dist = distances(guide) if guide is not None else None
    state, text, ids = 0, b"", []
    for step in range(max_steps):
        done = impl.is_terminated()
        assert done == oracle.is_terminated(), f"is_terminated differs after {text!r}"
        if done:
            return text, True, ids
        allowed = mask_of(impl, v)
        if compare:
            expected = mask_of(oracle, v, row=0, rows=2)
            assert torch.equal(allowed, expected), describe_diff(allowed, expected,
                                                                 vocab.token_bytes, text)
        candidates = torch.nonzero(allowed).flatten().tolist()
        assert candidates, f"no token allowed after {text!r}"
        token = choose(candidates, vocab, guide, dist, state, rng, greed=step / max_steps)
        assert impl.accept_tokens([token]) and oracle.accept_tokens([token])
        ids.append(token)
        data = vocab.token_bytes[token] or b""
        text += data
        if guide is not None and state != DEAD:
            state = guide.walk(state, data) if token not in vocab.eos_token_ids else state
    return text, impl.is_terminated(), ids


def choose(candidates, vocab, guide, dist, state, rng, greed: float) -> int:
    """A random allowed token; with probability ``0.2 + greed``, EOS if allowed, else the
    one of a random sample that leaves the guide DFA closest to an accepting state."""
    eos = [t for t in candidates if t in vocab.eos_token_ids]
    if eos and rng.random() < 0.2 + greed:
        return rng.choice(eos)
    sample = rng.sample(candidates, min(24, len(candidates)))
    if guide is None or state == DEAD or rng.random() > 0.2 + greed:
        return rng.choice(sample)

    def score(t):
        data = vocab.token_bytes[t]
        if data is None:
            return 0
        s = guide.walk(state, data)
        return float("inf") if s == DEAD else dist[s]

    return min(sample, key=score)


def python_regex(node) -> str:
    """A regex tree as a Python pattern (explicit code-point ranges, no shorthand)."""
    if isinstance(node, CharSet):
        return "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in node.ranges) + "]"
    if isinstance(node, Concat):
        return "(?:" + "".join(python_regex(p) for p in node.parts) + ")"
    if isinstance(node, Alt):
        return "(?:" + "|".join(python_regex(o) for o in node.options) + ")"
    if isinstance(node, Repeat):
        hi = "" if node.max is None else node.max
        return f"(?:{python_regex(node.node)}){{{node.min},{hi}}}"
    raise TypeError(node)


def fullmatch(node, text: bytes) -> bool:
    """True if ``text`` (UTF-8, lone surrogates allowed) is a full match of the tree."""
    return re.fullmatch(python_regex(node), text.decode("utf-8", "surrogatepass"),
                        re.DOTALL) is not None


def max_depth(text: bytes) -> int:
    """The deepest bracket nesting of a JSON text (or prefix), strings skipped."""
    depth = deepest = 0
    in_string = escaped = False
    for b in text:
        c = chr(b)
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def whitespace_is_canonical(text: str) -> bool:
    """True if, outside strings, the only white space is one space after each ``,`` and ``:``."""
    in_string = escaped = False
    prev = ""
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string, prev = False, c
            continue
        if prev in (",", ":") and c != " ":
            return False
        if c.isspace() and not (c == " " and prev in (",", ":")):
            return False
        in_string = c == '"'
        prev = c
    return True


def whitespace_outside_strings(text: str) -> str:
    """The white-space characters of a JSON text that lie outside its strings."""
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c.isspace():
            out.append(c)
    return "".join(out)
