"""Structured outputs and tool calls on the OpenAI API: request fields to a constraint, and back.

Three request fields can constrain what the model writes, and become one
:class:`~minivllm.StructuredOutputsParams`:

- ``structured_outputs`` (vLLM's extra, completions and chat): ``{"json": schema}``,
  ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}`` or
  ``{"json_object": true}``, with vLLM's options ``disable_any_whitespace``,
  ``disable_additional_properties`` and ``whitespace_pattern``
  (``structural_tag`` is refused);
- ``response_format`` (OpenAI's, completions and chat, as vLLM): ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or ``{"type":
  "json_object"}`` (``"text"``: no constraint; ``"structural_tag"``: refused).
  As in vLLM it is merged into ``structured_outputs``: that one's options
  apply to it; both setting a (different) constraint is a 400 (vLLM would let
  ``response_format`` overwrite it without a word);
- ``tools`` with ``tool_choice`` (chat, OpenAI's), as vLLM serves them without
  a model-specific parser:

  - a named function (``{"type": "function", "function": {"name": ...}}``): the
    output is that function's arguments, a JSON object under its
    ``parameters`` schema;
  - ``"required"``: the output is a JSON array of at least one (exactly one
    with ``parallel_tool_calls=false``) ``{"name": ..., "parameters": {...}}``
    objects, each naming one of the tools with arguments under its schema;
  - ``"none"``: no call is parsed, the answer is plain text;
  - ``"auto"`` (OpenAI's default when tools are given): nothing is constrained;
    the server's ``--tool-call-parser`` reads the model's own calls out of the
    answer (:mod:`.tool_parsers`). Without ``--enable-auto-tool-choice`` it is a
    400, as vLLM answers.

  The reply then carries OpenAI's ``tool_calls`` (:meth:`ToolCallFormat.parse`):
  ``content`` null, ``finish_reason`` ``"tool_calls"``.

Every mistake is a 400 naming the field. Whether the schema, regex or grammar
compiles is checked by compiling it (``AsyncLLM`` does, off the event loop,
with the engine's time cap), before the request is queued.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass

from minivllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from minivllm.sampling_params import StructuredOutputsParams


def _no_parameters() -> dict:
    """The JSON schema of a function without ``parameters``: an object with no property."""
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a constrained answer becomes OpenAI ``tool_calls``.

    Attributes:
        named: the one function of a named ``tool_choice`` (the answer is its
            arguments), or None for ``"required"`` (the answer is a JSON array of
            ``{"name", "parameters"}`` objects).
    """

    named: str | None

    def parse(self, text: str) -> list[dict] | None:
        """The tool calls the answer holds, or None if it is not a whole one (cut short)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [tool_call(self.named, text)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
            return None
        return [tool_call(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False))
                for v in value]

    def reply(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's ``message`` (tool calls, or text if it does not parse),
        and the choice's ``finish_reason``."""
        calls = self.parse(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def stream(self) -> ToolCallStream:
        """The tool calls of one streamed choice."""
        return ToolCallStream(self)


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Constraint:
    """What a request asks for: the engine's constraint, the field it came from (named in
    a 400), and how the answer becomes tool calls (None: it stays text)."""

    params: StructuredOutputsParams
    field: str
    tools: ToolCallFormat | None = None


def request_constraint(req, auto_tools: bool = False) -> Constraint | None:
    """The constraint a completion or chat request asks for (None: none); 400 on a mistake.

    ``auto_tools``: the server parses calls for ``tool_choice="auto"`` (else it is a 400)."""
    found: list[Constraint] = []
    so, rf = req.structured_outputs, req.response_format
    if rf is not None and rf.type != "text":
        found.append(_from_response_format(rf, so))
    elif so is not None:
        found.append(_from_extra(so))
    if isinstance(req, ChatCompletionRequest):
        tools = _from_tools(req, auto_tools)
        if tools is not None:
            found.append(tools)
    if len(found) > 1:
        names = ", ".join(c.field.split(".")[0] for c in found)
        raise APIError(400, f"only one of structured_outputs, response_format and a "
                            f"tool_choice that calls a tool may constrain the output; got "
                            f"{names}", found[0].field.split(".")[0])
    return found[0] if found else None


def compile_error(constraint: Constraint, reason: str) -> APIError:
    """The 400 for a constraint the engine refused (``reason``: the component's message,
    ``"kind: detail"``), naming the request field it came from."""
    detail = reason.split(": ", 1)[1] if reason.startswith(f"{constraint.params.kind}: ") \
        else reason
    return APIError(400, f"{constraint.field}: {detail}", constraint.field)


def _params(field: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:  # the message names the field already, or gets it here
        option = next((o for o in _OPTIONS if str(e).startswith(o)), None)
        if option is not None:  # a JSON option of structured_outputs
            field = f"structured_outputs.{option}"
            raise APIError(400, f"structured_outputs.{e}", field) from None
        message = str(e) if str(e).startswith("structured_outputs") else f"{field}: {e}"
        raise APIError(400, message, field) from None


_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def _constraint_fields(so) -> dict:
    """The constraint ``structured_outputs`` sets (``{"json": ...}``; ``{}``: none)."""
    if so.structural_tag is not None:
        raise APIError(400, "structured_outputs.structural_tag (xgrammar's tagged regions) "
                            "is not supported by minivllm; use json, regex, choice, grammar "
                            "or json_object", "structured_outputs.structural_tag")
    kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
          "json_object": so.json_object}
    return {k: v for k, v in kw.items() if v is not None and v is not False}


def _options(so) -> dict:
    return {} if so is None else {k: getattr(so, k) for k in _OPTIONS}


def _from_extra(so) -> Constraint:
    chosen = _constraint_fields(so)
    field = f"structured_outputs.{next(iter(chosen))}" if len(chosen) == 1 \
        else "structured_outputs"
    return Constraint(_params(field, **chosen, **_options(so)), field)


def _from_response_format(rf, so) -> Constraint:
    """``response_format``'s constraint, with ``structured_outputs``' options (vLLM's merge)."""
    if rf.type == "structural_tag":
        raise APIError(400, "response_format type 'structural_tag' (xgrammar's tagged "
                            "regions) is not supported by minivllm; use 'json_schema', "
                            "'json_object' or 'text'", "response_format")
    if rf.type == "json_object":
        field, mine = "response_format", {"json_object": True}
    else:
        field = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, f"{field} is required with response_format type "
                                f"'json_schema'", field)
        mine = {"json": rf.json_schema.schema_}
    theirs = _constraint_fields(so) if so is not None else {}
    if theirs and theirs != mine:
        raise APIError(400, f"response_format and structured_outputs.{next(iter(theirs))} "
                            f"both constrain the output; send one (structured_outputs may "
                            f"still carry options such as disable_any_whitespace)",
                       "response_format")
    return Constraint(_params(field, **mine, **_options(so)), field)


def _from_tools(req: ChatCompletionRequest, auto_tools: bool) -> Constraint | None:
    choice, tools = req.tool_choice, req.tools or []
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {_show(choice)} needs tools", "tools")
    if choice in (None, "auto"):
        if auto_tools:
            return None  # the answer is free; a tool parser reads calls out of it
        raise APIError(400, "tool_choice 'auto' (the default with tools) requires the "
                            "server's --enable-auto-tool-choice and --tool-call-parser, as "
                            "in vLLM; or use tool_choice 'required', a named function, or "
                            "'none'", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools must have distinct function names, got {names}", "tools")
    if choice == "required":
        schema = _required_schema(req)
        return Constraint(_params("tools", json=schema), "tools", ToolCallFormat(None))
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice.function.name {name[:100]!r} is not one of the "
                            f"tools: {names}", "tool_choice")
    i = names.index(name)
    field = f"tools[{i}].function.parameters"
    schema = tools[i].function.parameters or _no_parameters()
    return Constraint(_params(field, json=schema), field, ToolCallFormat(name))


def _required_schema(req: ChatCompletionRequest) -> dict:
    """vLLM's schema for ``tool_choice="required"``: an array of ``{"name", "parameters"}``
    objects, one alternative per tool. ``$defs`` move to the root, where references
    (``#/$defs/...``) resolve."""
    defs: dict[str, dict] = {}  # "$defs" / "definitions" -> name -> schema
    options = []
    for i, tool in enumerate(req.tools):
        params = copy.deepcopy(tool.function.parameters or _no_parameters())
        for key in ("$defs", "definitions"):
            for name, d in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, d) != d:
                    raise APIError(400, f"tools[{i}].function.parameters: {key} {name!r} "
                                        f"differs from another tool's", "tools")
        options.append({"type": "object", "properties": {
            "name": {"enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"]})
    schema = {"type": "array", "items": {"anyOf": options} if len(options) > 1 else options[0],
              "minItems": 1}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def _show(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class ToolCallStream:
    """One streamed choice's tool calls, as OpenAI's ``delta.tool_calls`` chunks.

    A named function's arguments are the answer itself, so they stream as they
    come (the first chunk carries the call's id and name, the next ones only
    ``function.arguments`` pieces, as vLLM streams them). A ``"required"``
    answer is an array that only parses whole, so its calls come in one chunk
    at the end. An answer that does not parse (cut by ``max_tokens``) ends as
    text with its own ``finish_reason``.
    """

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.call_id: str | None = None

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The chunk's ``delta`` for the new ``text``, and the choice's ``finish_reason``."""
        self.text += text
        delta: dict = {}
        if self.fmt.named is not None and (text or self.call_id is None):
            if self.call_id is None:
                call = tool_call(self.fmt.named, text)
                self.call_id = call["id"]
                delta = {"tool_calls": [{"index": 0, **call}]}
            else:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if finish_reason is None:
            return delta, None
        calls = self.fmt.parse(self.text)
        if calls is None:
            return (delta if self.fmt.named is not None else {"content": self.text}), finish_reason
        if self.fmt.named is None:
            delta = {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
        return delta, "tool_calls"
