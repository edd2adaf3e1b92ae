"""Request bodies of the OpenAI API, and their mapping onto :class:`SamplingParams`.

Field names and defaults are OpenAI's (``max_tokens``, ``temperature``,
``n``, ``stop``, ``seed``, ``logprobs``, ``stream_options``...), plus vLLM's
extra fields, which the ``openai`` client sends through ``extra_body``
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``request_id``, ``structured_outputs``,
``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``, ``priority``...), and
OpenAI's ``logit_bias`` (:func:`logit_bias_ids`).
``response_format``, ``structured_outputs`` and chat's ``tools`` become a
:class:`~minivllm.StructuredOutputsParams` in :mod:`.structured`. Every vLLM
field is honoured or refused, never ignored: those minivllm cannot honour are
a 400 naming them (checked here, or listed in :mod:`.fields` with the reason).
Fields vLLM does not know either are accepted and ignored, as vLLM does
(clients such as LangChain send fields nobody uses); the server logs a
warning naming them (:meth:`_Request.ignored_fields`). ``NaN`` and
``Infinity`` (which Python's JSON parser accepts) are refused in every float field.

Sizes are capped by :class:`ServingLimits` (``minivllm serve --max-...``), checked
before anything is tokenized. Ranges are checked once, by :class:`SamplingParams`
itself (``priority`` by the engine); its ``ValueError`` becomes a 400 (:class:`APIError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.entrypoints.openai.errors import (  # noqa: F401 (re-exported)
    APIError,
    check_prompt_chars,
    check_stop,
    check_text,
)
from minivllm.entrypoints.openai.fields import known_to_vllm, refusal_message
from minivllm.entrypoints.openai.limits import ServingLimits
from minivllm.entrypoints.openai.logit_bias import logit_bias_ids
from minivllm.sampling_params import BeamSearchParams, SamplingParams


class _Request(BaseModel):
    """A request body: unknown fields are kept aside (and logged), NaN/inf refused."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    #: The endpoint whose refused vLLM fields (:mod:`.fields`) are known, not ignored.
    ENDPOINT: ClassVar[str] = ""

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The unknown fields of this body and of its nested bodies, as dotted paths."""
        names = [prefix + name for name in (self.model_extra or {})
                 if not known_to_vllm(name, self.ENDPOINT)]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Request):
                names += value.ignored_fields(f"{prefix}{name}.")
        return names


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` extra (completions and chat): set exactly one field.

    ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (xgrammar's EBNF) or
    ``json_object`` (none when ``response_format`` sets it), and vLLM's JSON options;
    see :class:`minivllm.StructuredOutputsParams`.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # refused (structured.py): xgrammar's tagged regions


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named JSON schema."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (``structural_tag``
    is refused in :mod:`.structured`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Request):
    """A tool's function: its name and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    """One entry of chat's ``tools`` (OpenAI's function tools)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice={"type": "function", "function": {"name": ...}}``: call that one."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """The fields both endpoints share; ``to_sampling_params`` maps them."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # no effect, as in vLLM
    response_format: ResponseFormat | None = None
    # vLLM's extras (extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsField | None = None
    spaces_between_special_tokens: bool = True
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0  # under --scheduling-policy priority: lower is served first

    # vLLM's beam-search extras (completions and chat): n is the beam width.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def engine_params(self, defaults: Mapping[str, Any] | None = None,
                      ) -> SamplingParams | BeamSearchParams:
        """The one engine request behind each prompt: ``n`` completions sampled in
        parallel (sharing the prompt's blocks), or a beam search of width ``n``.

        ``defaults``: the model's generation-config values (SamplingParams field ->
        value) for the fields the request leaves out, as vLLM's server applies them."""
        if self.use_beam_search:
            return self.to_beam_search_params()
        return self.to_sampling_params(defaults)

    def check_fields(self) -> None:
        """400 naming the first vLLM field this request asks for that minivllm refuses."""
        for name, value in (self.model_extra or {}).items():
            message = refusal_message(name, value, self.ENDPOINT)
            if message is not None:
                raise APIError(400, message, name)

    def check_limits(self, limits: ServingLimits, num_prompts: int = 1) -> None:
        """400 if the request is bigger than the server allows (before tokenizing)."""
        if not 1 <= self.n <= limits.max_n:
            raise APIError(400, f"n must be in [1, {limits.max_n}] (the server's --max-n), "
                                f"got {self.n}", "n")
        if num_prompts * self.n > limits.max_n:
            raise APIError(400, f"len(prompt) * n must be at most {limits.max_n} (the "
                                f"server's --max-n), got {num_prompts * self.n}", "n")
        check_stop(limits, self.stop, self.stop_token_ids)

    def _beam_search_params(self, max_tokens: int | None,
                            logprobs: int | None) -> BeamSearchParams:
        """``use_beam_search``: the fields that mean nothing to a beam search are refused."""
        if max_tokens is None:
            raise APIError(400, "use_beam_search needs max_tokens", "max_tokens")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None:
                raise APIError(400, f"{name} are not returned with use_beam_search", name)
        for name in ("stop", "stop_token_ids", "seed"):
            if getattr(self, name):
                raise APIError(400, f"{name} does not apply with use_beam_search", name)
        try:
            return BeamSearchParams(
                beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                temperature=0.0 if self.temperature is None else self.temperature,
                length_penalty=self.length_penalty)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), "n" if name == "beam_width" else name) from None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of the prompt's ``n`` completions.

        With a seed, completion ``i`` draws from ``seed + i`` (the engine's
        rule, as vLLM's): reproducible, and the ``n`` completions still differ.
        A field the request leaves out takes the model's default (``defaults``),
        else SamplingParams'; the model's ``max_tokens`` caps the request's.
        """
        d = dict(defaults or {})

        def pick(name: str, fallback: float) -> float:
            value = getattr(self, name)
            return d.get(name, fallback) if value is None else value

        if "max_tokens" in d:
            max_tokens = d["max_tokens"] if max_tokens is None else min(max_tokens,
                                                                         d["max_tokens"])
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           "stream_options")
        if self.length_penalty != 1.0:
            raise APIError(400, "length_penalty needs use_beam_search", "length_penalty")
        if self.prompt_logprobs is not None and self.stream:  # as in vLLM
            raise APIError(400, "prompt_logprobs are not available with stream=true",
                           "prompt_logprobs")
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                logit_bias=logit_bias_ids(self.logit_bias),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
            )
        except ValueError as e:
            # SamplingParams names the field first: "top_p must be in (0, 1], got 2.0".
            raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: continue a prompt (text, token ids, or a list of either)."""

    ENDPOINT: ClassVar[str] = "completions"
    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # BOS etc. when a text prompt is tokenized
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or lists of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise APIError(400, "prompt must not be empty", "prompt")
        return list(p)

    def _check_unsupported(self) -> None:
        for name, default in (("suffix", None),):
            if getattr(self, name) != default:
                raise APIError(400, f"{name} is not supported by minivllm; leave it out", name)
        if self.best_of not in (None, self.n):
            raise APIError(400, f"best_of must equal n ({self.n}) or be left out, "
                                f"got {self.best_of}", "best_of")
        if self.logprobs is not None and self.logprobs < -1:  # the engine checks the cap
            raise APIError(400, f"logprobs must be >= 0 or -1 (the whole vocabulary), got "
                                f"{self.logprobs}", "logprobs")

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_unsupported()
        params = self._sampling_params(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            params = replace(params, prompt_logprobs=self.logprobs)  # they lead the logprobs
        return params

    def to_beam_search_params(self) -> BeamSearchParams:
        self._check_unsupported()
        return self._beam_search_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    """One message: ``role`` and ``content`` (a string, or a list of text parts); an
    assistant's earlier ``tool_calls``, a tool result's ``tool_call_id`` (and ``name``)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message with its content as one string; :func:`~minivllm.entrypoints.
        chat_utils.render_chat` picks the fields a template reads."""
        return {**self.model_dump(exclude_none=True), "content": self.text()}

    def text(self) -> str:
        """The content as one string (text parts joined; other parts refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"only text content parts are supported, got "
                                    f"{str(part.get('type'))[:40]!r}", "messages")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise APIError(400, f"a text part's text must be a string, got "
                                    f"{type(text).__name__}", "messages")
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: answer a conversation through the chat template."""

    ENDPOINT: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # on top of the template's own (vLLM's default: none)
    documents: list[dict[str, str]] | None = None  # for templates that read them (RAG)
    echo: bool = False  # vLLM's: the answer starts with the last message, if it is the reply's role
    # Tool calls (minivllm/entrypoints/openai/structured.py).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def echo_text(self) -> str:
        """What ``echo`` puts before the answer (vLLM's): the last message's content when its
        role is the reply's (``assistant`` with ``add_generation_prompt``, else its own)."""
        last = self.messages[-1].for_template()
        role = "assistant" if self.add_generation_prompt else last["role"]
        return (last.get("content") or "") if last["role"] == role else ""

    def _check_unsupported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < -1:  # the engine caps it
            raise APIError(400, f"top_logprobs must be >= 0 or -1 (the whole vocabulary), "
                                f"got {self.top_logprobs}", "top_logprobs")

    def _max_tokens_logprobs(self) -> tuple[int | None, int | None]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        return max_tokens, (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        self._check_unsupported()
        return self._sampling_params(*self._max_tokens_logprobs(), defaults)

    def to_beam_search_params(self) -> BeamSearchParams:
        self._check_unsupported()
        return self._beam_search_params(*self._max_tokens_logprobs())


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter``: serve the adapter at ``lora_path`` as ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
