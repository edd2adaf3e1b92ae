"""``StructuredOutputsParams``: what a constrained request's output must match (vLLM's name).

Exactly one constraint (``json``, ``regex``, ``choice``, ``grammar`` or
``json_object``), plus vLLM's JSON options. It is one field of
:class:`~minivllm.sampling_params.SamplingParams` (``structured_outputs=``), which
re-exports it; :mod:`minivllm.structured_output` compiles it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's ``StructuredOutputsParams``).

    Set exactly one of:

    Args:
        json: a JSON schema, as a dict or a JSON string: the output is a JSON
            document valid under it, written as ``json.dumps`` writes it
            (separators ``", "`` and ``": "``, no other white space).
        regex: the output matches this regular expression in full.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this context-free grammar, in
            xgrammar's EBNF (the GBNF dialect of llama.cpp: rules
            ``name ::= ...``, strings ``"..."``, classes ``[a-z]``, ``* + ?``,
            groups, alternatives ``|``; the start rule is ``root``).
        json_object: ``True``: the output is some JSON object (no schema).

    and, for ``json`` (and ``json_object``), vLLM's options:

    Args:
        disable_any_whitespace: write JSON with separators ``","`` and ``":"``,
            no white space at all (default: ``", "`` and ``": "``, see below).
        disable_additional_properties: an object schema without
            ``additionalProperties`` allows no other key. minivllm's compilers
            already read such schemas so (as xgrammar, vLLM's default backend,
            does), so this only makes it explicit in the schema.
        whitespace_pattern: ``json`` only: a regex for the white space allowed
            around ``{ } [ ] , :`` (outlines' option); the separators are then
            ``","`` and ``":"``. The fast twin compiles it through the ref's
            schema-to-regex translation, so only the ref's schema subset.

    Types and obvious mistakes are caught here (``ValueError`` naming the
    field); content errors (a schema or regex that does not compile) are
    caught when the engine compiles the constraint, before the request is
    queued (``StructuredOutputBackend.compile``). See ``docs/structured_outputs.md``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.verify()

    @property
    def kind(self) -> str:
        """The one field that is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``
        or ``"json_object"``."""
        return self._set_fields()[0]

    def _set_fields(self) -> list[str]:
        return [name for name in _CONSTRAINT_FIELDS
                if getattr(self, name) is not None and getattr(self, name) is not False]

    def verify(self) -> None:
        """Raise ``ValueError`` naming the field if the constraint is malformed.

        Run when the object is made and again by ``SamplingParams.verify``.
        """
        chosen = self._set_fields()
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs: set exactly one of "
                             f"{', '.join(_CONSTRAINT_FIELDS)}, got "
                             f"{', '.join(chosen) if chosen else 'none'}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be True, False or None, got {self.json_object!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"json must be a JSON schema (a dict or a JSON string); "
                                     f"the string is not JSON: {e}") from None
            elif isinstance(schema, dict):
                try:
                    _json.dumps(schema)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"json: the schema is not JSON-serialisable: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json must be a JSON schema object (a dict or a JSON string "
                                 f"holding an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise ValueError(f"choice must be a non-empty list of strings, got {bad[0]!r} "
                                 f"in {self.choice!r}")
        self._verify_options(chosen[0])

    def _verify_options(self, kind: str) -> None:
        """The JSON options: their types, and that they apply to the constraint."""
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
            if v and kind not in ("json", "json_object"):
                raise ValueError(f"{name} applies to json and json_object constraints, "
                                 f"not to {kind}")
        w = self.whitespace_pattern
        if w is None:
            return
        if not isinstance(w, str) or not w:
            raise ValueError(f"whitespace_pattern must be a non-empty string or None, got {w!r}")
        if kind != "json":
            raise ValueError(f"whitespace_pattern applies to json constraints, not to {kind}")
        if self.disable_any_whitespace:
            raise ValueError("whitespace_pattern cannot be combined with "
                             "disable_any_whitespace (which allows no white space)")

    def json_schema(self) -> dict[str, Any]:
        """``json`` as a dict (parsed if it was given as a string)."""
        return _json.loads(self.json) if isinstance(self.json, str) else self.json
