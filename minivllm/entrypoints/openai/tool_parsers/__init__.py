"""Tool-call parsers for ``tool_choice="auto"`` (vLLM's ``--enable-auto-tool-choice``).

``minivllm serve --enable-auto-tool-choice --tool-call-parser NAME`` reads a
model's own tool-call format back out of its answers:

==============  ==========================================================
``hermes``      ``<tool_call>{"name", "arguments"}</tool_call>`` (Hermes, Qwen2.5, Qwen3)
``llama3_json`` ``{"name", "parameters"}``, ``;``-separated (Llama 3.1-3.3)
==============  ==========================================================

``--tool-parser-plugin FILE`` adds parsers: every :class:`ToolParser`
subclass the file defines with a ``name`` joins the list (a plugin is code the
server runs, as vLLM's are). :class:`AutoToolCalls` is what a chat request
with ``tool_choice="auto"`` gets: its reply, and its stream.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolParser,
)
from minivllm.entrypoints.openai.tool_parsers.hermes import Hermes2ProToolParser
from minivllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "AutoToolCalls", "ExtractedToolCallInformation", "ToolCallOptions",
           "ToolParser", "get_tool_parser", "import_tool_parser"]

#: The built-in parsers by ``--tool-call-parser`` name.
TOOL_PARSERS = MappingProxyType({cls.name: cls for cls in (Hermes2ProToolParser,
                                                           Llama3JsonToolParser)})


def import_tool_parser(path: str) -> dict[str, type[ToolParser]]:
    """The parsers a ``--tool-parser-plugin`` file defines: its :class:`ToolParser`
    subclasses that have a ``name``. ``ValueError`` if it has none or fails to load."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"minivllm_tool_plugin_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- the plugin is the user's code
        raise ValueError(f"--tool-parser-plugin {path!r} failed to load: "
                         f"{type(e).__name__}: {e}") from None
    found = {cls.name: cls for cls in vars(module).values()
             if isinstance(cls, type) and issubclass(cls, ToolParser) and cls.name
             and cls.__module__ == module.__name__}
    if not found:
        raise ValueError(f"--tool-parser-plugin {path!r} defines no ToolParser subclass "
                         f"with a name")
    return found


def get_tool_parser(name: str, plugin: str | None = None) -> type[ToolParser]:
    """The parser called ``name`` (a built-in, or one of the ``plugin`` file's);
    ``ValueError`` listing the choices if there is none."""
    parsers = {**TOOL_PARSERS, **(import_tool_parser(plugin) if plugin else {})}
    if name not in parsers:
        raise ValueError(f"--tool-call-parser {name!r} is not a tool parser; choose from "
                         f"{', '.join(sorted(parsers))}")
    return parsers[name]


@dataclass(frozen=True)
class ToolCallOptions:
    """A server's tool-calling flags.

    Attributes:
        parser: ``--enable-auto-tool-choice --tool-call-parser NAME``'s parser; None:
            ``tool_choice="auto"`` is a 400, as in vLLM.
        exclude_tools_when_tool_choice_none: leave the tools out of the chat template
            when a request says ``tool_choice="none"`` (vLLM's flag; by default the
            template still describes them).
    """

    parser: type[ToolParser] | None = None
    exclude_tools_when_tool_choice_none: bool = False


class AutoToolCalls:
    """``tool_choice="auto"``: the answer is content, tool calls, or both, as the
    model wrote it; ``finish_reason`` is ``"tool_calls"`` when it called one."""

    def __init__(self, parser: type[ToolParser], tokenizer: Any = None) -> None:
        self.parser, self.tokenizer = parser, tokenizer

    def reply(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's ``message``, and the choice's ``finish_reason``."""
        info = self.parser(self.tokenizer).extract_tool_calls(text)
        if not info.tools_called:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": info.content, "tool_calls": info.tool_calls},
                "tool_calls")

    def stream(self) -> AutoToolCallStream:
        """A parser for one streamed choice."""
        return AutoToolCallStream(self.parser(self.tokenizer))


class AutoToolCallStream:
    """One streamed choice under ``tool_choice="auto"``."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The chunk's ``delta`` for the new ``text``, and the choice's ``finish_reason``."""
        delta = self.parser.extract_tool_calls_streaming(text) or {}
        if finish_reason is None:
            return delta, None
        delta = merge_deltas(delta, self.parser.finish_streaming() or {})
        return delta, "tool_calls" if self.parser.tools_called else finish_reason


def merge_deltas(first: dict, second: dict) -> dict:
    """Two OpenAI deltas as one: contents joined, a call's pieces joined by index."""
    out: dict = {}
    content = first.get("content", "") + second.get("content", "")
    if content:
        out["content"] = content
    calls: dict[int, dict] = {}
    for piece in first.get("tool_calls", []) + second.get("tool_calls", []):
        if piece["index"] not in calls:
            calls[piece["index"]] = {**piece, "function": dict(piece["function"])}
        else:
            fn = calls[piece["index"]]["function"]
            fn["arguments"] = fn.get("arguments", "") + piece["function"].get("arguments", "")
    if calls:
        out["tool_calls"] = list(calls.values())
    return out
