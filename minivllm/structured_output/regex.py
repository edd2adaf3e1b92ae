"""A regex as a tree of character sets: the syntax the ref's compiler reads.

The tree has four kinds of node, and that is all a regular language needs:

- :class:`CharSet`: one character from a set of Unicode code points, kept as
  sorted, disjoint, inclusive ranges (``a`` is ``[(97, 97)]``, ``.`` is
  ``[(0, 0x10FFFF)]``);
- :class:`Concat`: its parts one after another (``Concat(())`` matches ``""``);
- :class:`Alt`: any one of its options;
- :class:`Repeat`: its node between ``min`` and ``max`` times (``max=None``: no limit).

:func:`parse_regex` reads this subset of the usual syntax, with the meanings
xgrammar gives it (so the two twins agree on every pattern the ref reads):

============================  ===============================================
literal characters            any character but ``\\ . [ ] ( ) { } * + ? | ^ $``
``.``                         any character, **newline included**
``\\d \\w \\s`` (``\\D \\W \\S``)  ``[0-9]``, ``[a-zA-Z0-9_]``, Unicode white space
                              (:data:`WHITESPACE`) (and their complements)
``\\n \\t \\r \\f \\v \\0``      the control characters
``\\xHH``, ``\\uHHHH``         a code point in hex (``\\xHH`` not followed by a hex
                              digit: xgrammar would read that digit too)
``\\`` + punctuation           that character (``\\.``, ``\\[``, ``\\\\`` ...)
``[abc] [a-z] [^...]``        classes, negated classes; ``-`` is literal first or last
``* + ? {m} {m,} {m,n}``      repetition (a trailing ``?``, "lazy", is accepted:
                              it changes which match a search finds, not the language)
``a|b``, ``(...)``, ``(?:...)``  alternation, groups
``^`` first, ``$`` last       accepted and ignored: the whole output must match anyway
============================  ===============================================

Anything else (back-references, look-around, ``\\b``, named groups, flags,
``\\p{...}``) raises ``ValueError`` with the position. Characters are code
points, not bytes: :mod:`minivllm.structured_output.automata` spells each one
as its UTF-8 bytes when it builds the automaton.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

#: The largest Unicode code point. Sets are complemented within [0, MAX_CODEPOINT]
#: (surrogates included, as xgrammar's UTF-8 matching does).
MAX_CODEPOINT = 0x10FFFF

#: What ``\s`` matches (xgrammar's set, which is ECMAScript's).
WHITESPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
              (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
              (0xFEFF, 0xFEFF))  # fmt: skip
DIGITS = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))

_META = frozenset("\\.[](){}*+?|^$")
_CONTROL_ESCAPES = MappingProxyType({"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"})


@dataclass(frozen=True)
class CharSet:
    """One character from ``ranges``: sorted, disjoint, inclusive code-point ranges."""

    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Concat:
    """``parts`` one after another; ``Concat(())`` matches the empty string."""

    parts: tuple


@dataclass(frozen=True)
class Alt:
    """Any one of ``options``."""

    options: tuple


@dataclass(frozen=True)
class Repeat:
    """``node`` repeated ``min`` to ``max`` times (``max=None``: unbounded)."""

    node: object
    min: int
    max: int | None


Node = CharSet | Concat | Alt | Repeat


def normalize(ranges) -> tuple[tuple[int, int], ...]:
    """Sort and merge overlapping or touching ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(ranges) -> tuple[tuple[int, int], ...]:
    """Every code point in [0, MAX_CODEPOINT] not in ``ranges``."""
    out, nxt = [], 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


def literal(text: str) -> Node:
    """The node matching exactly ``text``."""
    return Concat(tuple(CharSet(((ord(c), ord(c)),)) for c in text))


def escape(text: str) -> str:
    """``text`` as a pattern that matches it literally (for :func:`parse_regex`)."""
    out = []
    for c in text:
        if c in _META:
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def parse_regex(pattern: str) -> Node:
    """The tree of ``pattern``; ``ValueError`` naming the position if it is outside the subset."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
    parser = _Parser(pattern)
    return parser.parse()


class _Parser:
    """Recursive descent: alternation > concatenation > repetition > atom."""

    def __init__(self, pattern: str) -> None:
        self.s = pattern
        self.i = 0
        # ^ first and $ last are anchors the full match implies: drop them.
        if self.s.startswith("^"):
            self.i = 1
        self.end = len(self.s)
        if self.end > self.i and self.s.endswith("$") and not self._escaped(self.end - 1):
            self.end -= 1

    def _escaped(self, pos: int) -> bool:
        """True if the character at ``pos`` is preceded by an odd number of backslashes."""
        n = 0
        while pos - 1 - n >= 0 and self.s[pos - 1 - n] == "\\":
            n += 1
        return n % 2 == 1

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.s!r}, position {self.i}: {what}")

    def peek(self) -> str | None:
        return self.s[self.i] if self.i < self.end else None

    def take(self) -> str:
        if self.i >= self.end:
            raise self.error("unexpected end of pattern")
        c = self.s[self.i]
        self.i += 1
        return c

    def parse(self) -> Node:
        node = self.alternation()
        if self.i < self.end:
            raise self.error(f"unexpected {self.s[self.i]!r} (an unopened ')'?)")
        return node

    def alternation(self) -> Node:
        options = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concatenation(self) -> Node:
        parts = []
        while self.peek() not in (None, "|", ")"):
            parts.append(self.repetition())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repetition(self) -> Node:
        node = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return node
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        if self.peek() in ("*", "+", "?", "{"):
            raise self.error("two quantifiers in a row")
        return Repeat(node, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c != "{":
            return None
        close = self.s.find("}", self.i, self.end)
        body = self.s[self.i + 1 : close] if close >= 0 else ""
        lo, comma, hi = body.partition(",")
        if close < 0 or not lo.isdigit() or not (hi.isdigit() or hi == ""):
            raise self.error("'{' must start a repetition {m}, {m,} or {m,n}")
        self.i = close + 1
        low = int(lo)
        high = low if not comma else (int(hi) if hi else None)
        if high is not None and high < low:
            raise self.error(f"repetition {{{body}}}: the upper bound is below the lower")
        return low, high

    def atom(self) -> Node:
        c = self.take()
        if c == "(":
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("group flags, look-around and named groups are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("'(' is never closed")
            self.i += 1
            return node
        if c == "[":
            return CharSet(self.char_class())
        if c == ".":
            return CharSet(((0, MAX_CODEPOINT),))
        if c == "\\":
            return CharSet(self.escape_set())
        if c in "*+?{":
            raise self.error(f"{c!r} has nothing to repeat")
        if c in "^$":
            raise self.error(f"{c!r} is an anchor: only allowed first (^) or last ($)")
        return CharSet(((ord(c), ord(c)),))

    def escape_set(self) -> tuple[tuple[int, int], ...]:
        """The set of the escape after a backslash (a class or one character)."""
        c = self.take()
        classes = {"d": DIGITS, "w": WORD, "s": WHITESPACE}
        if c in classes:
            return normalize(classes[c])
        if c.lower() in classes:
            return complement(classes[c.lower()])
        cp = self.escape_char(c)
        return ((cp, cp),)

    def escape_char(self, c: str) -> int:
        """The code point of a one-character escape whose letter ``c`` was just read."""
        if c in _CONTROL_ESCAPES:
            return ord(_CONTROL_ESCAPES[c])
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.s[self.i : self.i + width]
            hex_digits = "0123456789abcdefABCDEF"
            if len(digits) != width or any(d not in hex_digits for d in digits):
                raise self.error(f"\\{c} needs {width} hex digits")
            self.i += width
            if c == "x" and self.peek() is not None and self.peek() in hex_digits:
                # Python reads two digits, xgrammar all that follow: refuse the ambiguity.
                raise self.error("\\xHH followed by a hex digit is ambiguous: write \\uHHHH")
            return int(digits, 16)
        if c.isalnum():
            raise self.error(f"unsupported escape \\{c}")
        return ord(c)

    def char_class(self) -> tuple[tuple[int, int], ...]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        if self.peek() == "]":
            raise self.error("empty character class")
        ranges: list[tuple[int, int]] = []
        while True:
            c = self.take()
            if c == "]":
                break
            if c == "\\":
                item = self.escape_set()
                if len(item) != 1 or item[0][0] != item[0][1]:  # \d, \w, \s...
                    if self.peek() == "-" and self.s[self.i + 1 : self.i + 2] != "]":
                        raise self.error("a range cannot start at a class escape (\\d-z)")
                    ranges.extend(item)
                    continue
                lo = item[0][0]
                if lo == ord("^") and not ranges:
                    # xgrammar copies the class as is, and [^] would read as a negation.
                    raise self.error("a literal '^' cannot be a class's first member "
                                     "(write it later in the class: [a^])")
            else:
                lo = ord(c)
            hi = lo
            if self.peek() == "-" and self.i + 1 < self.end and self.s[self.i + 1] != "]":
                self.i += 1
                d = self.take()
                if d == "\\":
                    item = self.escape_set()
                    if len(item) != 1 or item[0][0] != item[0][1]:
                        raise self.error("a range cannot end in a class escape")
                    hi = item[0][0]
                else:
                    hi = ord(d)
                if hi < lo:
                    raise self.error(f"range {chr(lo)!r}-{chr(hi)!r} is out of order")
            ranges.append((lo, hi))
        return complement(ranges) if negate else normalize(ranges)
