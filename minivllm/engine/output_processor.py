"""Output processing: each request's new tokens become text, logprobs and a ``RequestOutput``.

vLLM v1's ``OutputProcessor``: the engine core hands out new token ids per
request; this turns them into what the user sees, in the request's
``output_kind`` (``CUMULATIVE``, ``DELTA`` or ``FINAL_ONLY``):

- the incremental detokenizer (:class:`IncrementalDetokenizer`, below) appends the text
  and watches for stop strings, holding back text that may be the start of
  one;
- logprob rows become ``{token_id: Logprob}`` dicts, and the cumulative
  logprob is summed; the rows of a request's prompt positions become its
  ``prompt_logprobs`` (:meth:`OutputProcessor.add_prompt_logprobs`);
- a stop string inside a run of several new tokens (speculative decoding)
  ends the request at the token plain decoding would have ended it at: the
  tokens after it are left out of its output (the request itself is only
  ever changed by the scheduler).

It keeps one :class:`RequestState` per request the engine serves.

**Incremental detokenization** (:class:`IncrementalDetokenizer`, one per
request). Decoding every output from scratch each step costs ``O(len^2)``
over a request's life, and decoding each token on its own is wrong twice
over: byte-level BPE splits a character such as "日" (3 UTF-8 bytes) or "🚀"
(4) over several tokens, and decoding a token that ends mid-character yields
U+FFFD; SentencePiece tokenizers drop the leading space of the first token
they decode, so ``decode([t])`` differs from what ``t`` adds after other
tokens. vLLM's answer (``detokenize_incrementally``) keeps two offsets into
the token ids: ``prefix_offset`` .. ``read_offset`` is a few tokens already
turned into text, kept as *context*; each step decodes ``ids[prefix_offset:]``
and ``ids[prefix_offset:read_offset]``; the new text is the difference. If the
longer decode ends in U+FFFD the last character is incomplete: emit nothing
and wait for the next token. Each step decodes a handful of tokens, O(1).

Stop strings are searched only where a new match can be: the characters this
update added plus the ``max_stop_len - 1`` before them. For streaming,
:meth:`IncrementalDetokenizer.get_next_delta_text` holds back the longest tail
of the text that is the start of some stop string, because the next token may
complete it and that text must then never have been shown.
"""

from __future__ import annotations

import logging
from typing import Any

from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.step_sampling import PromptLogprobs

logger = logging.getLogger("minivllm")


#: Prompt tokens decoded as context before the first output token (as vLLM).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class IncrementalDetokenizer:
    """Turn one request's output token ids into text, incrementally.

    Args:
        tokenizer: a transformers tokenizer (``decode`` is all that is used).
        prompt_token_ids: the prompt; its last few tokens are decoding context.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: the tokenizer's option of that name (a slow
            tokenizer's; fast ones ignore it).
        stop: stop strings; generation ends at the first one that appears.
        include_stop_str_in_output: keep the stop string at the end of the text.
        min_tokens: stop strings are not looked for until this many tokens
            have been generated (as EOS and stop ids are masked until then).

    Attributes:
        output_text: the text so far; once a stop string matched, cut before
            it (or after it, with ``include_stop_str_in_output``).
        token_ids: prompt plus output token ids.
        stop_reason: the stop string that matched, or None.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        stop = list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.stop_reason: str | None = None
        # The longest text that could still turn into a stop string.
        self._max_hold = max((len(s) for s in stop), default=1) - 1
        self._num_emitted = 0  # characters of output_text already streamed

    @classmethod
    def from_request(cls, tokenizer: Any, request: Request) -> IncrementalDetokenizer:
        """A detokenizer configured from ``request.sampling_params``."""
        p = request.sampling_params
        return cls(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop_strings,
            include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append sampled tokens; return the stop string that matched, if any.

        On a match the caller finishes the request (``FINISHED_STOPPED``,
        ``stop_reason`` = the returned string); later calls do nothing.
        """
        if self.stop_reason is not None:
            return None
        num_new_chars = 0
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta = self._decode_next()
            self.output_text += delta
            num_new_chars += len(delta)
        if not self.stop or not num_new_chars or self.num_output_tokens < self.min_tokens:
            return None
        return self._check_stop_strings(num_new_chars)

    def _decode_next(self) -> str:
        """The text the newest token completes (vLLM's prefix/read offset step)."""
        decode = self.tokenizer.decode
        kwargs = dict(
            skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        if not self.spaces_between_special_tokens:  # only a slow tokenizer reads it
            kwargs["spaces_between_special_tokens"] = False
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], **kwargs)
        new_text = decode(self.token_ids[self.prefix_offset :], **kwargs)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # Nothing new (e.g. a skipped special token), or the last character
            # is still incomplete: wait, keeping the offsets where they are.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the new text; cut the text there."""
        text = self.output_text
        # A match must end inside the new characters, so it starts at most
        # len(stop) - 1 characters before them.
        window_start = max(len(text) - num_new_chars - self._max_hold, 0)
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            index = text.find(stop_str, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        cut = index + len(stop_str) if self.include_stop_str_in_output else index
        self.output_text = text[:cut]
        self.stop_reason = stop_str
        return stop_str

    def _num_held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.output_text
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def get_next_delta_text(self, finished: bool = False) -> str:
        """Text not yet streamed, holding back what may still become a stop string.

        Pass ``finished=True`` on the request's last step to release the rest.
        Concatenating every delta gives ``output_text``.
        """
        end = len(self.output_text)
        if not finished and self.stop_reason is None:
            end -= self._num_held_back()
        delta = self.output_text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta


class RequestState:
    """What the engine keeps for one request beside the scheduler's ``Request``."""

    def __init__(self, prompt: str | None, detokenizer: IncrementalDetokenizer,
                 sampling_params: SamplingParams) -> None:
        want_logprobs = sampling_params.logprobs is not None
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.output_kind = sampling_params.output_kind
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.num_sent_tokens = 0  # output tokens already handed out (DELTA)
        # Per prompt token, its logprob dict (the first token has none: None).
        want_prompt = getattr(sampling_params, "prompt_logprobs", None) is not None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if want_prompt else None
        self.prompt_logprobs_sent = False  # DELTA: they go out once, whole
        self.num_prompt_logprobs = getattr(sampling_params, "prompt_logprobs", None)
        self.error: Exception | None = None  # a failure found outside _advance
        # Set when a stop string ended it: its output tokens up to the stop (a speculative
        # run may have appended more to the request; they are not part of its output).
        self.num_kept_tokens: int | None = None


class OutputProcessor:
    """Builds every request's outputs from its new tokens (see the module docstring).

    Args:
        tokenizer: the model's tokenizer (logprob dicts name their tokens).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def process(self, rows: list[tuple[Request, list[int], list | None]],
                finished: set[str], scheduler: Any) -> list[RequestOutput]:
        """Detokenize, match stop strings and build each sampled request's output.

        ``rows``: per request, its new tokens (what the scheduler kept) and
        their logprob rows; ``finished``: the ids the scheduler finished this
        step (a stop string found here finishes one through ``scheduler``).
        A failure while doing so ends that request alone (``finish_reason="error"``).
        The engine forgets the finished requests' states afterwards.
        """
        outputs = []
        for req, tokens, lp_rows in rows:
            state = self.states.get(req.request_id)
            if state is None or not tokens:
                continue
            try:
                output = self._advance(req, state, tokens, lp_rows, finished, scheduler)
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                outputs.append(self.fail(req, e, scheduler))
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _advance(self, req: Request, state: RequestState, tokens: list[int], lp_rows,
                 finished: set[str], scheduler: Any) -> RequestOutput | None:
        """One request's new tokens: their logprobs, text and stop strings; its output.

        Token by token, so that a stop string inside a speculative run ends
        the request at the token plain decoding would have ended it at: the
        tokens after it are left out of its output.
        """
        if state.error is not None:  # its prompt logprobs failed: it ends here
            raise state.error
        for i, token in enumerate(tokens):
            if state.logprobs is not None and lp_rows is not None:
                logprobs = self._logprob_dict(req.sampling_params.logprobs, *lp_rows[i])
                state.logprobs.append(logprobs)
                state.cumulative_logprob += logprobs[token].logprob
            if state.detokenizer.update([token]) is None:
                continue
            # A stop string: the request ends at this token. The tokens after it (a
            # speculative run) are left out of its output, and the scheduler ends it
            # unless it ended this step anyway (at a later token, or this one).
            state.num_kept_tokens = req.num_output_tokens - (len(tokens) - 1 - i)
            if req.request_id not in finished:
                scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                finished.add(req.request_id)
            break
        return self._output(req, state, req.request_id in finished)

    def fail(self, req: Request, error: Exception, scheduler: Any) -> RequestOutput:
        """End ``req`` alone after a failure of its own: free its blocks, report ``error``."""
        logger.warning("minivllm: request %r failed and was aborted: %s: %s",
                       req.request_id, type(error).__name__, error)
        scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        state = self.states.get(req.request_id)
        delta = state is not None and state.output_kind == RequestOutputKind.DELTA
        first = state.num_sent_tokens if delta else 0
        completion = CompletionOutput(
            index=0,
            # A delta stream has had the text it may see; cumulative ones get it whole.
            text="" if state is None or delta else state.detokenizer.output_text,
            token_ids=req.output_token_ids[first:],
            cumulative_logprob=None if state is None else state.cumulative_logprob,
            logprobs=None,
            finish_reason="error",  # also if it had finished this step
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=None if state is None else state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
            lora_request=req.lora_request,
        )

    def add_prompt_logprobs(self, prompt_logprobs: tuple[PromptLogprobs, ...]) -> None:
        """Keep a step's prompt logprobs (the sampling worker's
        :class:`~minivllm.step_sampling.PromptLogprobs`: row ``i`` of a run
        scores prompt token ``first_position + i + 1``, so a chunk's rows
        continue the last chunk's). Rows a request already has (it was
        preempted and recomputes) are skipped; a gap (positions read from the
        prefix cache) fails it alone.
        """
        for p in prompt_logprobs:
            state = self.states.get(p.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            have = len(state.prompt_logprobs)  # entries of prompt tokens 0 .. have - 1
            if p.first_position + 1 > have:
                state.error = ValueError(
                    f"request {p.request_id!r}: prompt_logprobs need the logits of every "
                    f"prompt position, but positions {have - 1}..{p.first_position - 1} were "
                    f"not computed (read from the prefix cache despite "
                    f"skip_reading_prefix_cache)")
                continue
            k = state.num_prompt_logprobs
            try:
                for row in p.rows[have - 1 - p.first_position :]:
                    state.prompt_logprobs.append(self._logprob_dict(k, *row))
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                state.error = e

    def _logprob_dict(self, n: int | None, ids: list[int], vals: list[float],
                      rank: int) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` for one row: the chosen token, then the top-``n``."""
        decode = self.tokenizer.convert_ids_to_tokens
        n = n or 0
        ids, vals = ids[: n + 1], vals[: n + 1]
        d = {ids[0]: Logprob(vals[0], rank=rank, decoded_token=decode(ids[0]))}
        for k in range(1, n + 1):
            d.setdefault(ids[k], Logprob(vals[k], rank=k, decoded_token=decode(ids[k])))
        return d

    def _output(self, req: Request, state: RequestState,
                finished: bool) -> RequestOutput | None:
        """This step's output for ``req`` in its ``output_kind`` (None: nothing to report)."""
        kind, stop_str = state.output_kind, state.detokenizer.stop_reason
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            # Only what is new; the detokenizer holds back a possible stop string.
            first = state.num_sent_tokens
            text = state.detokenizer.get_next_delta_text(finished=finished)
        else:
            first = 0
            text = state.detokenizer.output_text
        kept = req.num_output_tokens if state.num_kept_tokens is None else state.num_kept_tokens
        state.num_sent_tokens = kept
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and (len(prompt_logprobs) < req.num_prompt_tokens or (
                kind == RequestOutputKind.DELTA and state.prompt_logprobs_sent)):
            prompt_logprobs = None  # not whole yet, or a delta stream has had them
        state.prompt_logprobs_sent |= prompt_logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=req.output_token_ids[first:kept],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[first:],
            finish_reason=None if not finished else (
                "stop" if stop_str is not None else req.get_finished_reason()),
            stop_reason=None if not finished else (
                stop_str if stop_str is not None else req.stop_reason),
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
            lora_request=req.lora_request,
        )
