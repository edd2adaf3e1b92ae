"""Structured outputs: the twins allow exactly the same tokens, and what they allow is valid.

The implementation under test (``backend.get("structured_output")``) is driven
step by step beside the other twin (the fast twin, i.e. xgrammar, when the ref
or a student's package is under test; the ref when the fast twin is), with the
same tokens, on regexes and JSON schemas drawn by hypothesis from the ref's
subsets, choices, and ``json_object``. At every step both must allow the same
token ids (bit for bit) and agree on ``is_terminated``. Walks that end are then
checked by independent oracles: Python's ``re`` (the text is a full match),
``jsonschema`` (the document is valid, written in the whitespace rule), or
membership in the choices.

Two tokenizers: a small byte-level BPE trained here (many hypothesis cases,
cheap masks) and SmolLM2's real 49k vocabulary (fewer cases: the ref walks the
whole vocabulary for every new DFA state), padded to an awkward logits width.

Run: ``pytest -q tests/test_structured_output.py --backend=ref`` (and ``=fast``).
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_utils import examples
from structured_utils import (
    choose,
    distances,
    fullmatch,
    mask_of,
    max_depth,
    synthetic_tokenizer,
    walk,
    whitespace_is_canonical,
    whitespace_outside_strings,
)

from minivllm import backend
from minivllm.fast import structured_output as fast_so
from minivllm.ref import structured_output as ref_so
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.automata import compile_dfa
from minivllm.structured_output.constraint import choice_regex
from minivllm.structured_output.json_schema import (
    JsonLayout,
    json_object_regex,
    schema_to_regex,
)
from minivllm.structured_output.regex import parse_regex
from minivllm.testing.strategies import SO_CHARS, json_schemas, regex_patterns

#: Padding beyond the tokenizer: ids the model can produce but no grammar may allow.
PAD = 17


def so_settings(n: int) -> settings:
    """At most ``n`` examples; the module fixture holds built backends, not per-example state."""
    return settings(max_examples=examples(n), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def impl_and_oracle():
    impl = backend.get("structured_output")
    return impl, (ref_so if impl is fast_so else fast_so)


@pytest.fixture(scope="module")
def backends(request):
    """``backends("synthetic" | "smollm2") -> (implementation's backend, oracle's backend)``."""
    impl, oracle = impl_and_oracle()
    made = {}

    def get(which: str):
        if which not in made:
            if which == "smollm2":
                from transformers import AutoTokenizer

                path = request.getfixturevalue("smollm2_dir")
                tok = AutoTokenizer.from_pretrained(str(path))
            else:
                tok = synthetic_tokenizer()
            v = len(tok) + PAD
            made[which] = (impl.StructuredOutputBackend(tok, v),
                           oracle.StructuredOutputBackend(tok, v))
        return made[which]

    return get


def check_regex_text(pattern: str, text: bytes) -> None:
    assert fullmatch(parse_regex(pattern), text), f"{text!r} does not match {pattern!r}"


def check_json_text(schema: dict, text: bytes) -> None:
    doc = json.loads(text.decode("utf-8", "surrogatepass"), strict=False)
    jsonschema.validate(doc, schema)
    assert whitespace_is_canonical(text.decode("utf-8", "surrogatepass")), text


# ------------------------------------------------------------------ hypothesis, small vocabulary


@so_settings(40)
@given(pattern=regex_patterns(), seed=st.integers(0, 2**16))
def test_regex_masks_equal(backends, pattern, seed):
    mine, other = backends("synthetic")
    params = StructuredOutputsParams(regex=pattern)
    guide = compile_dfa(parse_regex(pattern))
    text, done, _ = walk(params, mine, other, guide, seed, max_steps=24)
    if done:
        check_regex_text(pattern, text)


@so_settings(40)
@given(schema=json_schemas(), seed=st.integers(0, 2**16))
def test_json_schema_masks_equal(backends, schema, seed):
    mine, other = backends("synthetic")
    params = StructuredOutputsParams(json=schema)
    guide = compile_dfa(parse_regex(schema_to_regex(schema)))
    text, done, _ = walk(params, mine, other, guide, seed, max_steps=40)
    if done:
        check_json_text(schema, text)


@so_settings(25)
@given(choices=st.lists(st.text(alphabet=SO_CHARS + "\n\t\x00", max_size=6), min_size=1,
                        max_size=4),
       seed=st.integers(0, 2**16))
def test_choice_masks_equal(backends, choices, seed):
    mine, other = backends("synthetic")
    guide = compile_dfa(parse_regex(choice_regex(choices)))
    text, done, ids = walk(StructuredOutputsParams(choice=choices), mine, other, guide, seed,
                           max_steps=30)
    assert done, "a choice always ends"
    assert text.decode("utf-8", "surrogatepass") in choices


@functools.cache
def json_object_guide():
    """The ref's depth-bounded json_object DFA (a second to build: once per session)."""
    return compile_dfa(parse_regex(json_object_regex()))


def json_object_walk(mine, other, seed: int, max_steps: int) -> bytes:
    """``json_object``: the ref allows a subset of the fast twin's tokens, exactly those that
    keep the nesting within the ref's bound; walk on the ref's tokens."""
    fast_be, ref_be = (mine, other) if isinstance(mine, fast_so.StructuredOutputBackend) \
        else (other, mine)
    params = StructuredOutputsParams(json_object=True)
    ref_g, fast_g = ref_be.compile(params), fast_be.compile(params)
    v, tokens = ref_be.vocab.vocab_size, ref_be.vocab.token_bytes
    guide = json_object_guide()
    rng, dist, state, text = random.Random(seed), distances(guide), 0, b""
    for step in range(max_steps):
        if ref_g.is_terminated():
            break
        ref_mask, fast_mask = mask_of(ref_g, v), mask_of(fast_g, v)
        assert not (ref_mask & ~fast_mask).any(), f"the ref allows more after {text!r}"
        for t in (fast_mask & ~ref_mask).nonzero().flatten().tolist():
            assert tokens[t] is not None and max_depth(text + tokens[t]) > 3, (
                f"after {text!r} only the fast twin allows {tokens[t]!r} (within the depth)")
        token = choose(ref_mask.nonzero().flatten().tolist(), ref_be.vocab, guide, dist,
                        state, rng, step / max_steps)
        assert ref_g.accept_tokens([token]) and fast_g.accept_tokens([token])
        text += tokens[token] or b""
        state = guide.walk(state, tokens[token] or b"")
    return text


@so_settings(10)
@given(seed=st.integers(0, 2**16))
def test_json_object_within_the_depth_bound(backends, seed):
    mine, other = backends("synthetic")
    text = json_object_walk(mine, other, seed, max_steps=40)
    assert text.startswith(b"{")


# ------------------------------------------------------------------ SmolLM2's vocabulary

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["a", "b c", "é"]}, "minItems": 1, "maxItems": 3},
    "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
    "required": ["name", "tags"]}  # fmt: skip
SMOLLM2_CASES = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(regex=r"(\d{3}-\d{4}|[A-Z][a-z]+ [A-Z]\.), née [^\n,]{2,5}\s?"),
    StructuredOutputsParams(choice=["positive", "negative", "neutral ☺", "mixed, mostly positive"]),
]


@pytest.mark.parametrize("case", range(len(SMOLLM2_CASES)))
def test_smollm2_masks_equal(backends, case):
    mine, other = backends("smollm2")
    params = SMOLLM2_CASES[case]
    pattern = {"json": lambda: schema_to_regex(params.json_schema()),
               "regex": lambda: params.regex,
               "choice": lambda: choice_regex(params.choice)}[params.kind]()
    text, done, _ = walk(params, mine, other, compile_dfa(parse_regex(pattern)), seed=case,
                         max_steps=30)
    if done and params.kind == "json":
        check_json_text(PERSON, text)
    elif done:
        check_regex_text(pattern, text)


@so_settings(3)
@given(schema=json_schemas(max_depth=2), seed=st.integers(0, 2**16))
def test_smollm2_json_schema_masks_equal(backends, schema, seed):
    mine, other = backends("smollm2")
    guide = compile_dfa(parse_regex(schema_to_regex(schema)))
    text, done, _ = walk(StructuredOutputsParams(json=schema), mine, other, guide, seed,
                         max_steps=16)
    if done:
        check_json_text(schema, text)


def test_smollm2_json_object(backends):
    mine, other = backends("smollm2")
    json_object_walk(mine, other, seed=1, max_steps=12)


# ------------------------------------------------------------------ vLLM's JSON options

#: (options, the white space they allow outside strings)
LAYOUTS = [
    (dict(disable_any_whitespace=True), ""),
    (dict(whitespace_pattern=r"[ \n]*"), " \n"),
    (dict(whitespace_pattern=r"\t?"), "\t"),
]


@so_settings(30)
@given(schema=json_schemas(), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_json_layout_options_masks_equal(backends, schema, layout, seed):
    """disable_any_whitespace / whitespace_pattern: the twins agree at every step, and a
    finished document is valid (jsonschema) with white space only where the option allows."""
    options, allowed_space = layout
    mine, other = backends("synthetic")
    params = StructuredOutputsParams(json=schema, **options)
    layout = JsonLayout(options.get("disable_any_whitespace", False),
                        options.get("whitespace_pattern"))
    guide = compile_dfa(parse_regex(schema_to_regex(schema, layout)))  # steers the walk only
    text, done, _ = walk(params, mine, other, guide, seed, max_steps=40)
    decoded = text.decode("utf-8", "replace")  # a cut walk may end inside a character
    assert set(whitespace_outside_strings(decoded)) <= set(allowed_space), decoded
    if done:
        jsonschema.validate(json.loads(text.decode("utf-8", "surrogatepass"), strict=False),
                            schema)


def test_json_object_compact_masks_equal(backends):
    """json_object with disable_any_whitespace: the twins agree; no white space at all."""
    mine, other = backends("synthetic")
    params = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for seed in range(3):
        text, _, _ = walk(params, mine, other, None, seed, max_steps=30)
        assert not whitespace_outside_strings(text.decode("utf-8", "replace")), text
