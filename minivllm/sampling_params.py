"""``SamplingParams``: how to pick each next token, and when to stop.

Field names, defaults and allowed ranges follow vLLM's ``SamplingParams``, so
code written against one runs against the other. Every value is checked when
the object is made; a bad one raises ``ValueError`` naming the field, the
value and the range allowed.
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from minivllm.structured_outputs_params import StructuredOutputsParams  # noqa: F401  (re-exported)

_SAMPLING_EPS = 1e-5
#: Temperatures in (0, 1e-2) make logits / T overflow; vLLM raises them to 1e-2.
_MAX_TEMP = 1e-2


class RequestOutputKind(enum.IntEnum):
    """What each :class:`~minivllm.outputs.RequestOutput` of a request holds (as vLLM).

    - ``CUMULATIVE``: everything so far (text, token ids, logprobs), every step.
    - ``DELTA``: only what is new since the request's previous output; the
      text holds back what may still become a stop string, so concatenating
      the deltas gives exactly the final text. ``cumulative_logprob`` stays
      cumulative. This is what streaming wants: O(new tokens) per step.
    - ``FINAL_ONLY``: one output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling and stopping parameters for one request.

    Args:
        n: number of completions of the prompt, in ``[1, MAX_N]`` (parallel
            sampling: the prompt is prefilled once and the ``n`` completions
            share its KV blocks; with a ``seed``, completion ``i`` draws from
            ``seed + i``).
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: keep the smallest set of tokens whose probability reaches
            ``top_p``; in ``(0, 1]``.
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` keeps all.
        min_p: drop tokens whose probability is below ``min_p`` times the most
            likely token's; in ``[0, 1]``.
        seed: per-request random seed; the same seed gives the same tokens
            whatever else is in the batch.
        presence_penalty: subtracted from the logit of every token already
            generated; in ``[-2, 2]``.
        frequency_penalty: subtracted once per previous occurrence in the
            output; in ``[-2, 2]``.
        repetition_penalty: divides positive (multiplies negative) logits of
            tokens seen in the prompt or output; ``> 0``, 1 means off.
        max_tokens: most tokens to generate; ``>= 1``. ``None`` means up to
            the model's context length.
        min_tokens: EOS and stop ids are suppressed until this many tokens.
        stop: strings that end generation; not included in the output text.
        stop_token_ids: token ids that end generation (included in token_ids).
        ignore_eos: keep generating after the EOS token.
        logprobs: number of top log-probabilities to return for each sampled
            token (the sampled token's own is always included); ``None`` = off;
            -1 = every token's (the engine's ``max_logprobs`` caps it).
        prompt_logprobs: number of top log-probabilities to return for each
            prompt token (the prompt token's own is always included), in
            ``RequestOutput.prompt_logprobs``; ``None`` = off; -1 = every
            token's (capped by ``max_logprobs`` too). Such a request does not
            read the prefix cache (as in vLLM): every prompt position is computed.
        truncate_prompt_tokens: keep only the prompt's last ``k`` tokens (vLLM's;
            -1: the last ``max_model_len``); ``None`` = the whole prompt.
        skip_special_tokens: drop special tokens from the output text.
        spaces_between_special_tokens: passed to the tokenizer's ``decode``, as
            vLLM does: a slow tokenizer then writes a space between special
            tokens; a fast one (every model minivllm loads) writes none either way.
        include_stop_str_in_output: keep the matched stop string in the text.
        output_kind: a :class:`RequestOutputKind`: cumulative outputs (the
            default), deltas, or the final output only.
        structured_outputs: constrain the output to a JSON schema, a regex,
            a list of choices, a grammar or any JSON object
            (:class:`StructuredOutputsParams`); ``None`` = unconstrained.
        logit_bias: token id -> value added to that token's logit before
            sampling (vLLM's and OpenAI's: clamped to ``[-100, 100]``; +100
            all but forces the token, -100 all but bans it). Ids must be in
            the vocabulary (checked when the engine adds the request).
        allowed_token_ids: only these tokens may be generated (every other
            logit becomes ``-inf``); must not be empty.
        bad_words: words never generated: each is tokenized as written and
            with a leading space; when the tokens generated so far end with
            all but the last token of one, that last token is forbidden (a
            one-token word always is). See docs/sampling.md.
        extra_args: anything else, for custom logits processors to read
            (vLLM's ``extra_args``); minivllm itself ignores it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)
    #: ``bad_words`` as token id sequences, set by the engine's input processor (it
    #: holds the tokenizer), as vLLM's ``update_from_tokenizer`` does.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False,
                                                         repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop = []
        elif isinstance(self.stop, str):
            self._stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self._stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, "
                             f"got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, "
                             f"got {self.stop_token_ids!r}")
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self._normalise_shaping()
        if type(self.output_kind) is int and self.output_kind in set(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self.verify()
        if 0.0 < self.temperature < _MAX_TEMP:
            warnings.warn(
                f"temperature {self.temperature} is below {_MAX_TEMP}, which may overflow "
                f"logits / temperature; using {_MAX_TEMP} (as vLLM does)",
                stacklevel=3,
            )
            self.temperature = _MAX_TEMP

    def _normalise_shaping(self) -> None:
        """vLLM's forms: ``logit_bias`` keys as ints (``"42"`` -> 42), values clamped
        to ``[-100, 100]``; tuples as lists. Bad types are left for :meth:`verify`."""
        bias = self.logit_bias
        if isinstance(bias, dict):
            out = {}
            for k, v in bias.items():
                if isinstance(k, str) and k.strip().isascii() and k.strip().lstrip("-").isdigit():
                    k = int(k)
                if _is_real(v) and not math.isnan(v):
                    v = min(100.0, max(-100.0, float(v)))
                out[k] = v
            self.logit_bias = out
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """``bad_words`` as token id sequences (None until the engine tokenized them)."""
        return self._bad_words_token_ids

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (possibly empty)."""
        return self._stop

    @property
    def greedy(self) -> bool:
        """True when ``temperature`` is 0: the argmax token is taken."""
        return self.temperature < _SAMPLING_EPS

    def verify(self) -> None:
        """Raise ``ValueError`` naming the field if any value is out of range.

        Types first (ints are not bools, floats are finite), then ranges. Run
        when the object is made, and again by the engine when a request is
        added (a ``SamplingParams`` is mutable).
        """
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise bad(name, "a finite number")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL_FIELDS:
                continue
            if not _is_int(v) or not _INT64_MIN <= v <= _INT64_MAX:
                raise bad(name, "an int" + (" or None" if name in _OPTIONAL_FIELDS else "")
                          + f" in [{_INT64_MIN}, {_INT64_MAX}]")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"in [1, {MAX_N}]")
        if not 0.0 <= self.temperature:
            raise bad("temperature", "non-negative (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"an int in [{SEED_MIN}, {SEED_MAX}] (torch.Generator's range) "
                              "or None")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "greater than 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "at least 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        t = self.truncate_prompt_tokens
        if t is not None and not (t >= 1 or t == -1):
            raise bad("truncate_prompt_tokens", ">= 1, -1 (max_model_len) or None")
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", ">= 0, -1 (the whole vocabulary) or None; the engine's "
                                  "max_logprobs caps it")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", ">= 0, -1 (the whole vocabulary) or None; the "
                                         "engine's max_logprobs caps it")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative ints")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(k.name for k in RequestOutputKind)
            raise bad("output_kind", f"a RequestOutputKind ({kinds})")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams or None")
            self.structured_outputs.verify()
        self._verify_shaping(bad)

    def _verify_shaping(self, bad) -> None:
        """Types of the logits-shaping fields; the engine checks ids against its vocabulary."""
        def token_id(t: object) -> bool:
            return _is_int(t) and 0 <= t <= _INT64_MAX

        bias = self.logit_bias
        if bias is not None and not (
                isinstance(bias, dict) and all(token_id(k) for k in bias)
                and all(_is_real(v) and math.isfinite(v) for v in bias.values())):
            raise bad("logit_bias", "a dict of token id (a non-negative int) -> finite number, "
                                    "or None")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not all(token_id(t) for t in allowed):
                raise bad("allowed_token_ids", "a list of token ids (non-negative ints) or None")
            if not allowed:
                raise bad("allowed_token_ids", "a non-empty list (None allows every token)")
        words = self.bad_words
        if words is not None and not (isinstance(words, list) and all(
                isinstance(w, str) and w.strip() for w in words)):
            raise bad("bad_words", "a list of non-blank strings or None")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "a dict or None")

    @property
    def uses_logits_shaping(self) -> bool:
        """True when a built-in logits processor has work for this request."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)


#: The most completions one request may ask for (``SamplingParams.n``), and the widest
#: beam search (``BeamSearchParams.beam_width``).
MAX_N = 256

#: ``torch.Generator.manual_seed`` accepts exactly these (a negative seed wraps to
#: its unsigned 64-bit value); outside, it raises "Overflow when unpacking long long".
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_OPTIONAL_FIELDS = ("max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search over the model's log-probabilities (vLLM's ``BeamSearchParams``).

    ``LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))``
    keeps, at each step, the ``beam_width`` best continuations of the running
    beams (the best of their top ``2 * beam_width`` candidates) and returns the
    ``beam_width`` best finished sequences, best first, scored as transformers
    does: the summed log-probability over ``generated_tokens ** length_penalty``.

    Args:
        beam_width: beams kept, in ``[1, MAX_N]``.
        max_tokens: most tokens generated per beam, ``>= 1``.
        ignore_eos: keep going after EOS (every beam then runs ``max_tokens``).
        temperature: divides the logits before the log-softmax; 0 (the
            default) means the raw logits.
        length_penalty: the exponent of the length in the score; ``> 0``
            favours longer sequences.
        structured_outputs: constrain every beam (vLLM's field): each ranks
            only the tokens its own grammar allows, and ends at EOS once its
            text is complete (so ``ignore_eos`` must stay False).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not (_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_N):
            raise bad("beam_width", f"an int in [1, {MAX_N}]")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "True or False")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise bad(name, "a finite number")
        if self.temperature < 0:
            raise bad("temperature", "non-negative (0: the raw logits)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams or None")
            self.structured_outputs.verify()
            if self.ignore_eos:
                raise ValueError("ignore_eos must be False with structured_outputs: a "
                                 "constrained beam ends at EOS once its text is complete")
