"""``/v1/completions`` and ``/v1/chat/completions`` on top of :class:`AsyncLLM`.

One HTTP request becomes one engine request per prompt, each with OpenAI's
``n``: the engine prefills the prompt once and its ``n`` completions share
its KV blocks (parallel sampling; completion ``i`` draws from ``seed + i``
when a seed is given), or, with vLLM's ``use_beam_search`` extra, runs a beam
search of width ``n`` whose ``n`` best sequences are the choices. All are
added before anything is streamed, so a bad prompt or a full queue is an
error status, never a half-open stream. Each completion has a stream of its
own; their deltas are merged into one stream of ``(choice_index, StreamDelta)``,
choice ``p * n + i`` being completion ``i`` of prompt ``p``.

Streaming is Server-Sent Events, as OpenAI::

    data: {"id": ..., "choices": [{"index": 0, "text": "Par", "finish_reason": null}]}
    data: {"id": ..., "choices": [{"index": 0, "text": "is.", "finish_reason": "stop"}]}
    data: {"id": ..., "choices": [], "usage": {...}}      # with stream_options.include_usage
    data: [DONE]

A request that fails on its own, or an engine that fails, ends a stream with
``data: {"error": ...}`` (unstreamed: a 500 with OpenAI's error JSON). A client that
hangs up cancels the stream and aborts its engine requests (blocks freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from minivllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestError,
    RequestStream,
    StreamDelta,
)
from minivllm.entrypoints.chat_utils import ChatOptions, ChatTemplates, render_chat
from minivllm.entrypoints.openai.limits import ServingLimits
from minivllm.entrypoints.openai.logprobs import openai_logprobs, prompt_logprobs_json
from minivllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_chars,
    check_text,
)
from minivllm.entrypoints.openai.structured import (
    Constraint,
    ToolCallFormat,
    compile_error,
    request_constraint,
)
from minivllm.entrypoints.openai.tool_parsers import AutoToolCalls, ToolCallOptions

_PARAM_FIELDS = ("logprobs", "prompt_logprobs", "priority", "logit_bias", "allowed_token_ids",
                 "bad_words")  # the engine's errors for these begin with their name


def sse(obj: dict | str) -> str:
    """One Server-Sent Event carrying ``obj`` as JSON (or ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class OpenAIServing:
    """The completion endpoints of one served model.

    Args:
        llm: the async engine.
        model_name: the name clients must send as ``model`` (or leave out).
        limits: the size caps checked before anything is tokenized.
        chat_templates: ``--chat-template`` and ``--trust-request-chat-template``.
        tool_options: ``--enable-auto-tool-choice``'s parser and its companion flags.

    Tokenizing and chat templating run on one worker thread (as vLLM's
    tokenizer executor), never on the event loop: a long prompt must not stall
    every other stream while it is tokenized.
    """

    def __init__(self, llm: AsyncLLM, model_name: str,
                 limits: ServingLimits | None = None,
                 lora_modules: dict | None = None,
                 chat_templates: ChatTemplates | None = None,
                 tool_options: ToolCallOptions | None = None) -> None:
        self.llm = llm
        self.tool_options = tool_options or ToolCallOptions()
        self.chat_templates = chat_templates or ChatTemplates()
        self.model_name = model_name
        #: LoRA adapters by served name (``--lora-modules``, ``/v1/load_lora_adapter``):
        #: a request's ``model`` picks one.
        self.lora_modules: dict = dict(lora_modules or {})
        self.limits = limits or ServingLimits()
        self.tokenizer = llm.tokenizer
        #: The model's generation-config values for the fields a request leaves out.
        self.default_sampling = dict(llm.engine.generation.sampling)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="minivllm-tokenizer")

    def close(self) -> None:
        """Stop the tokenizer thread."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizer thread, awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    def check_model(self, model: str | None):
        """The LoRA adapter ``model`` names (None: the base model); 404 if it is neither
        the served model (None means it too) nor an adapter."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        names = [self.model_name, *self.lora_modules]
        raise APIError(404, f"model {model[:100]!r} does not exist; this server serves "
                            f"{names} (see GET /v1/models)", "model")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load an adapter and serve it as ``name`` (400 if it is bad or the name is taken)."""
        from minivllm.lora.request import LoRARequest

        if name == self.model_name or name in self.lora_modules:
            raise APIError(400, f"the name {name[:100]!r} is already served", "lora_name")
        ids = [r.lora_int_id for r in self.lora_modules.values()]
        try:
            lora = LoRARequest(name, max(ids, default=0) + 1, path)
            await self.llm.add_lora(lora)
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        self.lora_modules[name] = lora

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter (400 while a request uses it, 404 if unknown)."""
        lora = self.lora_modules.get(name)
        if lora is None:
            raise APIError(404, f"no adapter named {name[:100]!r} is served", "lora_name")
        try:
            await self.llm.remove_lora(lora.lora_int_id)
        except ValueError as e:
            raise APIError(400, str(e), "lora_name") from None
        del self.lora_modules[name]

    def check_token_ids(self, ids: list[int], field_name: str, max_len: int) -> None:
        """400 unless ``ids`` is at most ``max_len`` ids (checked first), each in the vocabulary."""
        if len(ids) > max_len:
            raise APIError(400, f"{field_name} has {len(ids)} tokens, more than {max_len}",
                           field_name)
        vocab = self.llm.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{field_name} must be in [0, {vocab}), got {bad[:5]}",
                           field_name)

    async def chat_prompt(self, req) -> list[int]:
        """Token ids of ``req.messages`` through the chat template, with the request's
        template options (a chat completion or a ``/tokenize`` request); 400 naming the
        field for options that cannot be honoured."""
        if req.chat_template is not None and not self.chat_templates.trust_request_template:
            raise APIError(400, "chat_template from a request needs the server's "
                                "--trust-request-chat-template (a template is code the "
                                "server runs); leave it out", "chat_template")
        # vLLM describes the tools to the template even with tool_choice "none", unless
        # --exclude-tools-when-tool-choice-none.
        none = getattr(req, "tool_choice", None) == "none"
        tools = None if none and self.tool_options.exclude_tools_when_tool_choice_none \
            else [t.model_dump(exclude_none=True) for t in req.tools or []]
        options = ChatOptions(req.chat_template or self.chat_templates.template,
                              req.add_generation_prompt, req.continue_final_message,
                              tools, req.chat_template_kwargs, getattr(req, "documents", None))
        conv = [m.for_template() for m in req.messages]
        check_prompt_chars(self.limits, sum(len(m["content"]) for m in conv), "messages")
        for m in conv:
            check_text(m["content"], "messages")
        return await self.off_loop(self._apply_chat_template, conv, options,
                                   getattr(req, "add_special_tokens", False))

    def _apply_chat_template(self, conv: list[dict], options: ChatOptions,
                             add_special_tokens: bool = False) -> list[int]:
        try:
            text = render_chat(self.tokenizer, conv, options)
        except ValueError as e:
            msg = str(e)
            field = next((f for f in ("chat_template_kwargs", "continue_final_message",
                                      "chat_template") if msg.startswith(f)), "messages")
            raise APIError(400, msg, field) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """``prompt``'s token ids, after checking its length in characters."""
        check_prompt_chars(self.limits, len(prompt))
        check_text(prompt)
        return await self.off_loop(self.tokenizer.encode, prompt,
                                   add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (``/detokenize``), after checking their number and range."""
        self.check_token_ids(ids, "tokens", self.limits.max_detokenize_tokens)
        return await self.off_loop(self.tokenizer.decode, ids)

    # -- the two endpoints -----------------------------------------------------------

    async def create_completion(self, req: CompletionRequest):
        """A response dict, or (``stream=true``) an async iterator of SSE strings."""
        lora = self.check_model(req.model)
        req.check_fields()
        texts = req.prompts()
        req.check_limits(self.limits, len(texts))
        # Token-id prompts are checked by the engine (length first, then the vocabulary).
        prompts = [p if isinstance(p, list) else await self.encode(p, req.add_special_tokens)
                   for p in texts]
        kind = Kind("cmpl", "text_completion", chat=False, model=req.model or self.model_name,
                    top_n=req.logprobs or 0, req=req)
        if req.echo:  # the completion text starts with the prompt's (vLLM's echo)
            kind.echo = [p if isinstance(p, str) else await self.decode(p) for p in texts]
        return await self._create(req, prompts, kind, lora, request_constraint(req))

    async def create_chat_completion(self, req: ChatCompletionRequest):
        """A response dict, or (``stream=true``) an async iterator of SSE strings."""
        lora = self.check_model(req.model)
        req.check_fields()
        req.check_limits(self.limits)
        parser = self.tool_options.parser
        constraint = request_constraint(req, auto_tools=parser is not None)  # 400s first
        prompt = await self.chat_prompt(req)
        tools = constraint.tools if constraint is not None else None
        if tools is None and req.tools and req.tool_choice in (None, "auto"):
            tools = AutoToolCalls(parser, self.tokenizer)  # the model's own calls, parsed
        kind = Kind("chatcmpl", "chat.completion", chat=True, model=req.model or self.model_name,
                    top_n=req.top_logprobs or 0, req=req, tools=tools)
        kind.echo = [req.echo_text()] if req.echo else None
        return await self._create(req, [prompt], kind, lora, constraint)

    # -- shared machinery --------------------------------------------------------------

    async def _create(self, req, prompts: list[list[int]], kind: Kind, lora=None,
                      constraint: Constraint | None = None):
        params = req.engine_params(self.default_sampling)
        if constraint is not None:  # a beam search's beams each follow it too
            try:
                params = dataclasses.replace(params, structured_outputs=constraint.params)
            except ValueError as e:  # a beam search with ignore_eos
                raise APIError(400, f"{constraint.field}: {e}", constraint.field) from None
        batch = [(prompt, params, f"{kind.engine_id}-{p_idx}", lora, req.priority)
                 for p_idx, prompt in enumerate(prompts)]
        try:
            # One command for the whole request: its prompts start in the same step.
            streams = await self.llm.add_requests(batch)  # n per prompt, in choice order
        except InvalidRequestError as e:
            if constraint is not None and e.reason.startswith(f"{constraint.params.kind}: "):
                raise compile_error(constraint, e.reason) from None  # the same for every prompt
            where = f"prompt {e.index}: " if len(prompts) > 1 else ""
            # The group's own checks name n (as beam_width, for a beam search).
            field = "n" if e.reason.startswith(("n=", "n ", "beam_width")) else next(
                (f for f in _PARAM_FIELDS if e.reason.startswith(f)), "prompt")
            raise APIError(400, where + e.reason, field) from None
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        except QueueFullError as e:
            raise APIError(503, str(e)) from None
        except EngineDeadError as e:
            raise APIError(500, str(e)) from None
        # Once per prompt, whatever n; as the engine kept it (truncate_prompt_tokens).
        keep = getattr(params, "truncate_prompt_tokens", None)
        keep = self.llm.max_model_len if keep == -1 else keep
        num_prompt_tokens = sum(len(p) if keep is None else min(len(p), keep) for p in prompts)
        if req.stream:
            # vLLM's continuous_usage_stats: usage so far on every chunk (with include_usage).
            every = req.include_usage() and req.stream_options.continuous_usage_stats
            return self._stream(streams, kind, num_prompt_tokens, req.include_usage(), every)
        return await self._full(streams, kind, num_prompt_tokens)

    async def _full(self, streams: list[RequestStream], kind: Kind,
                    num_prompt_tokens: int) -> dict:
        """Wait for every completion; return the whole response."""
        texts = [""] * len(streams)
        token_ids: list[list[int]] = [[] for _ in streams]
        logprobs: list[list] = [[] for _ in streams]
        last: list[StreamDelta | None] = [None] * len(streams)
        prompt_lps: list[list | None] = [None] * len(streams)
        try:
            async with contextlib.aclosing(merge(self.llm, streams)) as deltas:
                async for i, d in deltas:
                    if last[i] is None:  # the first delta: echo, and the prompt's logprobs
                        prompt_lps[i] = d.prompt_logprobs
                        texts[i], token_ids[i], logprobs[i] = kind.echoed(i, d, streams)
                    texts[i] += d.text
                    token_ids[i] += d.token_ids
                    logprobs[i] += d.logprobs or []
                    last[i] = d
        except (EngineDeadError, RequestError) as e:
            raise APIError(500, str(e)) from None
        choices = []
        for i, d in enumerate(last):
            lp = openai_logprobs(kind.decode or self.tokenizer.decode, kind.chat, kind.top_n,
                                 logprobs[i], token_ids[i]) if d.logprobs is not None else None
            choice = {"index": i, "finish_reason": d.finish_reason, "logprobs": lp}
            if prompt_lps[i] is not None and not kind.chat:  # vLLM's, on the choice
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[i])
            if kind.tools is not None:  # the answer is whole: OpenAI's tool calls, if any
                choice["message"], choice["finish_reason"] = kind.tools.reply(texts[i],
                                                                              d.finish_reason)
            elif kind.chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
            else:
                choice["text"] = texts[i]
            choice["stop_reason"] = d.stop_reason
            choices.append(choice)
        num_out = sum(d.num_output_tokens for d in last)
        response = kind.envelope(choices, usage(num_prompt_tokens, num_out))
        if kind.chat and prompt_lps[0] is not None:  # vLLM's, on the response
            response["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[0])
        return response

    async def _stream(self, streams: list[RequestStream], kind: Kind, num_prompt_tokens: int,
                      include_usage: bool, continuous_usage: bool = False,
                      ) -> AsyncIterator[str]:
        """SSE chunks: deltas, ``finish_reason`` on each choice's last one, usage, [DONE].

        ``continuous_usage``: every delta chunk also carries the usage so far."""
        num_out = [0] * len(streams)
        echoed = [False] * len(streams)
        chunk = kind.chunk
        calls = None if kind.tools is None else [kind.tools.stream() for _ in streams]
        try:
            if kind.chat:
                yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
                                 for i in range(len(streams))]))
            async with contextlib.aclosing(merge(self.llm, streams)) as deltas:
                async for i, d in deltas:
                    # One chunk per delta the client reads, even when its text is held
                    # back (a possible stop string) or incomplete: a client keeping up
                    # gets one per engine step; one that falls behind, merged deltas.
                    num_out[i] = d.num_output_tokens
                    text, ids, entries = kind.echoed(i, d, streams) if not echoed[i] \
                        else ("", [], [])
                    echoed[i] = True
                    text, ids, entries = text + d.text, ids + d.token_ids, \
                        entries + (d.logprobs or [])
                    lp = openai_logprobs(kind.decode or self.tokenizer.decode, kind.chat,
                                         kind.top_n, entries, ids) if d.logprobs else None
                    body = {"delta": {"content": text}} if kind.chat else {"text": text}
                    finish = d.finish_reason
                    if calls is not None:
                        delta, finish = calls[i].delta(d.text, d.finish_reason)
                        body = {"delta": delta}
                    so_far = usage(num_prompt_tokens, sum(num_out)) if continuous_usage \
                        else None
                    yield sse(chunk([{"index": i, **body, "logprobs": lp,
                                      "finish_reason": finish,
                                      "stop_reason": d.stop_reason}], so_far))
            if include_usage:
                yield sse(chunk([], usage(num_prompt_tokens, sum(num_out))))
            yield sse("[DONE]")
        except (EngineDeadError, RequestError) as e:
            yield sse(APIError(500, str(e)).body())


class Kind:
    """What differs between the two endpoints: ids, object names and chunk shape."""

    def __init__(self, prefix: str, obj: str, chat: bool, model: str, top_n: int,
                 tools: ToolCallFormat | AutoToolCalls | None = None, req=None) -> None:
        nonce = uuid.uuid4().hex
        # vLLM's request_id names the response; the engine's ids stay unique anyway.
        self.id = f"{prefix}-{getattr(req, 'request_id', None) or nonce}"
        self.engine_id = f"{prefix}-{nonce}"
        # vLLM's return_tokens_as_token_ids: logprob tokens written "token_id:42".
        self.decode = (lambda ids: f"token_id:{ids[0]}") \
            if getattr(req, "return_tokens_as_token_ids", False) else None
        self.obj, self.chat, self.model, self.top_n = obj, chat, model, top_n
        self.tools = tools  # the answer holds tool calls (chat with tools and tool_choice)
        self.echo: list[str] | None = None  # echo: each prompt's text (chat: the last message's)
        self.created = int(time.time())

    def echoed(self, i: int, d: StreamDelta, streams: list) -> tuple[str, list[int], list]:
        """What choice ``i``'s text, token ids and logprob entries start with: with
        ``echo``, its prompt's (the first entry None: nothing scores the first token)."""
        if self.echo is None or self.chat:  # chat: the last message's text, no tokens
            return ("" if self.echo is None else self.echo[0]), [], []
        prompt = self.echo[i * len(self.echo) // len(streams)]  # n choices per prompt
        ids = list(d.prompt_token_ids)
        return prompt, ids, list(d.prompt_logprobs or [None] * len(ids))

    def envelope(self, choices: list[dict], usage_: dict | None) -> dict:
        return {"id": self.id, "object": self.obj, "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_}

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}


def usage(num_prompt: int, num_completion: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


async def merge(llm: AsyncLLM, streams: list[RequestStream]
                ) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Yield ``(index, delta)`` from several request streams as their deltas arrive.

    Each stream's next delta is fetched only once the consumer has taken the
    previous one, so a consumer that falls behind leaves the deltas in their
    streams, where they are merged (bounded), never in a queue here. If the
    consumer stops early (a client hung up) and closes this generator, every
    inner generator is closed explicitly, which aborts its engine request at
    once rather than whenever garbage collection finalizes it.
    """
    gens = [llm.stream_outputs(s) for s in streams]
    pending: dict[asyncio.Future, int] = {}
    try:
        if len(gens) == 1:  # no tasks needed
            async for d in gens[0]:
                yield 0, d
            return
        pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                d = task.result()  # an engine failure is raised here
                yield i, d
                if not d.finished:
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()
