"""What both twins read from a ``StructuredOutputsParams``: its cache key and its choices.

Kept out of the twins so that they cache and spell the same constraint the
same way: a ``choice`` list is the alternation of its escaped strings in
both, and two requests with the same constraint share one compiled grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.json_schema import JsonLayout, forbid_additional_properties
from minivllm.structured_output.regex import escape


def constraint_key(params: StructuredOutputsParams) -> tuple[str, str, JsonLayout]:
    """``(kind, text, layout)``: equal for constraints that compile to the same grammar.

    A schema's key keeps its property order (it is the order of the output);
    with ``disable_additional_properties`` it is the rewritten schema.
    """
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {params!r}")
    params.verify()
    kind = params.kind
    layout = JsonLayout(params.disable_any_whitespace, params.whitespace_pattern)
    if kind == "json":
        schema = params.json_schema()
        if params.disable_additional_properties:
            schema = forbid_additional_properties(schema)
        return kind, json.dumps(schema, ensure_ascii=False), layout
    if kind == "choice":
        return kind, json.dumps(params.choice, ensure_ascii=False), layout
    if kind == "json_object":
        return kind, "", layout
    return kind, getattr(params, kind), layout


def choice_regex(choices: list[str]) -> str:
    """The regex matching exactly one of ``choices``: their escaped alternation."""
    return "(?:" + "|".join(escape(c) for c in choices) + ")"


def check_backend_options(cache_size: int, compile_timeout_s: float | None) -> None:
    """``ValueError`` naming the option if a ``StructuredOutputBackend`` option is out of range."""
    if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
        raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
    if compile_timeout_s is not None and (
            not isinstance(compile_timeout_s, (int, float)) or isinstance(compile_timeout_s, bool)
            or not compile_timeout_s > 0):
        raise ValueError(f"compile_timeout_s must be a positive number or None, "
                         f"got {compile_timeout_s!r}")


class CompileCache:
    """Compiled constraints by :func:`constraint_key`, least recently used dropped first.

    Thread-safe: the server compiles a request's constraint on a thread of its
    own (to validate it off the event loop) while the engine thread compiles
    others; two threads compiling the same new constraint both compile it and
    the second ``put`` wins, which is harmless.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> Any | None:
        """The entry for ``key`` (now the most recently used), or None."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            return None

    def put(self, key: tuple, value: Any) -> None:
        """Add ``value``; drop the least recently used entries beyond ``capacity``."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
