"""Structured outputs: the request-level contract and bad input.

- ``StructuredOutputsParams`` / ``SamplingParams`` refuse malformed constraints
  with a ``ValueError`` naming the field; ``compile`` refuses content that does
  not compile (bad regex, bad schema, bad grammar), naming the field.
- ``Grammar``: ``accept_tokens`` is all or nothing, ``validate_tokens`` changes
  nothing, ``rollback`` returns exactly to an earlier state, ``fork`` is
  independent, EOS is allowed exactly in accepting states, special and padding
  ids never, ``is_terminated`` when nothing but EOS may follow.
- The compile cache is bounded (LRU) and the time cap refuses slow constraints.
- The vocabulary's bytes equal xgrammar's own reading of SmolLM2's tokenizer.

Every check compares with an independent expectation (a fresh grammar fed the
same prefix, Python's ``re``, xgrammar's decoder) and runs on both twins.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from structured_utils import mask_of, synthetic_tokenizer

from minivllm import SamplingParams, StructuredOutputsParams, backend
from minivllm.fast import structured_output as fast_so
from minivllm.structured_output.json_schema import forbid_additional_properties, schema_to_regex
from minivllm.structured_output.regex import parse_regex
from minivllm.structured_output.vocab import TokenVocabulary

PAD = 13


@pytest.fixture(scope="module")
def impl():
    return backend.get("structured_output")


@pytest.fixture(scope="module")
def so(impl):
    tok = synthetic_tokenizer()
    return impl.StructuredOutputBackend(tok, len(tok) + PAD)


def ids_of(so, text: str) -> list[int]:
    """Single-byte token ids spelling ``text`` (UTF-8)."""
    by_bytes = {b: i for i, b in enumerate(so.vocab.token_bytes) if b is not None}
    return [by_bytes[bytes([b])] for b in text.encode()]


def allowed(so, grammar) -> set[int]:
    return set(torch.nonzero(mask_of(grammar, so.vocab_size)).flatten().tolist())


# ------------------------------------------------------------------ params


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json={"type": "string"}, json_object=True), "exactly one"),
    (dict(choice=[]), "choice"),
    (dict(choice="ab"), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(regex=""), "regex"),
    (dict(regex=3), "regex"),
    (dict(grammar=""), "grammar"),
    (dict(json="{not json"), "json"),
    (dict(json="[1, 2]"), "json"),
    (dict(json=3), "json"),
    (dict(json={"type": object}), "json"),
    (dict(json_object="yes"), "json_object"),
    (dict(json={}, disable_any_whitespace="yes"), "disable_any_whitespace"),
    (dict(regex="a", disable_any_whitespace=True), "disable_any_whitespace applies"),
    (dict(choice=["a"], disable_additional_properties=True), "disable_additional_properties"),
    (dict(json={}, whitespace_pattern=""), "whitespace_pattern"),
    (dict(json_object=True, whitespace_pattern=" ?"), "whitespace_pattern applies"),
    (dict(json={}, whitespace_pattern=" ?", disable_any_whitespace=True), "whitespace_pattern"),
])
def test_params_refuse_malformed_constraints(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_params_kinds_and_sampling_params():
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(json='{"type": "null"}').json_schema() == {"type": "null"}
    assert StructuredOutputsParams(json_object=True, regex=None).kind == "json_object"
    assert StructuredOutputsParams(regex="a", json_object=False).kind == "regex"
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert sp.structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    sp.structured_outputs.choice = ["x"]  # mutated after construction: two fields set now
    with pytest.raises(ValueError, match="exactly one"):
        sp.verify()


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="(ab"), "regex"),
    (dict(regex="a**"), "regex"),
    (dict(regex="[]"), "regex"),
    (dict(regex="[z-a]"), "regex"),
    (dict(regex="a{3,2}"), "regex"),
    (dict(json={"type": "strin"}), "json"),
    (dict(json={"type": "string", "minLength": 3, "maxLength": 1}), "json"),
    (dict(json={"type": "array", "items": {"type": "null"}, "minItems": 2, "maxItems": 1}), "json"),
    (dict(grammar='root ::= "a" | undefined_rule'), "grammar"),
])
def test_compile_refuses_bad_content_naming_the_field(so, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        so.compile(StructuredOutputsParams(**kwargs))


def test_grammars_compile_on_the_fast_twin_only(impl, so):
    params = StructuredOutputsParams(grammar='root ::= "(" root ")" | "x"')
    if impl is not fast_so:
        with pytest.raises(ValueError, match="^grammar: .*fast"):
            so.compile(params)
        return
    g = so.compile(params)  # a context-free language: balanced parentheses
    assert g.accept_tokens(ids_of(so, "((("))
    assert not g.accept_tokens(ids_of(so, "x)))x"))
    assert g.accept_tokens(ids_of(so, "x))")) and not g.is_terminated()
    assert g.accept_tokens(ids_of(so, ")")) and g.is_terminated()


def test_neutral_schema_converter_names_unsupported_keywords():
    for schema, word in [({"type": "string", "pattern": "a+"}, "pattern"),
                         ({"type": "integer", "minimum": 3}, "minimum"),
                         ({"type": "array"}, "items"),
                         ({"type": "object"}, "properties"),
                         ({"type": "object", "properties": {}, "additionalProperties": True},
                          "additionalProperties"),
                         ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                          "recursive"),
                         ({"enum": [1.5]}, "enum")]:
        with pytest.raises(ValueError, match=word):
            schema_to_regex(schema)
    for bad in ["\\b", "(?=a)", "\\p{L}", "^a^", "[\\^a]", "\\x41F", "[\\d-z]"]:
        with pytest.raises(ValueError, match="regex"):
            parse_regex(bad)


# ------------------------------------------------------------------ vLLM's JSON options


def accepts(so, params, text: str) -> bool:
    """True if ``text`` is a whole document of the constraint (its bytes, then EOS)."""
    g = so.compile(params)
    return g.accept_tokens(ids_of(so, text)) and g.accept_tokens([so.vocab.eos_token_ids[0]])


OBJ = {"type": "object", "properties": {"a": {"type": "integer"},
                                        "o": {"type": "object", "properties": {
                                            "x": {"enum": ["y"]}}}}, "required": ["a"]}


@pytest.mark.parametrize("options, good, bad", [
    (dict(), ['{"a": 1}', '{"a": 1, "o": {"x": "y"}}'],
     ['{"a":1}', '{ "a": 1}', '{"a": 1,"o": {}}']),
    (dict(disable_any_whitespace=True), ['{"a":1}', '{"a":-2,"o":{"x":"y"}}', '{"a":1,"o":{}}'],
     ['{"a": 1}', '{"a":1, "o":{}}', '{"a":1,"o":{ }}', ' {"a":1}', '{"a":1}\n']),
    (dict(whitespace_pattern=r"[ ]?"), ['{"a":1}', '{ "a" : 1 }', '{"a": 1 ,"o":{ }}'],
     ['{  "a":1}', '{"a":\n1}', '{"a":1}  ', '{"a"  :1}']),
    (dict(whitespace_pattern=r"\n*"), ['{\n\n"a":1\n}', '{"a":\n1,\n"o":{}}'],
     ['{ "a":1}', '{"a": 1}']),
])
def test_json_whitespace_options_on_strings(so, options, good, bad):
    """disable_any_whitespace and whitespace_pattern, read by both twins on whole texts."""
    params = StructuredOutputsParams(json=OBJ, **options)
    for text in good:
        assert accepts(so, params, text), text
        jsonschema.validate(json.loads(text), OBJ)  # the oracle agrees it is valid
    for text in bad:
        assert not accepts(so, params, text), text


@pytest.mark.parametrize("flag", [True, False])
def test_additional_properties_are_refused_without_additional_properties(so, flag):
    """An object schema without ``additionalProperties`` takes no other key: with vLLM's
    disable_additional_properties, and (xgrammar's strict reading, vLLM's default
    backend's) without it."""
    params = StructuredOutputsParams(json=OBJ, disable_additional_properties=flag)
    assert accepts(so, params, '{"a": 1, "o": {"x": "y"}}')
    for extra in ['{"a": 1, "b": 2}', '{"b": 2, "a": 1}', '{"a": 1, "o": {"x": "y", "z": 1}}',
                  '{"a": 1, "o": {"z": 1}}']:
        assert not accepts(so, params, extra), extra
        with pytest.raises(jsonschema.ValidationError):  # the rewritten schema says the same
            jsonschema.validate(json.loads(extra), forbid_additional_properties(OBJ))


def test_forbid_additional_properties_rewrites_only_silent_object_schemas():
    schema = {"type": "object", "properties": {
        "free": {"type": "object", "properties": {}, "additionalProperties": True},
        "e": {"enum": [{"properties": 1}]},
        "l": {"type": "array", "items": {"type": "object", "properties": {}}}},
        "$defs": {"d": {"type": "object"}}}
    out = forbid_additional_properties(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema
    assert out["properties"]["free"]["additionalProperties"] is True  # it said so
    assert out["properties"]["e"] == schema["properties"]["e"]  # a value, not a schema
    assert out["properties"]["l"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False


# ------------------------------------------------------------------ grammar state


def test_accept_is_all_or_nothing_and_validate_changes_nothing(so):
    g = so.compile(StructuredOutputsParams(regex="ab+c"))
    before = allowed(so, g)
    a, b, c, x = ids_of(so, "abcx")
    assert g.validate_tokens([a, b, b, x, c]) == 3
    assert g.validate_tokens([x]) == 0 and g.validate_tokens([]) == 0
    assert not g.accept_tokens([a, b, x])
    assert allowed(so, g) == before and g.num_accepted_tokens == 0
    assert g.accept_tokens(np.array([a, b])) and g.num_accepted_tokens == 2  # numpy ints too
    with pytest.raises(ValueError, match="token_ids"):
        g.accept_tokens([so.vocab_size])
    with pytest.raises(ValueError, match="token_ids"):
        g.validate_tokens([-1])


def test_rollback_returns_to_the_same_state(so):
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]})
    text = '{"a": 12, "b": "x"}'
    tokens = ids_of(so, text)
    g = so.compile(params)
    assert g.accept_tokens(tokens)
    eos = so.vocab.eos_token_ids[0]
    assert g.accept_tokens([eos]) and g.is_terminated()
    for k in (1, 5, len(tokens) + 1):  # EOS, then part of the text, then everything
        g.rollback(k)
        fresh = so.compile(params)
        assert fresh.accept_tokens(tokens[: len(tokens) + 1 - k])
        assert allowed(so, g) == allowed(so, fresh)
        assert g.is_terminated() == fresh.is_terminated() == (k == 1)  # "}" ends the object
        assert g.accept_tokens(tokens[len(tokens) + 1 - k :] + [eos])
    for bad in (-1, len(tokens) + 2, 1.0):
        with pytest.raises(ValueError, match="num_tokens"):
            g.rollback(bad)


def test_fork_is_independent(so):
    g = so.compile(StructuredOutputsParams(choice=["cat", "car", "dog"]))
    assert g.accept_tokens(ids_of(so, "ca"))
    f = g.fork()
    assert f.num_accepted_tokens == 2 and allowed(so, f) == allowed(so, g)
    assert f.accept_tokens(ids_of(so, "t")) and f.is_terminated()
    assert not g.is_terminated() and g.accept_tokens(ids_of(so, "r")) and g.is_terminated()
    f.rollback(3)  # the fork's history includes what it inherited
    assert f.accept_tokens(ids_of(so, "dog"))


def test_eos_only_in_accepting_states_and_specials_never(so):
    eos = set(so.vocab.eos_token_ids)
    never = {i for i, b in enumerate(so.vocab.token_bytes) if b is None} - eos
    assert never >= set(range(so.vocab_size - PAD, so.vocab_size))  # padding ids
    assert len(never) >= PAD + 2  # <pad> and <|tool|> too
    g = so.compile(StructuredOutputsParams(regex="(ab|abc)(.|\n)*x|<pad>"))
    for step, ch in enumerate("abcyyyx"):
        got = allowed(so, g)
        assert not got & never, f"a special or padding id allowed at step {step}"
        assert not got & eos, f"EOS allowed at step {step}, before the text can end"
        assert g.accept_tokens(ids_of(so, ch))
    got = allowed(so, g)
    assert eos <= got and not got & never and not g.is_terminated()  # x may be followed
    assert not g.accept_tokens(sorted(never)[:1])
    assert g.accept_tokens([min(eos)]) and g.is_terminated()
    assert not g.accept_tokens(ids_of(so, "x"))  # nothing after EOS
    full = torch.zeros(1, (so.vocab_size + 31) // 32, dtype=torch.int32)
    g.fill_bitmask(full, 0)
    assert bool((full == -1).all()), "a terminated grammar constrains nothing (vLLM's rule)"


def test_terminated_without_eos_when_nothing_can_follow(so):
    g = so.compile(StructuredOutputsParams(choice=["a", "ab"]))
    a, b = ids_of(so, "ab")
    assert g.accept_tokens([a]) and not g.is_terminated()  # "ab" may still come
    assert g.accept_tokens([b]) and g.is_terminated()
    assert allowed(so, g) == set(so.vocab.eos_token_ids)


# ------------------------------------------------------------------ backend


def test_compile_cache_is_lru_bounded(impl):
    tok = synthetic_tokenizer()
    so = impl.StructuredOutputBackend(tok, len(tok), cache_size=2)
    p = [StructuredOutputsParams(regex=r) for r in ("a", "b", "c")]
    first = so.compile(p[0])._compiled
    assert so.compile(StructuredOutputsParams(regex="a"))._compiled is first  # a hit
    so.compile(p[1])
    assert so.compile(p[0])._compiled is first  # "a" is now the most recent
    so.compile(p[2])  # evicts "b"
    assert so.compile(p[0])._compiled is first
    assert len(so._cache) == 2


def test_backend_options_and_time_cap(impl):
    tok = synthetic_tokenizer()
    for kwargs, field in [(dict(cache_size=0), "cache_size"),
                          (dict(compile_timeout_s=0), "compile_timeout_s"),
                          (dict(compile_timeout_s="1"), "compile_timeout_s"),
                          (dict(eos_token_ids=[10**6]), "eos_token_ids"),
                          (dict(eos_token_ids=[]), "eos_token_ids")]:
        with pytest.raises(ValueError, match=field):
            impl.StructuredOutputBackend(tok, len(tok), **kwargs)
    with pytest.raises(ValueError, match="vocab_size"):
        impl.StructuredOutputBackend(tok, 0)
    so = impl.StructuredOutputBackend(tok, len(tok), compile_timeout_s=1e-6)
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 9}
                                            for i in range(40)}}
    with pytest.raises(ValueError, match="^json: .*compile_timeout_s"):
        so.compile(StructuredOutputsParams(json=big))


def test_vocabulary_bytes_match_xgrammars_reading(smollm2_dir):
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    vocab = TokenVocabulary.from_tokenizer(tok, len(tok) + PAD)
    assert vocab.kind == "byte_level" and vocab.eos_token_ids == (tok.eos_token_id,)
    theirs = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)).decoded_vocab
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert len(specials) == 17
    for i, data in enumerate(vocab.token_bytes):
        if i in specials or i >= len(tok):
            assert data is None
        else:
            assert data == bytes(theirs[i]), i
    # a token holding half of a character (byte-level BPE splits UTF-8)
    assert any(data is not None and data[-1] >= 0xC2 and len(data) == 1
               for data in vocab.token_bytes)


def test_ref_refuses_a_dfa_beyond_its_state_cap(impl, monkeypatch):
    """``(a|b)*a(a|b){4}`` needs 2^5 DFA states: over a cap of 8 the ref refuses it."""
    if not hasattr(impl, "MAX_DFA_STATES"):
        pytest.skip("the fast twin has no DFA (xgrammar compiles this in a few states)")
    monkeypatch.setattr(impl, "MAX_DFA_STATES", 8)
    tok = synthetic_tokenizer()
    so = impl.StructuredOutputBackend(tok, len(tok))
    with pytest.raises(ValueError, match="^regex: .*max_states=8"):
        so.compile(StructuredOutputsParams(regex="(a|b)*a(a|b){4}"))
