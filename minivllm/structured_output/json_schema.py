"""A JSON schema becomes a regex, the way outlines does it (the ref's subset).

A schema without recursion describes a regular language: every keyword maps
to a small regex, and a schema is the composition of its parts. The regexes
below use the syntax of :mod:`minivllm.structured_output.regex`.

**Whitespace rule.** By default a document is written exactly as Python's
``json.dumps(value)`` writes it: separators ``", "`` and ``": "``, no other
white space (no newline, no indentation, nothing before or after). This is
xgrammar's ``any_whitespace=False`` form, which the fast twin compiles: a
model cannot spend its tokens on spaces, and both twins agree byte for byte.
:class:`JsonLayout` changes it (``StructuredOutputsParams``' options):
``compact`` (vLLM's ``disable_any_whitespace``) writes ``","`` and ``":"``,
no white space at all; ``whitespace`` (vLLM's ``whitespace_pattern``, as
outlines reads it) is a regex for the white space allowed after ``{`` and
``[``, before ``}`` and ``]``, and on both sides of ``,`` and ``:``.

The subset (anything else raises ``ValueError`` naming the keyword; the fast
twin serves much more, see ``docs/structured_outputs.md``):

=======================  ======================================================
``type``                 ``object array string number integer boolean null``,
                         or a list of those (any one of them)
``properties``           objects: the listed properties, **in the schema's
+ ``required``           order**; the required ones always, the others may be
                         left out; no other property (``additionalProperties``
                         absent or ``false``)
``items``                arrays: every item matches it (``items`` is required:
                         an unconstrained item would need recursion)
``minItems maxItems``    arrays: bounds on the number of items
``minLength maxLength``  strings: bounds on the number of characters. As in
                         xgrammar, a bounded string (``minLength`` > 0 or a
                         ``maxLength``) has no escapes: any character but
                         ``"``, ``\\``, CR and LF (a tab, say, is written raw)
``enum``, ``const``      strings, integers, booleans and null, written as
                         ``json.dumps(value, ensure_ascii=False)`` does
``anyOf``, ``oneOf``     any one of the sub-schemas (``oneOf`` is not checked
                         for exclusivity, as in outlines and xgrammar)
``$ref``                 ``#/$defs/NAME`` or ``#/definitions/NAME``, not recursive
=======================  ======================================================

Annotations (``title``, ``description``, ``default``, ``examples``,
``$schema``, ``$id``, ``$comment``) are ignored. Strings: any character but
``"``, ``\\`` and the controls U+0000-U+001F, or an escape (``\\" \\\\ \\/ \\b
\\f \\n \\r \\t \\uXXXX``). Integers: ``0`` or an optional ``-`` and a non-zero
digit then digits (no ``-0``). Numbers: an integer part (``-0`` allowed), an
optional fraction and an optional exponent.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from minivllm.structured_output.regex import escape

STRING = r'"(?:[^\x00-\x1f"\\]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
INTEGER = r"(?:0|-?[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = r"null"
COMMA, COLON = ", ", ": "
#: The nesting depth of the ref's ``json_object`` (see :func:`json_object_regex`).
JSON_OBJECT_MAX_DEPTH = 3

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment"})
_KEYWORDS = MappingProxyType({
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "number": set(), "integer": set(), "boolean": set(), "null": set(),
})  # fmt: skip


@dataclass(frozen=True)
class JsonLayout:
    """Where white space may go in a JSON document (see the whitespace rule above).

    Attributes:
        compact: separators ``","`` and ``":"`` instead of ``", "`` and ``": "``.
        whitespace: a regex for the white space allowed around the structural
            characters (``{ } [ ] , :``), as outlines places it; the separators
            are then ``","`` and ``":"`` with this regex on both sides. None: none.
    """

    compact: bool = False
    whitespace: str | None = None

    @property
    def _ws(self) -> str:
        return "" if self.whitespace is None else f"(?:{self.whitespace})"

    @property
    def comma(self) -> str:
        return self._ws + ("," if self.compact or self.whitespace is not None else COMMA) \
            + self._ws

    @property
    def colon(self) -> str:
        return self._ws + (":" if self.compact or self.whitespace is not None else COLON) \
            + self._ws

    def wrap(self, open_: str, inner: str, close: str) -> str:
        """``open_ inner close`` (escaped brackets) with the white space inside them."""
        return open_ + self._ws + inner + self._ws + close


def schema_to_regex(schema: Any, layout: JsonLayout = JsonLayout()) -> str:
    """The regex of every document valid under ``schema`` (the subset above),
    written in ``layout``.

    ``ValueError`` says which keyword the ref does not support, or what is wrong.
    """
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {schema!r}")
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    return _Converter(defs, layout).convert(schema, "#", ())


def forbid_additional_properties(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that
    does not say (vLLM's ``disable_additional_properties``; its guidance backend
    rewrites the schema the same way). A copy; ``schema`` is not changed."""
    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in ("enum", "const", "default", "examples") else visit(v))
               for k, v in node.items()}
        if ("properties" in node or node.get("type") == "object") \
                and "additionalProperties" not in node:
            out["additionalProperties"] = False
        return out

    return visit(copy.deepcopy(schema))


class _Converter:
    def __init__(self, defs: dict, layout: JsonLayout) -> None:
        self.defs = defs
        self.layout = layout

    def convert(self, schema: Any, path: str, refs: tuple[str, ...]) -> str:
        """The regex of ``schema`` at JSON pointer ``path``; ``refs`` guards recursion."""
        if not isinstance(schema, dict):
            raise ValueError(f"{path}: a schema must be an object, got {schema!r}")
        keys = set(schema) - _ANNOTATIONS - {"$defs", "definitions"}
        if "$ref" in schema:
            return self.ref(schema, keys, path, refs)
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                self.only(keys, {combinator}, path)
                options = schema[combinator]
                if not isinstance(options, list) or not options:
                    raise ValueError(f"{path}/{combinator} must be a non-empty list")
                return _alt(self.convert(s, f"{path}/{combinator}/{i}", refs)
                            for i, s in enumerate(options))
        if "const" in schema:
            self.only(keys, {"const", "type"}, path)
            return _literal(schema["const"], f"{path}/const")
        if "enum" in schema:
            self.only(keys, {"enum", "type"}, path)
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"{path}/enum must be a non-empty list")
            return _alt(_literal(v, f"{path}/enum/{i}") for i, v in enumerate(values))
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return _alt(self.convert({**schema, "type": k}, path, refs) for k in kind)
        if kind not in _KEYWORDS:
            raise ValueError(f"{path}: the ref needs 'type' (one of {sorted(_KEYWORDS)}), "
                             f"'enum', 'const', 'anyOf', 'oneOf' or '$ref', got {schema!r} "
                             "(an unconstrained value needs a recursive grammar: the fast "
                             "twin serves it)")
        self.only(keys, {"type"} | _KEYWORDS[kind], path)
        return getattr(self, f"type_{kind}")(schema, path, refs)

    @staticmethod
    def only(keys: set, allowed: set, path: str) -> None:
        extra = sorted(keys - allowed)
        if extra:
            raise ValueError(f"{path}: the ref does not support {extra} here (it reads "
                             f"{sorted(allowed)}; the fast twin serves more of JSON Schema)")

    def ref(self, schema: dict, keys: set, path: str, refs: tuple[str, ...]) -> str:
        self.only(keys, {"$ref"}, path)
        target = schema["$ref"]
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(target, str) and target.startswith(prefix):
                name = target[len(prefix):]
                if name not in self.defs:
                    raise ValueError(f"{path}/$ref: {target!r} is not defined")
                if target in refs:
                    raise ValueError(f"{path}/$ref: {target!r} is recursive (a regex cannot "
                                     "nest without bound; the fast twin serves it)")
                return self.convert(self.defs[name], target, refs + (target,))
        raise ValueError(f"{path}/$ref must be '#/$defs/NAME' or '#/definitions/NAME', "
                         f"got {target!r}")

    def type_string(self, schema: dict, path: str, refs) -> str:
        lo = _count(schema, "minLength", 0, path)
        hi = _count(schema, "maxLength", None, path)
        if lo == 0 and hi is None:
            return STRING
        if hi is not None and hi < lo:
            raise ValueError(f"{path}: minLength {lo} is greater than maxLength {hi}")
        return f'"[^"\\\\\\r\\n]{{{lo},{"" if hi is None else hi}}}"'

    def type_integer(self, schema, path, refs) -> str:
        return INTEGER

    def type_number(self, schema, path, refs) -> str:
        return NUMBER

    def type_boolean(self, schema, path, refs) -> str:
        return BOOLEAN

    def type_null(self, schema, path, refs) -> str:
        return NULL

    def type_array(self, schema: dict, path: str, refs) -> str:
        if "items" not in schema:
            raise ValueError(f"{path}: the ref needs 'items' for an array (unconstrained "
                             "items need a recursive grammar: the fast twin serves them)")
        item = self.convert(schema["items"], f"{path}/items", refs)
        lo = _count(schema, "minItems", 0, path)
        hi = _count(schema, "maxItems", None, path)
        if hi is not None and hi < lo:
            raise ValueError(f"{path}: minItems {lo} is greater than maxItems {hi}")
        empty = self.layout.wrap(r"\[", "", r"\]")
        if hi == 0:
            return empty
        comma = self.layout.comma
        more = f"(?:{comma}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        full = self.layout.wrap(r"\[", item + more, r"\]")
        return rf"(?:{empty}|{full})" if lo == 0 else full

    def type_object(self, schema: dict, path: str, refs) -> str:
        if schema.get("additionalProperties", False) is not False:
            raise ValueError(f"{path}: the ref supports only additionalProperties false "
                             "(the default here: no property but the listed ones)")
        if "properties" not in schema:
            raise ValueError(f"{path}: the ref needs 'properties' for an object (an object "
                             "of any properties needs a recursive grammar: the fast twin "
                             "serves it)")
        props = schema["properties"]
        required = schema.get("required", [])
        if not isinstance(props, dict):
            raise ValueError(f"{path}/properties must be an object, got {props!r}")
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ValueError(f"{path}/required must list names from 'properties', "
                             f"got {required!r}")
        members = [(escape(json.dumps(name, ensure_ascii=False)) + self.layout.colon
                    + self.convert(sub, f"{path}/properties/{name}", refs), name in required)
                   for name, sub in props.items()]
        inner = _members(members, self.layout.comma)  # may be empty: every property optional
        return self.layout.wrap(r"\{", inner, r"\}")


def _members(members: list[tuple[str, bool]], comma: str = COMMA) -> str:
    """The properties, in order, separated by commas, every required one present.

    ``rest(i)``: what may follow once some property has been written (each
    later one with a comma in front, optional ones optional). ``first(i)``:
    what may follow the ``{`` when properties ``0..i-1`` were all left out.
    """
    n = len(members)
    rest = [""] * (n + 1)
    for i in range(n - 1, -1, -1):
        member, required = members[i]
        one = f"(?:{comma}{member})" + ("" if required else "?")
        rest[i] = one + rest[i + 1]
    first = ""  # first(n): every property left out
    for i in range(n - 1, -1, -1):
        member, required = members[i]
        written = member + rest[i + 1]
        first = written if required else f"(?:{written}|{first})"
    return first


def _count(schema: dict, key: str, default: int | None, path: str) -> int | None:
    v = schema.get(key, default)
    if v is not default and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ValueError(f"{path}/{key} must be a non-negative integer, got {v!r}")
    return v


def _literal(value: Any, path: str) -> str:
    if value is not None and not isinstance(value, (str, int, bool)):
        raise ValueError(f"{path}: the ref's enum/const values are strings, integers, "
                         f"booleans and null, got {value!r}")
    return escape(json.dumps(value, ensure_ascii=False))


def _alt(options) -> str:
    return "(?:" + "|".join(options) + ")"


def json_object_regex(depth: int = JSON_OBJECT_MAX_DEPTH,
                      layout: JsonLayout = JsonLayout()) -> str:
    """Any JSON object nested at most ``depth`` deep, written in ``layout``.

    The ref's ``json_object``: a regex cannot count brackets without bound, so
    objects and arrays may nest ``depth`` levels (``{"a": [1]}`` is depth 2);
    within that bound it allows exactly what the fast twin allows.
    """
    value = _alt([STRING, NUMBER, BOOLEAN, NULL])  # depth 0: scalars only
    wrap, comma = layout.wrap, layout.comma
    obj = wrap(r"\{", "", r"\}")
    for _ in range(depth):
        member = STRING + layout.colon + value
        obj = _alt([wrap(r"\{", "", r"\}"), wrap(r"\{", f"{member}(?:{comma}{member})*", r"\}")])
        array = _alt([wrap(r"\[", "", r"\]"), wrap(r"\[", f"{value}(?:{comma}{value})*", r"\]")])
        value = _alt([STRING, NUMBER, BOOLEAN, NULL, obj, array])
    return obj
