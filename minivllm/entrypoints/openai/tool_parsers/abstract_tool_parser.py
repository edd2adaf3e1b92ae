"""What every tool parser shares (vLLM's ``ToolParser``): text in, OpenAI tool calls out.

A model trained for tool use writes its calls in a format of its own (Hermes'
``<tool_call>{...}</tool_call>``, Llama 3's bare ``{"name": ..., "parameters":
...}``); with ``tool_choice="auto"`` the server reads them back out of the text.
A parser is a small state machine over the text so far. A subclass says how a
call is marked (:meth:`ToolParser._advance`); this class reads the call's JSON
(:class:`~.json_scan.ObjectScanner`), decides what is content, and keeps the
answer the same whether the text comes whole or in pieces:

- :meth:`extract_tool_calls` parses a whole answer (the non-streamed reply);
- :meth:`extract_tool_calls_streaming` is fed each text delta and returns the
  OpenAI ``delta`` to send (None: nothing yet), :meth:`finish_streaming` the rest.

The streamed pieces add up to the non-streamed parse for every way of cutting
the text (``tests/test_tool_parsers.py`` cuts it at random). For that:

- A call is announced (``index``, ``id``, ``type``, ``function.name``) once its
  name is read and its arguments have begun with ``{``; its arguments then
  stream as the model writes them. ``arguments`` is the model's own JSON text
  of the object (vLLM re-serializes it, which gives the same text for a model
  that writes ``json.dumps``' spacing).
- Text that could still become a marker (``<tool_`` ...) is held back until it
  is known not to be one; text outside the calls is ``content``, except a run of
  whitespace only (the newlines between two calls), which is dropped once the
  answer holds a call.
- A call that proves malformed before it was announced (not JSON, no name,
  arguments that are no object) is content, and so is all that follows it.

What the stream cannot take back: a call whose JSON breaks after it was
announced, or that the answer's end (``max_tokens``) cuts short. The
non-streamed reply is then the whole text as content, as vLLM's parsers answer;
the stream has already sent the call's start (vLLM's parsers do the same), and
the choice ends with the engine's ``finish_reason``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from minivllm.entrypoints.openai.tool_parsers.json_scan import ObjectScanner


def make_tool_call_id() -> str:
    """A tool call's id, as vLLM makes them: ``chatcmpl-tool-<hex>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ExtractedToolCallInformation:
    """A whole answer, parsed: OpenAI ``tool_calls`` and the ``content`` beside them."""

    tools_called: bool
    tool_calls: list[dict]
    content: str | None


@dataclass
class _Call:
    """A call announced to the client, and how much of its arguments went out."""

    name: str
    id: str
    arguments_key: str | None  # None: the object closed without arguments ("{}")
    sent: int  # index in the text up to which the arguments have been sent
    complete: bool = False


class ToolParser:
    """The base of a model family's tool-call parser; one instance per answer.

    Subclasses set :attr:`name` (``--tool-call-parser NAME``) and
    :attr:`arguments_keys`, and implement :meth:`_advance`. ``tokenizer`` is
    vLLM's constructor argument; the parsers here read text only.
    """

    name: ClassVar[str] = ""
    #: The key of a call's arguments; the first one found is taken (Llama 3 writes
    #: "parameters" or "arguments", never both).
    arguments_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # the answer so far
        self.pos = 0  # text[:pos] is decided
        self.state = "start"
        self.calls: list[_Call] = []
        self.scan: ObjectScanner | None = None  # the call being read
        self.call_start = 0  # where its text began (its marker included)
        self.object_at = 0  # where its JSON may begin (after the marker)
        self.broken = False  # an announced call turned out malformed or cut short
        self._segment_has_text = False  # the content since the last call is not blank
        self._blank = ""  # whitespace held until the segment shows text
        self._events: list[tuple] = []  # what this feed produced, for the delta

    # -- the interface ---------------------------------------------------------------

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The tool calls of a whole answer, and the content beside them; an answer
        without a well-formed call is all content (``tools_called`` False)."""
        parser = type(self)(self.tokenizer)  # a fresh machine: this one may be streaming
        parser.text = model_output
        parser._finish()
        if not parser.tools_called:
            return ExtractedToolCallInformation(False, [], model_output)
        content = "".join(e[1] for e in parser._events if e[0] == "content")
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
                 for c in parser.calls]
        for event in parser._events:
            if event[0] == "arguments":
                calls[event[1]]["function"]["arguments"] += event[2]
        return ExtractedToolCallInformation(True, calls, content or None)

    def extract_tool_calls_streaming(self, delta_text: str) -> dict | None:
        """Feed the next piece of the answer; the OpenAI ``delta`` to send (None: none)."""
        self.text += delta_text
        self._advance(final=False)
        return self._take_delta()

    def finish_streaming(self) -> dict | None:
        """The answer ended: the ``delta`` of what was held back (None: nothing)."""
        self._finish()
        return self._take_delta()

    @property
    def tools_called(self) -> bool:
        """The answer holds calls, all of them whole and well formed."""
        return bool(self.calls) and not self.broken and all(c.complete for c in self.calls)

    # -- for subclasses --------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        """Decide as much of ``text[pos:]`` as can be decided (all of it if ``final``),
        through :meth:`_content`, :meth:`_start_call` and :meth:`_read_call`."""
        raise NotImplementedError

    def _content(self, text: str) -> None:
        """Text outside the calls; a blank run is held until the segment shows text."""
        if not text:
            return
        if self._segment_has_text:
            self._events.append(("content", text))
        elif text.strip():
            self._events.append(("content", self._blank + text))
            self._blank, self._segment_has_text = "", True
        else:
            self._blank += text

    def _start_call(self, marker_at: int, object_at: int) -> bool:
        """A call's marker begins at ``marker_at``; its JSON should begin at or after
        ``object_at``. Returns False while only whitespace follows (wait for more);
        a call that does not begin with ``{`` makes the rest content."""
        rest = self.text[object_at:]
        brace = len(rest) - len(rest.lstrip())
        if brace == len(rest):
            return False
        self.call_start = marker_at
        if rest[brace] != "{":
            self._give_up(marker_at)
            return True
        self.scan, self.state = ObjectScanner(object_at + brace), "call"
        return True

    def _read_call(self, final: bool) -> bool:
        """Read the call begun by :meth:`_start_call`. True once it is over (whole: the
        state is "after", ``pos`` past its ``}``; else the state is "text")."""
        scan = self.scan
        scan.feed(self.text)
        announced = len(self.calls) > 0 and not self.calls[-1].complete
        if not announced and not self._announce(scan):
            self._give_up(self.call_start)  # malformed before it was announced: content
            return True
        call = self.calls[-1] if self.calls and not self.calls[-1].complete else None
        if call is not None and call.arguments_key is not None:
            start, end = scan.spans[call.arguments_key]
            upto = scan.pos if end is None else end
            if upto > call.sent:
                self._events.append(("arguments", len(self.calls) - 1,
                                     self.text[call.sent:upto]))
                call.sent = upto
        if scan.error is None and scan.end is None and not final:
            return False
        if call is None:  # the text ended before the call could be announced
            self._give_up(self.call_start)
        elif scan.end is None or not self._well_formed(scan, call):
            self.broken = True  # announced, then malformed or cut short
            self._give_up(scan.pos if scan.end is None else scan.end)
        else:
            if call.arguments_key is None:
                self._events.append(("arguments", len(self.calls) - 1, "{}"))
            call.complete = True
            self.pos, self.state = scan.end, "after"
            self._segment_has_text = False  # the content after it is a new segment
        return True

    def _give_up(self, at: int) -> None:
        """Everything from ``at`` on is content (no more calls are looked for)."""
        self.pos, self.state, self.scan = at, "text", None

    # -- the machinery -----------------------------------------------------------------

    def _announce(self, scan: ObjectScanner) -> bool:
        """Announce the call once its name is read and its arguments began with ``{``
        (or it closed without them). False: it is malformed; True: announced, or not
        decidable yet. Every test here looks at what the scanner has read, which only
        grows, so the answer does not depend on how the text was cut."""
        spans, text = scan.spans, self.text
        present = [k for k in self.arguments_keys if k in spans]
        key = min(present, key=lambda k: spans[k][0]) if present else None
        if key is not None and text[spans[key][0]] != "{":
            return False  # arguments that are no object
        name_span = spans.get("name")
        if name_span is not None and text[name_span[0]] != '"':
            return False  # a name that is no string
        if name_span is None or name_span[1] is None or (key is None and scan.end is None):
            return not scan.done  # wait for the name and the arguments, unless it is over
        name = scan_string(text[name_span[0]:name_span[1]])
        if name is None:
            return False
        self._blank = ""  # whitespace just before a call is dropped
        self.calls.append(_Call(name, make_tool_call_id(), key,
                                spans[key][0] if key is not None else 0))
        self._events.append(("call", len(self.calls) - 1))
        return True

    def _well_formed(self, scan: ObjectScanner, call: _Call) -> bool:
        try:
            obj = scan.loads(self.text)
        except ValueError:
            return False
        keys = [k for k in self.arguments_keys if k in obj]
        args = obj.get(call.arguments_key) if keys else {}
        return obj.get("name") == call.name and len(keys) <= 1 and isinstance(args, dict)

    def _finish(self) -> None:
        self._advance(final=True)
        if not self.calls and self._blank:  # an answer of whitespace only is content
            self._events.append(("content", self._blank))
            self._blank = ""

    def _take_delta(self) -> dict | None:
        """This feed's events as one OpenAI ``delta`` (content and tool call pieces)."""
        events, self._events = self._events, []
        content = "".join(e[1] for e in events if e[0] == "content")
        pieces: dict[int, dict] = {}
        for event in events:
            if event[0] == "call":
                call = self.calls[event[1]]
                pieces[event[1]] = {"index": event[1], "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}
            elif event[0] == "arguments":
                piece = pieces.setdefault(event[1], {"index": event[1],
                                                     "function": {"arguments": ""}})
                piece["function"]["arguments"] += event[2]
        delta: dict = {}
        if content:
            delta["content"] = content
        if pieces:
            delta["tool_calls"] = list(pieces.values())
        return delta or None


def scan_string(raw: str) -> str | None:
    """A JSON string literal's value (None if ``raw`` is not one)."""
    import json

    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def held_prefix(text: str, start: int, marker: str) -> int:
    """How many characters at the end of ``text[start:]`` could begin ``marker``
    (they are held back until the next delta shows whether they do)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - k:]):
            return k
    return 0
