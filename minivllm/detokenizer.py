"""Incremental detokenization and stop strings, one token at a time.

The engine samples token ids; users want text, streamed as it grows, and cut
at a stop string. Decoding every output from scratch each step costs
``O(len^2)`` over a request's life, and decoding each token on its own is
wrong twice over:

- **Multi-byte characters.** Byte-level BPE splits a character such as "日"
  (3 UTF-8 bytes) or "🚀" (4) over several tokens. Decoding a token that ends
  mid-character yields U+FFFD (the replacement character ``'\\ufffd'``).
- **Context-dependent spacing.** SentencePiece tokenizers drop the leading
  space of the first token they decode, so ``decode([t])`` differs from what
  ``t`` adds after other tokens.

vLLM's answer (``detokenize_incrementally``) keeps two offsets into the token
ids: ``prefix_offset`` .. ``read_offset`` is a few tokens already turned into
text, kept as *context*; each step decodes ``ids[prefix_offset:]`` and
``ids[prefix_offset:read_offset]``; the new text is the difference. If the
longer decode ends in U+FFFD the last character is incomplete: emit nothing
and wait for the next token. Each step decodes a handful of tokens, O(1).

Stop strings are searched only where a new match can be: the characters this
update added plus the ``max_stop_len - 1`` before them. For streaming,
:meth:`IncrementalDetokenizer.get_next_delta_text` holds back the longest tail
of the text that is the start of some stop string, because the next token may
complete it and that text must then never have been shown.
"""

from __future__ import annotations

from typing import Any

from minivllm.request import Request

#: Prompt tokens decoded as context before the first output token (as vLLM).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class IncrementalDetokenizer:
    """Turn one request's output token ids into text, incrementally.

    Args:
        tokenizer: a transformers tokenizer (``decode`` is all that is used).
        prompt_token_ids: the prompt; its last few tokens are decoding context.
        skip_special_tokens: drop special tokens from the text.
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
    ) -> None:
        stop = list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
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
