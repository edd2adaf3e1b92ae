"""One JSON object read as it arrives: where each top-level value lies in the text.

A tool parser streams a call's ``arguments`` while the model is still writing
them, so it must know, after every delta, how far the arguments value reaches
and whether the object around it is still well formed. :class:`ObjectScanner`
reads the text one character at a time and keeps just enough state for that:

- strings exactly (an escaped quote does not end one, a brace inside one does
  not count);
- the nesting depth, so the end of a nested value is the brace or bracket that
  brings the depth back to 1;
- the top level as JSON's grammar has it: ``{``, then ``"key"``, ``:``, a value,
  ``,`` or ``}``; anything else there is a syntax error, found at the character
  that breaks it (so is a key given twice).

Inside nested values only the balance is tracked; the whole object is checked
by ``json.loads`` once it closes (:meth:`ObjectScanner.loads`).
"""

from __future__ import annotations

import json

_WHITESPACE = frozenset(" \t\n\r")
_SCALAR_START = frozenset("-0123456789tfn")


class ObjectScanner:
    """Reads one JSON object of ``text`` from index ``start`` on, as the text grows.

    Call :meth:`feed` with the whole text so far after each delta; it reads what
    is new. Afterwards:

    - ``spans[key]``: ``(start, end)`` of that top-level value in the text
      (``end`` None while it is being read);
    - ``end``: the index after the closing ``}``, once the object closed;
    - ``error``: the index of the character that breaks JSON's top-level grammar.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # the next character to read
        self.depth = 0
        self.in_string = False
        self.escape = False
        #: at depth <= 1, what may come next: "{", "key" (or "}" right after "{"), ":",
        #: "value", "scalar" (inside a number / true / false / null), "," (or "}")
        self.expect = "{"
        self.after_open = False  # "}" may end the object here (it is empty)
        self.key: str | None = None  # the top-level key whose value comes next
        self.token_start = 0  # where the key string being read began
        self.spans: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None
        self.error: int | None = None

    @property
    def done(self) -> bool:
        """The object closed, or broke: nothing more will be read."""
        return self.end is not None or self.error is not None

    def feed(self, text: str) -> None:
        """Read ``text[self.pos:]`` until it ends, the object closes or it breaks."""
        i = self.pos
        while i < len(text) and not self.done:
            self._step(text, i, text[i])
            i += 1
        self.pos = i if self.error is None else self.error

    def loads(self, text: str) -> object:
        """The closed object, parsed by ``json.loads`` (``ValueError`` if it is no JSON)."""
        return json.loads(text[self.start:self.end])

    def _step(self, text: str, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self._string_ended(text, i)
            return
        if self.depth >= 2:  # inside a nested value: only balance
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_ended(i + 1)
            return
        if self.expect == "scalar":
            if c not in _WHITESPACE and c not in ",}":
                return
            self._value_ended(i)  # and read c as what follows the value
        if c in _WHITESPACE:
            return
        expect = self.expect
        if expect == "{" and c == "{":
            self.depth, self.expect, self.after_open = 1, "key", True
        elif expect == "key" and c == '"':
            self.in_string, self.token_start = True, i
        elif (expect == "," and c == "}") or (expect == "key" and c == "}" and self.after_open):
            self.depth, self.end = 0, i + 1
        elif expect == "," and c == ",":
            self.expect, self.after_open = "key", False
        elif expect == ":" and c == ":":
            self.expect = "value"
        elif expect == "value" and (c in '"{[' or c in _SCALAR_START):
            self.spans[self.key] = (i, None)
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth = 2
            else:
                self.expect = "scalar"
        else:
            self.error = i

    def _string_ended(self, text: str, i: int) -> None:
        if self.depth >= 2:
            return
        if self.expect == "key":
            try:
                self.key = json.loads(text[self.token_start:i + 1])
            except ValueError:  # a bad escape
                self.error = self.token_start
                return
            if self.key in self.spans:  # a key given twice: which value is meant?
                self.error = self.token_start
                return
            self.expect = ":"
        else:  # a string value at the top level
            self._value_ended(i + 1)

    def _value_ended(self, end: int) -> None:
        self.spans[self.key] = (self.spans[self.key][0], end)
        self.expect = ","
