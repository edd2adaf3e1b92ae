"""Structured outputs, reference twin: a regex DFA, and each token walked through it.

vLLM constrains a request's output (a JSON schema, a regex, a choice, a
grammar) by masking logits: every step, each constrained request fills one
row of a *token bitmask* with the tokens its constraint allows next, and the
sampler sees ``-inf`` for all the others. This twin does it the textbook way:

1. **Compile** (once per constraint, cached): the constraint becomes a regex
   (a ``choice`` is the alternation of its strings, a JSON schema is written
   out as a regex by :mod:`minivllm.structured_output.json_schema`), the
   regex a byte-level NFA and then a DFA
   (:mod:`minivllm.structured_output.automata`).
2. **Mask** (once per DFA state, cached): a token is allowed in state ``s``
   when walking its bytes from ``s`` never falls into the dead state
   (:func:`token_mask`). That is the whole difficulty of constrained decoding:
   the constraint is on *characters*, the choice is among *tokens*, and a
   token is a run of bytes that may cross several parts of the pattern
   (``", "``) or stop in the middle of a UTF-8 character. EOS is allowed
   exactly in accepting states; other special tokens never.
3. **Advance**: after sampling, each token's bytes move the request's state
   (:meth:`Grammar.accept_tokens`); a stack of past states makes rollback of
   rejected speculative tokens a pop.

The mask of a state is computed once and shared by every request with that
constraint, but the first visit walks all ``V`` tokens in Python (tens of ms
for a 49k vocabulary); the fast twin (xgrammar) precompiles per-state token
classes in C++ and also serves context-free grammars, which this twin refuses.

**Component kind: "host".** Everything here is per-request state on the CPU
(vLLM too fills the bitmask on the host, then copies it to the device); only
:func:`apply_token_bitmask_inplace` touches device tensors. So ``auto`` serves
the fast twin wherever xgrammar imports, independent of the C++ kernel build.

The engine's calls, per request and per step, are listed in
``docs/structured_outputs.md``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.automata import DEAD, DFA, CompileTimeout, compile_dfa
from minivllm.structured_output.bitmask import bitmask_width, check_apply_args, pack_bitmask
from minivllm.structured_output.constraint import (
    CompileCache,
    check_backend_options,
    choice_regex,
    constraint_key,
)
from minivllm.structured_output.json_schema import (
    JsonLayout,
    json_object_regex,
    schema_to_regex,
)
from minivllm.structured_output.regex import parse_regex
from minivllm.structured_output.vocab import TokenVocabulary

__all__ = ["Grammar", "StructuredOutputBackend", "allocate_token_bitmask",
           "apply_token_bitmask_inplace", "token_mask"]

#: A state's history entry once EOS was accepted: nothing may follow.
TERMINATED = -2
#: A request's state: the DFA state after each accepted token, the start state first.
_GrammarState = list

#: The most DFA states one constraint may need (beyond: ``ValueError``, use the fast twin).
MAX_DFA_STATES = 50_000


def token_mask(dfa: DFA, state: int, vocab: TokenVocabulary) -> torch.Tensor:  # -> (V,) bool
    """Which token ids may come next when the text so far left ``dfa`` in ``state``.

    A token is allowed when its bytes, read one by one from ``state``, never
    lead to :data:`~minivllm.structured_output.automata.DEAD`: the text with
    the token is still the prefix of some match (it need not be a match). A
    special or undefined token (bytes ``None``) is never allowed; the EOS ids
    are allowed exactly when ``state`` is accepting (the text is a full match).
    """
    # BEGIN SOLUTION
    allowed_ids = []
    for token_id, data in enumerate(vocab.token_bytes):
        if data is None:
            continue  # special or undefined: never allowed as text
        s = state
        for byte in data:
            s = dfa.transitions[s][byte]
            if s == DEAD:
                break
        else:  # every byte kept the walk alive
            allowed_ids.append(token_id)
    if dfa.accepting[state]:
        allowed_ids.extend(vocab.eos_token_ids)
    mask = torch.zeros(vocab.vocab_size, dtype=torch.bool)
    mask[allowed_ids] = True
    return mask
    # END SOLUTION


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A ``(batch_size, ceil(vocab_size / 32))`` int32 bitmask, every token allowed (-1)."""
    for name, v in (("batch_size", batch_size), ("vocab_size", vocab_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                indices=None) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit ``t`` of ``bitmask[r]`` is 0, for rows
    ``r`` in ``indices`` (``None``: every row); other rows are not touched.

    ``logits`` (B, V) float; ``bitmask`` (B, ceil(V / 32)) int32 on the same device.
    """
    rows = check_apply_args(logits, bitmask, indices)  # (R,)
    v = logits.shape[1]
    t = torch.arange(v, device=logits.device)  # (V,)
    words = bitmask[rows][:, t // 32]  # (R, V): the word holding each token's bit
    allowed = ((words >> (t % 32)) & 1).bool()  # (R, V)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class _CompiledConstraint:
    """A constraint's DFA and the masks of the states visited so far (shared by requests)."""

    def __init__(self, dfa: DFA, vocab: TokenVocabulary) -> None:
        self.dfa = dfa
        self.vocab = vocab
        self._rows: dict[int, tuple[torch.Tensor, bool]] = {}
        self._eos = torch.tensor(vocab.eos_token_ids)

    def state_mask(self, state: int) -> tuple[torch.Tensor, bool]:
        """``(packed row (W,) int32, may text follow?)`` for ``state``, cached."""
        if state not in self._rows:
            allowed = token_mask(self.dfa, state, self.vocab)  # (V,) bool
            text_allowed = allowed.clone()
            text_allowed[self._eos] = False
            self._rows[state] = (pack_bitmask(allowed), bool(text_allowed.any()))
        return self._rows[state]

    def step(self, state: int, token_id: int) -> int:
        """The state after ``token_id`` (:data:`DEAD` if not allowed)."""
        if state == TERMINATED:
            return DEAD
        if token_id in self.vocab.eos_token_ids:
            return TERMINATED if self.dfa.accepting[state] else DEAD
        data = self.vocab.token_bytes[token_id]
        return DEAD if data is None else self.dfa.walk(state, data)


class Grammar:
    """One request's position in its constraint; made by :meth:`StructuredOutputBackend.compile`.

    The state is the DFA state after the tokens accepted so far, with the
    earlier states kept on a stack for :meth:`rollback`.
    """

    def __init__(self, compiled: _CompiledConstraint, state: _GrammarState | None = None) -> None:
        self._compiled = compiled
        self._states: _GrammarState = [0] if state is None else state

    @property
    def num_accepted_tokens(self) -> int:
        """Tokens accepted so far (minus those rolled back)."""
        return len(self._states) - 1

    def accept_tokens(self, token_ids) -> bool:
        """Advance by ``token_ids``; False (state unchanged) if one of them is not allowed."""
        states, s = [], self._states[-1]
        for t in self._compiled.vocab.check_ids(token_ids):
            s = self._compiled.step(s, t)
            if s == DEAD:
                return False
            states.append(s)
        self._states.extend(states)
        return True

    def validate_tokens(self, token_ids) -> int:
        """How many of ``token_ids``, from the first, would be accepted (no state change)."""
        s, ids = self._states[-1], self._compiled.vocab.check_ids(token_ids)
        for n, t in enumerate(ids):
            s = self._compiled.step(s, t)
            if s == DEAD:
                return n
        return len(ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative tokens rejected)."""
        if (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)
                or not 0 <= num_tokens <= self.num_accepted_tokens):
            raise ValueError(f"num_tokens must be in [0, {self.num_accepted_tokens}] (the tokens "
                             f"accepted so far), got {num_tokens!r}")
        del self._states[len(self._states) - num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ((B, ceil(V / 32)) int32).

        A terminated grammar constrains nothing more: its row allows every token
        (as vLLM fills it); the engine finishes such a request instead.
        """
        s = self._states[-1]
        if s == TERMINATED:
            bitmask[row].fill_(-1)
        else:
            bitmask[row].copy_(self._compiled.state_mask(s)[0])

    def is_terminated(self) -> bool:
        """True once EOS was accepted, or when the text is a full match and no token but
        EOS may follow: the request should finish (finish_reason ``"stop"``)."""
        s = self._states[-1]
        if s == TERMINATED:
            return True
        return self._compiled.dfa.accepting[s] and not self._compiled.state_mask(s)[1]

    def fork(self) -> Grammar:
        """An independent copy at the same state (for ``n > 1`` and beam search)."""
        return Grammar(self._compiled, list(self._states))


class StructuredOutputBackend:
    """Compiles constraints into :class:`Grammar` objects; one per engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``).
        eos_token_ids: ids allowed where the output may end (default: the
            tokenizer's ``eos_token_id``).
        cache_size: compiled constraints kept (least recently used dropped first).
        compile_timeout_s: refuse a constraint whose compilation takes longer
            (``None``: no limit).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 eos_token_ids: int | list[int] | None = None, cache_size: int = 64,
                 compile_timeout_s: float | None = None) -> None:
        check_backend_options(cache_size, compile_timeout_s)
        self.vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._cache = CompileCache(cache_size)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A new :class:`Grammar` for ``params``, at the start of the output.

        This is the request's validation: call it before the request is queued.
        ``ValueError`` naming the field (``json``, ``regex``, ``choice``,
        ``grammar``, ``json_object``) if the constraint does not compile.
        """
        key = constraint_key(params)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(*key)
            self._cache.put(key, compiled)
        return Grammar(compiled)

    def _compile(self, kind: str, text: str, layout: JsonLayout) -> _CompiledConstraint:
        """``kind``, ``text`` and ``layout`` as :func:`constraint_key` spells them."""
        deadline = (None if self.compile_timeout_s is None
                    else time.monotonic() + self.compile_timeout_s)
        try:
            if kind == "grammar":
                raise ValueError("the ref twin does not compile grammars (a context-free "
                                 "language needs a stack, not a DFA); the fast twin "
                                 "(xgrammar) serves them: use backend 'fast'")
            pattern = {"json": lambda: schema_to_regex(json.loads(text), layout),
                       "regex": lambda: text,
                       "choice": lambda: choice_regex(json.loads(text)),
                       "json_object": lambda: json_object_regex(layout=layout)}[kind]()
            dfa = compile_dfa(parse_regex(pattern), MAX_DFA_STATES, deadline)
        except CompileTimeout:
            raise ValueError(f"{kind}: compiling took longer than compile_timeout_s="
                             f"{self.compile_timeout_s}") from None
        except ValueError as e:
            raise ValueError(f"{kind}: {e}") from None
        return _CompiledConstraint(dfa, self.vocab)
