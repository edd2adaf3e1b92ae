"""Llama 3.x's JSON tool calls (``--tool-call-parser llama3_json``).

With a template that asks for JSON calls (vLLM's ``tool_chat_template_llama3.1_json``),
Llama 3.1-3.3 answer a call with nothing but the call, optionally after the
``<|python_tag|>`` token (kept in the text only with ``skip_special_tokens=false``),
several of them separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}

The answer is tool calls only if it begins with one (after whitespace), as
vLLM's streaming parser decides; otherwise it is all content. Text after the
last call is content. See :mod:`.abstract_tool_parser` for the rest.
"""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), ``;``-separated."""

    name = "llama3_json"
    arguments_keys = ("parameters", "arguments")

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == "text":
                self._content(text[self.pos:])
                self.pos = len(text)
                return
            if self.state == "start":  # calls only if the answer begins with one
                rest = text[self.pos:]
                head = rest.lstrip()
                at = len(text) - len(head)
                if head.startswith(PYTHON_TAG):
                    self.object_at = at + len(PYTHON_TAG)
                elif head.startswith("{"):
                    self.object_at = at
                elif not final and PYTHON_TAG.startswith(head):
                    return
                else:
                    self.state = "text"
                    continue
                self.state = "open"
            if self.state == "open":
                if not self._start_call(self.pos, self.object_at):
                    if not final:
                        return
                    self._give_up(self.pos)
            elif self.state == "call":
                if not self._read_call(final):
                    return
            elif self.state == "after":  # "; {" starts the next call; anything else is content
                head = text[self.pos:].lstrip()
                following = head[1:].lstrip() if head.startswith(";") else None
                if following == "" or not head:
                    if not final:
                        return
                    self.pos = len(text)  # a trailing ";" or blank ends the calls
                    return
                if following is not None and following.startswith("{"):
                    self.object_at, self.state = len(text) - len(following), "open"
                else:
                    self._give_up(self.pos)
