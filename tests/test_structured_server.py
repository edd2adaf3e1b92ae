"""Structured outputs and tool calls over HTTP, spoken to with the official ``openai`` client.

One ``minivllm serve`` subprocess (a tiny random model, 127.0.0.1) for the
module. The oracles: the offline engine with the same seed (the server must
return exactly its text), ``jsonschema`` and ``re.fullmatch`` for what comes
back, and OpenAI's response shapes (``tool_calls``, ``finish_reason``) as the
client parses them.

Run: ``pytest -q tests/test_structured_server.py --backend=ref`` (and ``=fast``).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from server_utils import ServerProcess, offline_backend, server_backend
from test_server import metrics

from minivllm import LLM, SamplingParams, StructuredOutputsParams

MAX_MODEL_LEN = 320
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]},
    "days": {"enum": [1, 2, 3]}}, "required": ["city", "unit", "days"]}  # fmt: skip
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
                                         "exact": {"type": "boolean"}},
        "required": ["zone", "exact"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"enum": [1, 22, 333]}},
          "required": ["ok", "n"]}
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, request):
    """A served tiny model and the offline LLM as its oracle."""
    spec = server_backend(request.config.getoption("--backend"))
    path = str(tiny_model_dir("llama"))
    server = ServerProcess(path, "--backend", spec, "--max-model-len", str(MAX_MODEL_LEN),
                           "--served-model-name", "tiny")
    llm = LLM(path, backend=offline_backend(spec), device="cpu", max_model_len=MAX_MODEL_LEN)
    try:
        yield server, llm
    finally:
        llm.shutdown()
        server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def offline_chat(llm: LLM, constraint: dict, **kw):
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **kw)
    return llm.chat(MESSAGES, sp, use_tqdm=False)[0].outputs[0]


# --------------------------------------------------------------------------
# The constraint fields: what comes back is what the offline engine gives
# --------------------------------------------------------------------------


def test_completions_structured_outputs_extra_equals_offline(tiny):
    server, llm = tiny
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for seed in (1, 2):
        want = llm.generate("Mail: ", SamplingParams(
            seed=seed, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)),
            use_tqdm=False)[0].outputs[0]
        got = client(server).completions.create(
            model="tiny", prompt="Mail: ", seed=seed, max_tokens=40,
            extra_body={"structured_outputs": {"regex": pattern}}).choices[0]
        assert got.text == want.text and got.finish_reason == want.finish_reason
        if got.finish_reason == "stop":
            assert re.fullmatch(pattern, got.text)


def test_beam_search_with_a_constraint_equals_offline(tiny):
    """``use_beam_search`` with ``structured_outputs``: every beam follows the choice,
    and the completions are the offline ``LLM.beam_search`` sequences."""
    from minivllm import BeamSearchParams

    server, llm = tiny
    choices = ["Paris", "Oslo", "Lima", "Pa"]
    want = llm.beam_search(["City: "], BeamSearchParams(
        beam_width=3, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)))
    got = client(server).completions.create(
        model="tiny", prompt="City: ", n=3, max_tokens=8,
        extra_body={"use_beam_search": True, "structured_outputs": {"choice": choices}})
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [s.text for s in want[0].sequences]
    assert all(t in choices for t in texts)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema_and_json_object(tiny, stream):
    server, llm = tiny
    c = client(server)
    formats = [({"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                        "strict": True}}, dict(json=SCHEMA)),
               ({"type": "json_object"}, dict(json_object=True))]
    for response_format, constraint in formats:
        want = offline_chat(llm, constraint, seed=3, max_tokens=60)
        got = c.chat.completions.create(model="tiny", messages=MESSAGES, seed=3,
                                        max_tokens=60, response_format=response_format,
                                        stream=stream)
        if stream:
            chunks = [ch.choices[0] for ch in got if ch.choices]
            text = "".join(ch.delta.content or "" for ch in chunks)
            finish = chunks[-1].finish_reason
        else:
            text, finish = got.choices[0].message.content, got.choices[0].finish_reason
        assert text == want.text and finish == want.finish_reason
    doc = offline_chat(llm, dict(json=SCHEMA), seed=3, max_tokens=60)
    assert doc.finish_reason == "stop"
    jsonschema.validate(json.loads(doc.text), SCHEMA)


def test_choice_and_n_over_chat(tiny):
    server, _ = tiny
    choices = ["alpha", "beta", "gamma delta"]
    got = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, n=4, seed=5, max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}})
    assert len(got.choices) == 4
    for ch in got.choices:
        assert ch.message.content in choices and ch.finish_reason == "stop"


# --------------------------------------------------------------------------
# Tool calls
# --------------------------------------------------------------------------


def test_named_tool_call_returns_openai_tool_calls(tiny):
    server, _ = tiny
    c = client(server)
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, seed=7, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = c.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls"
    assert msg.message.content is None and len(msg.message.tool_calls) == 1
    call = msg.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Streamed: the id and name first, then pieces of the arguments, the same in all.
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw)
              if ch.choices]
    pieces = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in pieces[1:])
    assert "".join(tc.function.arguments for tc in pieces) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    assert all(not ch.delta.content for ch in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_name_a_tool_with_valid_arguments(tiny, stream):
    server, _ = tiny
    got = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=11,
        max_tokens=200, stream=stream)
    if stream:
        chunks = [ch.choices[0] for ch in got if ch.choices]
        calls = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
        finish = chunks[-1].finish_reason
    else:
        calls, finish = got.choices[0].message.tool_calls, got.choices[0].finish_reason
    assert finish == "tool_calls" and calls
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id and call.type == "function"


# --------------------------------------------------------------------------
# Isolation and bad input
# --------------------------------------------------------------------------


def test_unconstrained_greedy_is_unchanged_by_concurrent_constrained_requests(tiny):
    server, llm = tiny
    want = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                                 max_retries=0, timeout=120)

    async def go():
        constrained = [aclient.chat.completions.create(
            model="tiny", messages=MESSAGES, seed=s, max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": SCHEMA}})
            for s in range(4)]
        plain = aclient.completions.create(model="tiny", prompt="The quick", temperature=0,
                                           max_tokens=24, extra_body={"ignore_eos": True})
        return await asyncio.gather(plain, *constrained)

    plain, *constrained = asyncio.run(go())
    assert plain.choices[0].text == want[0].outputs[0].text
    for r in constrained:
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


BAD = [
    (dict(extra_body={"structured_outputs": {"regex": "(ab"}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= nowhere"}}),
     "structured_outputs.grammar"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
     "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    (dict(tool_choice="required"), "tools"),
    (dict(tools=TOOLS[:1] * 2, tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    (dict(n=2, response_format={"type": "json_object"},
          extra_body={"use_beam_search": True, "ignore_eos": True}), "response_format"),
]


@pytest.mark.parametrize("kw,field", BAD, ids=[f for _, f in BAD])
def test_bad_constraints_are_400s_naming_the_field(tiny, kw, field):
    server, llm = tiny
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **kw)
    assert info.value.body["param"] == field, info.value.body
    assert field.split(".")[0] in info.value.body["message"]
    # The server goes on serving, and nothing was left in the engine.
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=4, seed=1,
                              extra_body={"structured_outputs": {"regex": "[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}", ok.choices[0].text)
    m = metrics(server, None)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0


def test_auto_tool_choice_needs_the_servers_parser_flags(tiny):
    """Without --enable-auto-tool-choice, "auto" (also when left out with tools) is vLLM's 400."""
    server, _ = tiny
    for kw in (dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto")):
        with pytest.raises(openai.BadRequestError) as info:
            client(server).chat.completions.create(model="tiny", messages=MESSAGES,
                                                   max_tokens=4, **kw)
        body = info.value.body
        assert body["param"] == "tool_choice", body
        assert "--enable-auto-tool-choice" in body["message"]
        assert "--tool-call-parser" in body["message"]


def test_completions_bad_regex_and_tool_choice_none(tiny):
    server, _ = tiny
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="x", max_tokens=4,
                             extra_body={"structured_outputs": {"regex": "[z-a]"}})
    assert info.value.body["param"] == "structured_outputs.regex"
    got = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                    tool_choice="none", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].message.tool_calls is None and got.choices[0].finish_reason == "length"
