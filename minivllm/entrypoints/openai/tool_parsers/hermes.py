"""Hermes' tool calls (``--tool-call-parser hermes``): Hermes 2 Pro, Qwen2.5 and Qwen3.

The model writes each call as JSON between tags, possibly after some text::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

gives ``content`` "Let me look that up.\\n" and two tool calls, whose
``arguments`` are ``{"city": "Paris", "unit": "C"}`` and ``{"zone": "CET"}``.
A last call left without its closing tag still counts (the model may stop
right after the ``}``). See :mod:`.abstract_tool_parser` for what is content
and how a stream is cut.
"""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, held_prefix

START, END = "<tool_call>", "</tool_call>"


class Hermes2ProToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them."""

    name = "hermes"
    arguments_keys = ("arguments",)

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == "text":  # no more calls: the rest is content
                self._content(text[self.pos:])
                self.pos = len(text)
                return
            if self.state in ("start", "content"):
                at = text.find(START, self.pos)
                if at < 0:  # content, but hold what may be the tag's beginning
                    end = len(text) - (0 if final else held_prefix(text, self.pos, START))
                    self._content(text[self.pos:end])
                    self.pos = end
                    return
                self._content(text[self.pos:at])
                self.pos, self.state = at, "open"
            if self.state == "open":  # after the tag, before the JSON
                if not self._start_call(self.pos, self.pos + len(START)):
                    if not final:
                        return
                    self._give_up(self.pos)  # the tag and nothing after it: content
            elif self.state == "call":
                if not self._read_call(final):
                    return
            elif self.state == "after":  # a call closed: its end tag, or content
                rest = text[self.pos:]
                blank = len(rest) - len(rest.lstrip())
                if rest.startswith(END, blank):
                    self.pos, self.state = self.pos + blank + len(END), "content"
                elif not final and END.startswith(rest[blank:]):
                    return
                else:
                    self.state = "content"
