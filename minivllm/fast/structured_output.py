"""Structured outputs, fast twin: xgrammar's masks, applied by a C++ op or a Triton kernel.

Read ``minivllm/ref/structured_output.py`` first: the same API, the same
tokens allowed at every step (the tests compare the masks bit for bit on
everything the ref compiles). What changes:

- **The masks come from xgrammar** (vLLM's default structured-output engine),
  not from walking all ``V`` tokens through a DFA in Python. xgrammar parses
  with a pushdown automaton (so it serves context-free grammars and recursive
  JSON schemas, which the ref refuses) and, when it compiles a constraint,
  sorts each parser position's tokens into those always allowed, always
  refused and the few that depend on the stack (its "adaptive token mask
  cache"), so filling a row costs tens of microseconds instead of a walk of
  every token. Both twins read the vocabulary from
  :class:`~minivllm.structured_output.vocab.TokenVocabulary`: xgrammar gets
  the token bytes as a raw vocabulary, special tokens empty (never allowed),
  EOS ids as its stop tokens.
- **Why xgrammar, not llguidance** (both are installed; ``python -m
  minivllm.bench structured --engines`` times both on the same constraints and
  answers with SmolLM2's tokenizer, one thread). On the development machine:
  a step (fill the mask, accept the token) took 0.03-0.05 ms with xgrammar
  against 0.3-0.4 ms with llguidance (a choice: 0.18 against 4 ms), with p99s
  of 0.4 against 5-9 ms; setting up the tokenizer took 0.6 s against 1.7 s.
  llguidance compiled 5-25 times faster (1-8 ms against 5-60 ms), but a
  constraint is compiled once and cached, and the mask is paid every token.
  And xgrammar's mask is exactly "every token whose bytes extend a prefix of
  the language", which the ref reproduces; llguidance refuses some such tokens
  when the rest of a lexeme is forced (it steers towards the canonical
  tokenization), so no DFA walk could be proven equal to it.
- **The JSON form is xgrammar's** ``any_whitespace=False`` (separators ``", "``
  and ``": "``), the ref's whitespace rule; ``json_object`` is the schema
  ``{"type": "object"}``, as vLLM compiles it (any depth here).
- **The bitmask is applied by a kernel**: ``torch.ops.minivllm.apply_token_bitmask``
  (``csrc/token_bitmask.cpp``) on a CPU, which skips words of 32 allowed tokens
  and touches only the listed rows; :func:`_apply_token_bitmask_kernel` in Triton
  on CUDA, one program per (row, block of tokens), reading one int32 word per
  32 logits. The ref unpacks every bit into a (rows, V) bool tensor first.

**Component kind: "host"** (as the ref): compiling and filling masks is
per-request work on the CPU, in xgrammar's own C++, so it does not depend on
minivllm's C++ build; if that build failed, the bitmask is applied by the
ref's torch code instead.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.fast import cpu_ops
from minivllm.ref import structured_output as _ref
from minivllm.ref.structured_output import allocate_token_bitmask, token_mask
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.bitmask import check_apply_args, pack_bitmask
from minivllm.structured_output.constraint import (
    CompileCache,
    check_backend_options,
    choice_regex,
    constraint_key,
)
from minivllm.structured_output.json_schema import JsonLayout, schema_to_regex
from minivllm.structured_output.vocab import TokenVocabulary

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton wheels off Linux: the C++ CPU path still works
    from minivllm.fast._no_triton import tl, triton

__all__ = ["Grammar", "StructuredOutputBackend", "allocate_token_bitmask",
           "apply_token_bitmask_inplace", "token_mask"]


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency
        raise RuntimeError("the fast structured_output twin needs xgrammar "
                           "(pip install xgrammar); backend 'ref' works without it") from e
    return xgrammar


# ------------------------------------------------------------------ applying the bitmask


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                indices=None) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit ``t`` of ``bitmask[r]`` is 0, for rows
    ``r`` in ``indices`` (``None``: every row); other rows are not touched.

    ``logits`` (B, V) float; ``bitmask`` (B, ceil(V / 32)) int32 on the same device.
    """
    if logits.device.type == "cpu":
        if cpu_ops.available():
            apply_token_bitmask_inplace_cpu(logits, bitmask, indices)
        else:
            _ref.apply_token_bitmask_inplace(logits, bitmask, indices)
    else:
        apply_token_bitmask_inplace_triton(logits, bitmask, indices)


def _rows(logits: torch.Tensor, bitmask: torch.Tensor, indices) -> torch.Tensor:
    """The distinct rows to mask (a row listed twice would be written by two threads)."""
    rows = check_apply_args(logits, bitmask, indices)
    return rows if indices is None else torch.unique(rows)


def apply_token_bitmask_inplace_cpu(logits: torch.Tensor, bitmask: torch.Tensor,
                                    indices=None) -> None:
    """:func:`apply_token_bitmask_inplace` by the C++ op ``apply_token_bitmask``."""
    rows = _rows(logits, bitmask, indices)
    if rows.numel():
        target = logits if logits.stride(1) == 1 else logits.contiguous()
        cpu_ops.ops().apply_token_bitmask(target, bitmask.contiguous(), rows.contiguous())
        if target is not logits:
            logits.copy_(target)


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # (B, V), rows stride_row apart, unit column stride
    bitmask_ptr,  # (B, W) int32, contiguous: W = ceil(V / 32)
    rows_ptr,  # (R,) int64: the rows to mask
    vocab_size,  # V
    stride_row,  # logits' row stride, in elements
    words_per_row,  # W
    BLOCK: tl.constexpr,  # tokens per program
):
    row = tl.load(rows_ptr + tl.program_id(0))
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tok < vocab_size
    # One int32 load serves 32 neighbouring tokens (the loads of a warp coalesce).
    words = tl.load(bitmask_ptr + row * words_per_row + tok // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tok % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + tok, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask_inplace_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                                       indices=None) -> None:
    """:func:`apply_token_bitmask_inplace` by the Triton kernel (CUDA, or the interpreter)."""
    rows = _rows(logits, bitmask, indices)
    if not rows.numel():
        return
    target = logits if logits.stride(1) == 1 else logits.contiguous()
    vocab = logits.shape[1]
    block = min(4096, triton.next_power_of_2(vocab))
    grid = (rows.numel(), triton.cdiv(vocab, block))
    _apply_token_bitmask_kernel[grid](target, bitmask.contiguous(), rows.contiguous(), vocab,
                                      target.stride(0), bitmask.shape[1], BLOCK=block,
                                      num_warps=4)
    if target is not logits:
        logits.copy_(target)


# ------------------------------------------------------------------ grammars


@dataclass
class _CompiledConstraint:
    """xgrammar's compiled grammar and what a :class:`Grammar` needs from the backend."""

    grammar: Any  # xgrammar.CompiledGrammar
    vocab: TokenVocabulary
    text_bits: torch.Tensor  # (W,) int32: every id but EOS, special and padding ones


@dataclass
class _GrammarState:
    """One request's xgrammar matcher and how many tokens it has accepted."""

    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0


class Grammar:
    """One request's position in its constraint (an xgrammar ``GrammarMatcher``).

    The same contract as the ref's :class:`~minivllm.ref.structured_output.Grammar`.
    The mask of the current state is kept once computed (by :meth:`is_terminated`,
    which needs it), so the following :meth:`fill_bitmask` only copies it.
    """

    def __init__(self, compiled: _CompiledConstraint, state: _GrammarState | None = None) -> None:
        self._compiled = compiled
        self._state = state if state is not None else _GrammarState(
            _xgrammar().GrammarMatcher(compiled.grammar))
        self._row: torch.Tensor | None = None  # (1, W) int32: the current state's mask

    @property
    def num_accepted_tokens(self) -> int:
        """Tokens accepted so far (minus those rolled back)."""
        return self._state.num_accepted

    def _accept(self, token_id: int) -> bool:
        vocab, matcher = self._compiled.vocab, self._state.matcher
        # Refuse here what xgrammar would refuse with a warning on stderr.
        if matcher.is_terminated() or (vocab.token_bytes[token_id] is None
                                       and token_id not in vocab.eos_token_ids):
            return False
        return matcher.accept_token(token_id)

    def accept_tokens(self, token_ids) -> bool:
        """Advance by ``token_ids``; False (state unchanged) if one of them is not allowed."""
        ids = self._compiled.vocab.check_ids(token_ids)
        for n, t in enumerate(ids):
            if not self._accept(t):
                if n:
                    self._state.matcher.rollback(n)
                return False
        if ids:
            self._state.num_accepted += len(ids)
            self._row = None
        return True

    def validate_tokens(self, token_ids) -> int:
        """How many of ``token_ids``, from the first, would be accepted (no state change)."""
        ids = self._compiled.vocab.check_ids(token_ids)
        n = 0
        while n < len(ids) and self._accept(ids[n]):
            n += 1
        if n:
            self._state.matcher.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative tokens rejected)."""
        if (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)
                or not 0 <= num_tokens <= self.num_accepted_tokens):
            raise ValueError(f"num_tokens must be in [0, {self.num_accepted_tokens}] (the tokens "
                             f"accepted so far), got {num_tokens!r}")
        if num_tokens:
            self._state.matcher.rollback(num_tokens)
            self._state.num_accepted -= num_tokens
            self._row = None

    def _mask_row(self) -> torch.Tensor:  # (1, W) int32
        if self._row is None:
            self._row = allocate_token_bitmask(1, self._compiled.vocab.vocab_size)
            self._state.matcher.fill_next_token_bitmask(self._row)
        return self._row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` ((B, ceil(V / 32)) int32).

        A terminated grammar constrains nothing more: its row allows every token
        (as vLLM fills it); the engine finishes such a request instead.
        """
        if self._state.matcher.is_terminated():
            bitmask[row].fill_(-1)
        elif self._row is not None:
            bitmask[row].copy_(self._row[0])
        else:
            self._state.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once EOS was accepted, or when the text is a full match and no token but
        EOS may follow: the request should finish (finish_reason ``"stop"``)."""
        matcher = self._state.matcher
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        return not bool((self._mask_row()[0] & self._compiled.text_bits).any())

    def fork(self) -> Grammar:
        """An independent copy at the same state (for ``n > 1`` and beam search)."""
        return Grammar(self._compiled,
                       _GrammarState(self._state.matcher.fork(), self._state.num_accepted))


#: xgrammar's error messages start with "[time] file.cc:line: "; the reader wants the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class StructuredOutputBackend:
    """Compiles constraints into :class:`Grammar` objects with xgrammar; one per engine.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``).
        eos_token_ids: ids allowed where the output may end (default: the
            tokenizer's ``eos_token_id``).
        cache_size: compiled constraints kept (least recently used dropped first).
        compile_timeout_s: refuse a constraint whose compilation takes longer
            (``None``: no limit). xgrammar's C++ cannot be interrupted: the
            compilation goes on in a worker thread, but the request is refused.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 eos_token_ids: int | list[int] | None = None, cache_size: int = 64,
                 compile_timeout_s: float | None = None) -> None:
        check_backend_options(cache_size, compile_timeout_s)
        xgr = _xgrammar()
        self.vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        info = xgr.TokenizerInfo([b or b"" for b in self.vocab.token_bytes], xgr.VocabType.RAW,
                                 vocab_size=vocab_size,
                                 stop_token_ids=list(self.vocab.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        text = torch.tensor([b is not None for b in self.vocab.token_bytes])  # (V,) bool
        self._text_bits = pack_bitmask(text)
        self._cache = CompileCache(cache_size)
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A new :class:`Grammar` for ``params``, at the start of the output.

        This is the request's validation: call it before the request is queued.
        ``ValueError`` naming the field (``json``, ``regex``, ``choice``,
        ``grammar``, ``json_object``) if the constraint does not compile.
        """
        key = constraint_key(params)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = _CompiledConstraint(self._compile_with_timeout(*key), self.vocab,
                                           self._text_bits)
            self._cache.put(key, compiled)
        return Grammar(compiled)

    def _compile_with_timeout(self, kind: str, text: str, layout: JsonLayout):
        if self.compile_timeout_s is None:
            return self._compile(kind, text, layout)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minivllm-grammar")
        future = self._pool.submit(self._compile, kind, text, layout)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise ValueError(f"{kind}: compiling took longer than compile_timeout_s="
                             f"{self.compile_timeout_s}") from None

    def _compile(self, kind: str, text: str, layout: JsonLayout):
        """``kind``, ``text`` and ``layout`` as :func:`constraint_key` spells them."""
        compiler = self._compiler
        # xgrammar's compact form, with "," and ":" under disable_any_whitespace.
        separators = (",", ":") if layout.compact else (", ", ": ")
        try:
            if kind == "json" and layout.whitespace is not None:
                # xgrammar has no whitespace pattern: the ref's regex of the schema.
                try:
                    pattern = schema_to_regex(json.loads(text), layout)
                except ValueError as e:
                    raise ValueError(f"with whitespace_pattern the schema is written as the "
                                     f"ref's regex, which refuses it: {e}") from None
                return compiler.compile_regex(pattern)
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False,
                                                    separators=separators, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=separators)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_regex(choice_regex(json.loads(text)))
            return compiler.compile_grammar(text)  # grammar: xgrammar's EBNF, rule "root"
        except Exception as e:  # xgrammar raises RuntimeError and its own error types
            lines = [_XGRAMMAR_PREFIX.sub("", line) for line in str(e).strip().splitlines()]
            message = next((line for line in lines if line.strip()), type(e).__name__)
            raise ValueError(f"{kind}: {message}") from None
