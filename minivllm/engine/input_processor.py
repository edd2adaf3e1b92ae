"""Input processing: a prompt and its ``SamplingParams`` become a checked ``Request``.

vLLM v1's input processor: everything a request needs is checked and built
here, *before* the scheduler sees it, so a bad request raises ``ValueError``
naming the field and leaves the engine as it was:

- the types, an empty prompt, prompt + ``max_tokens`` beyond
  ``max_model_len`` (checked before the ids are scanned, so a huge prompt
  costs nothing), token ids outside the vocabulary, in the prompt, in
  ``logit_bias`` or ``allowed_token_ids`` (:meth:`InputProcessor.validate_prompt`);
- ``bad_words``, tokenized (:func:`bad_words_token_ids`), and each custom
  logits processor's ``validate_params``;
- the sampling parameters again (a ``SamplingParams`` can be changed after it
  was made), the request id;
- the :class:`~minivllm.request.Request`, its own generator (for a seed: a
  seed torch refuses fails here, not in a later step), its detokenizer and
  stop strings, its output state (:meth:`InputProcessor.process`).

The scheduler's ``add_request`` is the last check (a request that needs more
KV blocks than the whole pool); :meth:`minivllm.engine.llm_engine.LLMEngine.add_request`
calls it only once everything here has succeeded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from minivllm.engine.output_processor import IncrementalDetokenizer, RequestState
from minivllm.model.generation_config import GenerationDefaults
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams


class InputProcessor:
    """Checks requests and builds what the engine keeps for each.

    Args:
        tokenizer: the model's tokenizer (the detokenizer and stop strings need it).
        vocab_size: the model's vocabulary size (token ids must be below it).
        max_model_len: the longest prompt + output.
        eos_token_id: the model's end-of-sequence id (None if it has none).
        logits_processors: the custom logits-processor classes (their
            ``validate_params`` checks each request).
        generation: the model's generation config (its other EOS ids stop every
            request too); None: none.
        max_logprobs: the most ``logprobs`` a request may ask for (-1: no cap).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 eos_token_id: int | None, logits_processors: tuple = (),
                 generation: GenerationDefaults | None = None, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.logits_processors = tuple(logits_processors)
        self.generation = GenerationDefaults() if generation is None else generation
        self.max_logprobs = max_logprobs

    def truncate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM's left truncation; -1:
        ``max_model_len``), or the prompt itself; ``ValueError`` past ``max_model_len``."""
        k = getattr(sampling_params, "truncate_prompt_tokens", None)
        if k is None or not isinstance(prompt_token_ids, (list, tuple)):
            return prompt_token_ids
        k = self.max_model_len if k == -1 else k
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) must be at most "
                             f"max_model_len={self.max_model_len}")
        return list(prompt_token_ids[-k:])

    def validate_prompt(self, prompt_token_ids: list[int],
                        sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if this prompt can never be served (see the module docstring)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, "
                             f"got {type(prompt_token_ids).__name__}")
        prompt_token_ids = self.truncate(prompt_token_ids, sampling_params)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        # The length first: a huge prompt is refused without scanning it.
        max_tokens = sampling_params.max_tokens
        need = len(prompt_token_ids) + (max_tokens if isinstance(max_tokens, int) else 1)
        if need > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({max_tokens}) must be at most max_model_len={self.max_model_len}"
            )
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sampling_params, name)
            if asked is None:  # vLLM's rule: -1 is the whole vocabulary, on both sides
                continue
            cap = vocab if self.max_logprobs == -1 else self.max_logprobs
            if (vocab if asked == -1 else asked) > cap:
                raise ValueError(
                    f"{name}={asked} asks for more log-probabilities a token than "
                    f"max_logprobs={self.max_logprobs} allows (the engine argument "
                    f"max_logprobs, --max-logprobs; -1 there lifts the cap)")
        bad = [t for t in prompt_token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab}), got {bad[:5]}")
        for name in ("logit_bias", "allowed_token_ids"):  # types: SamplingParams.verify
            ids = getattr(sampling_params, name) or ()
            bad = [t for t in ids if isinstance(t, int) and t >= vocab]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {vocab}) (the model's "
                                 f"vocabulary), got {sorted(bad)[:5]}")

    @staticmethod
    def check_priority(priority: Any, policy: str) -> None:
        """A request's ``priority``: an int; under the ``fcfs`` policy only 0 (vLLM's rule)."""
        if not isinstance(priority, int) or isinstance(priority, bool) \
                or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be an int in [-2**63, 2**63), got {priority!r}")
        if priority != 0 and policy != "priority":
            raise ValueError(f"priority must be 0 under scheduling_policy={policy!r}, got "
                             f"{priority} (priority scheduling needs "
                             f"scheduling_policy='priority', --scheduling-policy priority)")

    def process(self, prompt: str | None, prompt_token_ids: list[int],
                sampling_params: SamplingParams, request_id: str, lora_request: Any = None,
                ) -> tuple[Request, RequestState]:
        """The checked request and its output state (the sampling worker makes a seeded
        request's own generator; a seed torch refuses is a ``ValueError`` here).

        ``lora_request`` must have been checked (``LoRARequests.check``).
        """
        self.validate_prompt(prompt_token_ids, sampling_params)
        prompt_token_ids = self.truncate(prompt_token_ids, sampling_params)
        sampling_params.verify()
        sampling_params = self.generation.with_eos(sampling_params, self.eos_token_id)
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary, as a number
            if getattr(sampling_params, name) == -1:
                sampling_params = dataclasses.replace(sampling_params,
                                                      **{name: self.vocab_size})
        if sampling_params.bad_words:  # on a copy: the caller's params stay as they were
            sampling_params = dataclasses.replace(sampling_params)
            sampling_params._bad_words_token_ids = bad_words_token_ids(
                self.tokenizer, sampling_params.bad_words, self.vocab_size)
        for cls in self.logits_processors:  # custom logits processors' rules
            cls.validate_params(sampling_params)
        if sampling_params.seed is not None:  # one torch refuses fails here, not in a step
            torch.Generator().manual_seed(sampling_params.seed)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        request = Request(request_id, prompt_token_ids, sampling_params, self.eos_token_id,
                          lora_request=lora_request)
        detokenizer = IncrementalDetokenizer.from_request(self.tokenizer, request)
        return request, RequestState(prompt, detokenizer, sampling_params)


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """Each bad word's token ids, as written and with a leading space (vLLM's rule).

    The word is stripped of leading white space first, then encoded without
    special tokens as ``word`` and as ``" " + word``, so that it is forbidden
    both at the start of the text and after a space; identical sequences are
    kept once. ``ValueError`` naming ``bad_words`` without a tokenizer, or if an
    id falls outside the vocabulary.
    """
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this engine has none")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words: their tokens must be in [0, {vocab_size}) (the model's "
                         f"vocabulary), got {bad[:5]}")
    return out
