"""A conversation to a prompt through a chat template, as vLLM renders one.

Both front ends use it: ``LLM.chat`` offline and ``/v1/chat/completions`` (and
``/tokenize`` with ``messages``) over HTTP, with vLLM's names for the options:

- ``chat_template``: a Jinja template (the text, or a file holding it) instead of the
  tokenizer's own. Offline it is always taken; a server takes it from a request only
  with ``--trust-request-chat-template`` (vLLM's rule: a template is code the server
  runs), and uses ``--chat-template`` in place of the tokenizer's for every request.
- ``add_generation_prompt``: end with the assistant's turn header, so the model answers.
- ``continue_final_message``: leave the last message open (no end-of-turn), so the model
  continues it (a prefilled answer); it cannot be combined with ``add_generation_prompt``.
- ``tools``: the function definitions the template describes to the model.
- ``chat_template_kwargs``: more variables for the template (``enable_thinking`` ...).
- ``documents``: ``[{"title": ..., "text": ...}, ...]`` for templates that describe
  retrieved documents to the model (RAG); a template that does not read them ignores them.

Messages keep what a multi-turn agent loop needs: an assistant message's ``tool_calls``
(their JSON ``arguments`` string parsed to an object, as templates index into it, as vLLM
does) and a ``tool`` message's ``tool_call_id`` and ``name``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Names a template's extra variables may not take: they are apply_chat_template's own.
RESERVED_KWARGS = frozenset({"conversation", "chat_template", "tokenize", "tools",
                             "add_generation_prompt", "continue_final_message",
                             "return_dict", "return_tensors", "documents", "messages"})


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s value: a file's text, or the template itself (None: none).

    A value that names no file and holds no Jinja (``{{`` or ``{%``) is a mistyped
    path: ``ValueError`` naming it.
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template long enough to be no path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template must be a Jinja template or a file holding one; "
                     f"{value!r} is neither (no such file)")


@dataclass(frozen=True)
class ChatTemplates:
    """A server's templates: ``--chat-template`` (its text; None: the tokenizer's) and
    whether a request's own ``chat_template`` is taken (``--trust-request-chat-template``;
    a request's value is template text, never a path on the server)."""

    template: str | None = None
    trust_request_template: bool = False


@dataclass(frozen=True)
class ChatOptions:
    """How one conversation is templated (vLLM's ``LLM.chat`` / chat request fields)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    def check(self) -> None:
        """``ValueError`` naming the field for options no template can honour."""
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message cannot be combined with "
                             "add_generation_prompt (the last message is either left open "
                             "or followed by the assistant's turn); set one to False")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be an object, "
                             f"got {type(kwargs).__name__}")
        clash = sorted(RESERVED_KWARGS.intersection(kwargs or {}))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash}: pass them as "
                             f"their own fields")


def _tool_call(call: Any) -> dict:
    """An OpenAI tool call with its ``arguments`` as an object (templates index into it)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError("messages: a tool call is {'id', 'type': 'function', "
                         "'function': {'name', 'arguments'}}")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"messages: a tool call's arguments must be a JSON object, "
                             f"got {args[:60]!r}") from None
    return {**call, "function": fn}


def conversation(messages: list[dict]) -> list[dict]:
    """OpenAI messages as a template reads them: role, content, and the tool fields."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def render_chat(tokenizer: Any, messages: list[dict], options: ChatOptions) -> str:
    """The prompt text of ``messages`` (OpenAI's shape) under ``options``.

    ``ValueError`` (naming the field) for a model without a template, options that
    clash, or a template that fails to render; never a Jinja traceback.
    """
    options.check()
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("chat_template: this model has no chat template; pass one "
                         "(chat_template=..., --chat-template) or use plain prompts")
    try:
        return tokenizer.apply_chat_template(
            conversation(messages), chat_template=template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tools=options.tools or None, documents=options.documents,
            **(options.chat_template_kwargs or {}))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- a template is user code: any error is theirs
        raise ValueError(f"chat_template failed to render: {type(e).__name__}: "
                         f"{str(e)[:200]}") from None
