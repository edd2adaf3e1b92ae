"""Structured outputs through the engine: valid outputs, isolation, preemption, n, bad input.

The component's own tests (tests/test_structured_output*.py) prove the twins
allow the same tokens; these prove the engine uses them right. The oracles are
independent of the engine: Python's ``re`` / the ``regex`` package (full and
partial matches), ``jsonschema`` and ``json.loads``, the choice list, and the
engine itself run *without* the thing under test (alone, unpreempted, in one
chunk, with n = 1 and ``seed + i``) for the scheduling cases.

A tiny random model (256 byte tokens) samples at temperature 1, so an output
may run into ``max_tokens`` before the constraint lets it end: such an output
must still be a *prefix* of a valid one (a partial match), and a finished one
a full match. SmolLM2 answers a few fixed constraints at temperature > 0.

Run: ``pytest -q tests/test_structured_engine.py --backend=ref`` (and ``=fast``).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import regex as regex_pkg
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kernel_utils import examples
from structured_utils import fullmatch, python_regex, whitespace_is_canonical

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.outputs import RequestFailedError
from minivllm.structured_output.json_schema import schema_to_regex
from minivllm.structured_output.regex import parse_regex
from minivllm.testing.strategies import json_schemas, regex_patterns

PROMPTS = ["hello", "The answer is ", "{", "x" * 23]


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 320)
    return LLM(str(path), dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), block_size=8)
    yield llm
    llm.shutdown()


def so_params(seed: int, max_tokens: int = 96, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def run(llm: LLM, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    """Nothing left behind: every KV block free, no grammar, no request state."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    assert engine.structured.grammars == {} and engine.output_processor.states == {}


def check_regex(pattern: str, c) -> None:
    """A finished output fully matches; a cut one is a prefix of a match. A UTF-8-encoded
    surrogate is one code point to the grammar (``.`` matches it, as in xgrammar) and three
    U+FFFD to the detokenizer, so such an output is read from its bytes, as check_json does."""
    tree = parse_regex(pattern)
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    text = c.text if "\ufffd" not in c.text else surrogate_text(c.token_ids)
    if c.finish_reason == "stop":
        assert fullmatch(tree, text.encode("utf-8", "surrogatepass")), (pattern, text)
    else:
        assert regex_pkg.fullmatch(python_regex(tree), text, regex_pkg.DOTALL,
                                   partial=True), (pattern, text)


def surrogate_text(token_ids) -> str:
    """The byte tokenizer's output bytes, decoded with ``surrogatepass`` (code points as the
    grammar counts them); an incomplete last code point (an output cut by max_tokens) is
    left out."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {i: b for i, b in enumerate(bytes_to_unicode())}  # the vocabulary's order
    data = bytes(byte_of[t] for t in token_ids if t in byte_of)
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:  # an output cut inside its last code point: the rest
        if e.reason != "unexpected end of data":
            raise
        return data[: e.start].decode("utf-8", "surrogatepass")


def check_json(schema: dict, c) -> None:
    """A finished output is a document valid under ``schema``, in ``json.dumps``'s spacing;
    a cut one is a prefix of one (a partial match of the schema's regex)."""
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    if c.finish_reason == "stop":
        # strict=False: a bounded string (maxLength) may hold raw control characters, as
        # xgrammar writes it (docs/structured_outputs.md, "Known gaps"); it may also hold
        # a UTF-8-encoded surrogate (one code point to the grammar, as to xgrammar), which
        # the detokenizer writes as three U+FFFD: read the output's bytes as the grammar does.
        text = c.text if "\ufffd" not in c.text else surrogate_text(c.token_ids)
        jsonschema.validate(json.loads(text, strict=False), schema)
        assert whitespace_is_canonical(text), text
    else:
        pattern = python_regex(parse_regex(schema_to_regex(schema)))
        assert regex_pkg.fullmatch(pattern, c.text, regex_pkg.DOTALL, partial=True), c.text


def so_settings(n: int) -> settings:
    """At most ``n`` examples (each one runs the engine); the module's LLM is reused."""
    return settings(max_examples=examples(n), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# Valid outputs: hypothesis-drawn constraints on the tiny model
# --------------------------------------------------------------------------


@so_settings(6)
@given(pattern=regex_patterns(), seed=st.integers(0, 2**16))
@example(pattern="(?:.-)*", seed=0)  # samples a surrogate (ED A0 ..): three U+FFFD in the text
def test_regex_outputs_match(tiny, pattern, seed):
    outs = run(tiny, PROMPTS[:2], [so_params(seed, regex=pattern),
                                   so_params(seed + 1, regex=pattern)])
    for c in outs:
        check_regex(pattern, c)
    assert_clean(tiny)


@so_settings(6)
@given(schema=json_schemas(), seed=st.integers(0, 2**16))
def test_json_outputs_are_valid(tiny, schema, seed):
    outs = run(tiny, PROMPTS[:2], [so_params(seed, json=schema),
                                   so_params(seed + 1, json=json.dumps(schema))])
    for c in outs:
        check_json(schema, c)
    assert_clean(tiny)


def test_choice_json_object_and_termination(tiny):
    choices = ["yes", "no", "maybe not", "中文"]
    outs = run(tiny, PROMPTS + PROMPTS[:1], [so_params(s, choice=choices) for s in range(4)]
               + [so_params(9, max_tokens=200, json_object=True)])
    for c in outs[:4]:
        # The constraint is complete after the choice: the request ends there, without
        # waiting for EOS (nothing but EOS could follow).
        assert c.finish_reason == "stop" and c.text in choices
    if outs[4].finish_reason == "stop":
        assert isinstance(json.loads(outs[4].text), dict)
    assert_clean(tiny)


def test_ignore_eos_and_min_tokens_meet_the_constraint(tiny):
    """The grammar ends the request even with ignore_eos (nothing may follow its end)
    and even below min_tokens (nothing but EOS may follow, which min_tokens forbids)."""
    pattern = "ab(c|de)"
    outs = run(tiny, PROMPTS[:3], [
        so_params(1, regex=pattern),
        SamplingParams(seed=2, ignore_eos=True, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=pattern)),
        SamplingParams(seed=3, min_tokens=10, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=pattern))])
    for c in outs:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c
    # Below min_tokens a regex that may go on must go on: EOS is suppressed, not the text.
    out = run(tiny, PROMPTS[0], SamplingParams(seed=4, min_tokens=6, max_tokens=40,
                                               structured_outputs=StructuredOutputsParams(
                                                   regex="[a-c]+")))[0]
    assert len(out.token_ids) >= 6 and re.fullmatch("[a-c]+", out.text)
    assert_clean(tiny)


def test_dead_end_fails_that_request_alone(tiny):
    """A constraint that admits only the empty output cannot meet min_tokens: the request
    ends with finish_reason "error" and a message; its neighbours finish normally."""
    params = [SamplingParams(seed=1, min_tokens=1, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=[""])),
              so_params(2, regex="[0-9]{3}"),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    with pytest.raises(RequestFailedError) as info:
        tiny.generate(PROMPTS[:3], params, use_tqdm=False)
    outs = [o.outputs[0] for o in info.value.outputs]
    assert outs[0].finish_reason == "error"
    assert "dead end" in str(info.value.outputs[0].error)
    assert re.fullmatch("[0-9]{3}", outs[1].text) and outs[1].finish_reason == "stop"
    assert len(outs[2].token_ids) == 8
    assert_clean(tiny)


# --------------------------------------------------------------------------
# Isolation: constraints never leak between requests
# --------------------------------------------------------------------------


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    alone = run(tiny, PROMPTS[:2], [greedy, seeded])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    mixed = run(tiny, [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
                [greedy, so_params(1, regex="[a-z]{5,30}"), seeded, so_params(2, json=schema)])
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[1].token_ids
    check_regex("[a-z]{5,30}", mixed[1])
    check_json(schema, mixed[3])
    assert_clean(tiny)


def test_a_grammar_failure_ends_that_request_alone(tiny):
    """A grammar that raises mid-generation (here: made to) fails its request only."""
    engine = tiny.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run(tiny, PROMPTS[1], greedy)[0].token_ids
    bad = engine.add_request(None, [5, 6, 7], so_params(1, regex="[a-z]{20}"))
    good = engine.add_request(None, [8, 9], so_params(2, regex="[a-z]{4}"))
    plain = engine.add_request(PROMPTS[1], tiny.get_tokenizer().encode(PROMPTS[1]), greedy)
    grammar = engine.structured.grammars[bad]

    class Broken:
        def __getattr__(self, name):
            return getattr(grammar, name)

        def accept_tokens(self, ids):
            if grammar.num_accepted_tokens >= 3:
                raise RuntimeError("the grammar broke")
            return grammar.accept_tokens(ids)

    engine.structured.grammars[bad] = Broken()
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final[bad].outputs[0].finish_reason == "error"
    assert "the grammar broke" in str(final[bad].error)
    assert re.fullmatch("[a-z]{4}", final[good].outputs[0].text)
    assert final[plain].outputs[0].token_ids == want
    assert_clean(tiny)


# --------------------------------------------------------------------------
# Scheduling: preemption, chunked prefill, prefix caching, n > 1, pipelines
# --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"]}  # fmt: skip


def _mixed_batch():
    prompts = [list(range(40 + i, 40 + i + n)) for i, n in enumerate([21, 5, 33, 12, 17, 9])]
    params = [so_params(10 + i, max_tokens=60, **kw) for i, kw in enumerate(
        [dict(json=SCHEMA), dict(regex="[a-f]{3,9}-[0-9]{2}"), dict(choice=["red", "green"]),
         dict(json=SCHEMA), dict(regex=r"\d+(\.\d\d)?"), dict(json_object=True)])]
    return [{"prompt_token_ids": p} for p in prompts], params


def _check_mixed(outs) -> None:
    check_json(SCHEMA, outs[0])
    check_regex("[a-f]{3,9}-[0-9]{2}", outs[1])
    assert outs[2].text in ("red", "green")
    check_json(SCHEMA, outs[3])
    check_regex(r"\d+(\.\d\d)?", outs[4])


def test_preemption_chunked_prefill_and_prefix_caching_keep_the_grammar_state(tiny_model_dir):
    """Seeded requests give the same tokens however they are scheduled: preempted and
    recomputed (a tiny pool), prefilled in chunks, sharing cached prefix blocks."""
    path = tiny_model_dir("llama")
    prompts, params = _mixed_batch()
    base = make_llm(path, block_size=4)
    want = run(base, prompts, params)
    base.shutdown()
    _check_mixed(want)
    for kw in (dict(num_gpu_blocks_override=40, max_num_batched_tokens=64, max_model_len=160),
               dict(max_num_batched_tokens=7), dict(enable_prefix_caching=False)):
        llm = make_llm(path, block_size=4, **kw)
        engine = llm.llm_engine
        ids = [engine.add_request(None, p["prompt_token_ids"], sp)
               for p, sp in zip(prompts, params)]
        final, preempted = {}, 0
        while engine.has_unfinished_requests():
            outs, stats = engine.step_with_stats()
            preempted += len(stats.preempted_req_ids)
            final.update({o.request_id: o.outputs[0] for o in outs if o.finished})
        if "num_gpu_blocks_override" in kw:
            assert preempted > 0, "the pool was meant to force preemption"
        assert [final[i].token_ids for i in ids] == [w.token_ids for w in want], kw
        assert_clean(llm)
        llm.shutdown()


def test_n_completions_each_follow_the_constraint_from_the_start(tiny):
    """Completion i of n draws from seed + i: it equals a single request with that seed,
    so every child starts from the grammar's start state with its own copy."""
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = tiny.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = run(tiny, [PROMPTS[0]] * 3, [so_params(5 + i, max_tokens=60, json=SCHEMA)
                                           for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in singles]
    for c in out.outputs:
        check_json(SCHEMA, c)
    assert len({c.text for c in out.outputs}) > 1
    assert_clean(tiny)


def test_speculation_is_off_for_constrained_requests(tiny_model_dir, tiny):
    path = tiny_model_dir("llama")
    prompts, params = _mixed_batch()
    # A repetitive prompt gives the n-gram proposer something to propose for the others.
    prompts.append({"prompt_token_ids": [7, 8, 9] * 8})
    params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    want = run(tiny, prompts, params)
    llm = make_llm(path, block_size=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    engine = llm.llm_engine
    ids = [engine.add_request(None, p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished_requests():
        outs, _ = engine.step_with_stats()
        assert all(not engine.scheduler.requests[r].spec_token_ids
                   for r in engine.structured.grammars if r in engine.scheduler.requests)
        final.update({o.request_id: o.outputs[0] for o in outs if o.finished})
    assert [final[i].token_ids for i in ids] == [w.token_ids for w in want]
    assert_clean(llm)
    llm.shutdown()


def test_pipeline_parallel_gives_the_same_constrained_outputs(tiny_model_dir):
    """Masks are built where the logits are sampled (rank 0): two stages with two
    micro-batches in flight give the tokens of one stage."""
    from test_pp_engine import spec_with_ref_kernels

    path = tiny_model_dir("llama", num_hidden_layers=3)
    prompts, params = _mixed_batch()
    outs = {}
    for pp in (1, 2):
        llm = make_llm(path, backend=spec_with_ref_kernels(), block_size=4,
                       pipeline_parallel_size=pp, max_num_batched_tokens=24)
        try:
            outs[pp] = [c.token_ids for c in run(llm, prompts, params)]
            assert_clean(llm)
        finally:
            llm.shutdown()
    assert outs[1] == outs[2]


# --------------------------------------------------------------------------
# Bad input: refused before anything is queued
# --------------------------------------------------------------------------

BAD = [
    (dict(regex="(ab"), "regex"),
    (dict(regex="[z-a]"), "regex"),
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
]


@pytest.mark.parametrize("constraint,field", BAD)
def test_bad_constraints_are_value_errors_and_leave_nothing(tiny, constraint, field):
    engine = tiny.llm_engine
    for n in (1, 3):
        sp = SamplingParams(n=n, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(**constraint))
        with pytest.raises(ValueError, match=rf"^prompts\[0\]: {field}: "):
            tiny.generate(PROMPTS[0], sp, use_tqdm=False)
        with pytest.raises(ValueError, match=f"^{field}: "):
            engine.add_request(None, [1, 2, 3], sp)
        assert_clean(tiny)
        assert not engine.groups
    # The engine serves the next request as if nothing happened.
    ok = run(tiny, PROMPTS[0], so_params(3, regex="[0-9]{2}"))[0]
    assert re.fullmatch("[0-9]{2}", ok.text)
    assert_clean(tiny)


def test_malformed_params_are_refused_when_made():
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_compile_time_cap_is_an_engine_option(tiny_model_dir):
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout_s"):
        make_llm(tiny_model_dir("llama"), structured_outputs_compile_timeout_s=0)


# --------------------------------------------------------------------------
# SmolLM2: fixed constraints, sampled at temperature > 0
# --------------------------------------------------------------------------

# Unbounded strings: one DFA state for a string's characters (the ref walks the 49k
# vocabulary once per new state; a maxLength of 30 would be 30 states).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"type": "string"}}, "required": ["name", "age", "city"]}  # fmt: skip
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
MOODS = ["positive", "negative", "neutral"]


def test_smollm2_answers_follow_the_constraints(smollm2_dir):
    llm = LLM(str(smollm2_dir), device="cpu", max_model_len=512)
    tok = llm.get_tokenizer()

    def chat(text):
        msgs = [{"role": "user", "content": text}]
        ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        return {"prompt_token_ids": ids}

    def sp(seed, **kw):
        return SamplingParams(temperature=0.7, seed=seed, max_tokens=90,
                              structured_outputs=StructuredOutputsParams(**kw))

    prompts = [chat("Describe a person as JSON with name, age and city."),
               chat("When did the first Moon landing happen? Answer with a date."),
               chat("Is 'I loved this film' positive, negative or neutral?")]
    outs = run(llm, prompts, [sp(1, json=PERSON), sp(2, regex=DATE), sp(3, choice=MOODS)])
    try:
        assert outs[0].finish_reason == "stop", outs[0]
        jsonschema.validate(json.loads(outs[0].text), PERSON)
        assert outs[1].finish_reason == "stop" and re.fullmatch(DATE, outs[1].text)
        assert outs[2].finish_reason == "stop" and outs[2].text in MOODS
        assert_clean(llm)
    finally:
        llm.shutdown()
