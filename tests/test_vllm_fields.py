"""What a vLLM user sends is honoured or refused, never ignored.

:data:`VLLM_FIELDS` lists every field of vLLM's ``CompletionRequest`` and
``ChatCompletionRequest``, written from ``vllm/entrypoints/openai/protocol.py``
at vLLM commit ec3b890c14b00f6670515d9df8d503b5270e95ca (the protocol with
``structured_outputs`` / ``StructuredOutputsParams``), each with its status in
minivllm:

- ``honoured``: a field of minivllm's request model, with vLLM's meaning; the
  row names the test of its effect (checked to exist);
- ``refused``: a 400 naming the field when it asks for something
  (:mod:`minivllm.entrypoints.openai.fields`, or a check of the model); the row
  holds a value to send, and every refused field is sent over HTTP;
- ``pending``: being implemented elsewhere at the time of writing; the table
  makes no claim yet (marked ``# MERGE:``, for whoever merges that work).

The suite fails when the table and the server disagree: a field marked
honoured that the request model lacks or refuses, a refused field that comes
back 200, a refusal the table does not list, a model field the table does not
know. ``docs/coming_from_vllm.md`` says the same for readers.
"""

from __future__ import annotations

import ast
import json
import pathlib
import time
from typing import NamedTuple

import httpx
import jsonschema
import pytest
from server_utils import ServerProcess, server_backend

from minivllm.entrypoints.openai import fields
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.structured import request_constraint
from minivllm.sampling_params import BeamSearchParams

C, CHAT, BOTH = ("completions",), ("chat",), ("completions", "chat")
HERE = "tests/test_vllm_fields.py"
SERVER = "tests/test_server.py"
MAP = f"{HERE}::test_sampling_fields_reach_the_engine_as_vllm_maps_them"


class Row(NamedTuple):
    endpoints: tuple[str, ...]
    status: str  # "honoured" | "refused" | "pending"
    evidence: object  # honoured: "file::test"; refused: a value that asks for something


def H(endpoints, test):  # noqa: N802 - a table reads better with short row makers
    return Row(endpoints, "honoured", test)


def R(endpoints, value):  # noqa: N802
    return Row(endpoints, "refused", value)


def P(endpoints):  # noqa: N802
    return Row(endpoints, "pending", None)


VLLM_FIELDS: dict[str, Row] = {
    # OpenAI's own fields
    "model": H(BOTH, f"{SERVER}::test_every_bad_input_gets_its_4xx_and_the_server_still_answers"),
    "prompt": H(C, f"{SERVER}::test_streamed_equals_full_equals_offline_with_exact_usage"),
    "messages": H(CHAT, f"{SERVER}::test_chat_uses_the_chat_template"),
    "frequency_penalty": H(BOTH, MAP),
    "presence_penalty": H(BOTH, MAP),
    "logprobs": H(BOTH, f"{SERVER}::test_logprobs_match_the_offline_engine_streamed_or_not"),
    "top_logprobs": H(CHAT, MAP),
    "max_tokens": H(BOTH, MAP),
    "max_completion_tokens": H(CHAT, MAP),
    "n": H(BOTH, f"{SERVER}::test_n2_with_seed_is_reproducible_distinct_and_matches_seed_plus_i"),
    "seed": H(BOTH, f"{SERVER}::test_n2_with_seed_is_reproducible_distinct_and_matches_seed_plus_i"),
    "stop": H(BOTH, f"{SERVER}::test_stop_strings_cut_the_text_streamed_or_not"),
    "stream": H(BOTH, f"{SERVER}::test_streamed_equals_full_equals_offline_with_exact_usage"),
    "stream_options": H(BOTH, f"{SERVER}::test_streamed_equals_full_equals_offline_with_exact_usage"),
    "temperature": H(BOTH, MAP),
    "top_p": H(BOTH, MAP),
    "user": H(BOTH, f"{HERE}::test_user_changes_nothing_as_in_vllm"),
    "suffix": R(C, "and then"),  # vLLM refuses it too
    "response_format": H(BOTH, f"{HERE}::test_response_format_on_completions_merges_with_structured_outputs"),
    "reasoning_effort": R(CHAT, "low"),
    "include_reasoning": R(CHAT, False),
    # vLLM's sampling extras
    "use_beam_search": H(BOTH, f"{SERVER}::test_use_beam_search_returns_the_offline_beams"),
    "top_k": H(BOTH, MAP),
    "min_p": H(BOTH, MAP),
    "repetition_penalty": H(BOTH, MAP),
    "length_penalty": H(BOTH, MAP),
    "stop_token_ids": H(BOTH, MAP),
    "include_stop_str_in_output": H(BOTH, MAP),
    "ignore_eos": H(BOTH, MAP),
    "min_tokens": H(BOTH, MAP),
    "skip_special_tokens": H(BOTH, MAP),
    "spaces_between_special_tokens": H(BOTH, f"{HERE}::test_spaces_between_special_tokens_decodes_as_the_tokenizer"),
    "truncate_prompt_tokens": H(BOTH, f"{SERVER}::test_truncate_prompt_tokens_serves_the_prompts_last_tokens"),
    "structured_outputs": H(BOTH, "tests/test_structured_server.py::test_completions_structured_outputs_extra_equals_offline"),
    # vLLM's other extras
    "add_generation_prompt": H(CHAT, "tests/test_chat_template.py::test_chat_templates_over_http"),
    "continue_final_message": H(CHAT, "tests/test_chat_template.py::test_chat_templates_over_http"),
    "chat_template": H(CHAT, "tests/test_chat_template.py::test_chat_templates_over_http"),
    "chat_template_kwargs": H(CHAT, "tests/test_chat_template.py::test_chat_templates_over_http"),
    "add_special_tokens": H(BOTH, f"{HERE}::test_add_special_tokens_and_documents_shape_the_prompt"),
    "documents": H(CHAT, f"{HERE}::test_add_special_tokens_and_documents_shape_the_prompt"),
    "request_id": H(BOTH, f"{HERE}::test_request_id_names_the_response"),
    "return_tokens_as_token_ids": H(BOTH, f"{HERE}::test_return_tokens_as_token_ids"),
    "return_token_ids": R(BOTH, True),
    "prompt_embeds": R(C, "AAAA"),
    "mm_processor_kwargs": R(CHAT, {"num_crops": 4}),
    "logits_processors": R(BOTH, ["my_module.MyProcessor"]),
    "cache_salt": R(BOTH, "a-secret-salt"),
    "kv_transfer_params": R(BOTH, {"do_remote_decode": True}),
    "vllm_xargs": R(BOTH, {"my_key": 1}),
    "logit_bias": H(BOTH, f"{SERVER}::test_logit_bias_allowed_token_ids_and_bad_words_match_the_offline_engine"),
    "allowed_token_ids": H(BOTH, f"{SERVER}::test_logit_bias_allowed_token_ids_and_bad_words_match_the_offline_engine"),
    # bad_words: chat's in vLLM's protocol at that commit; minivllm takes it on both.
    "bad_words": H(BOTH, f"{SERVER}::test_logit_bias_allowed_token_ids_and_bad_words_match_the_offline_engine"),
    "tools": H(CHAT, "tests/test_structured_server.py::test_named_tool_call_returns_openai_tool_calls"),
    "tool_choice": H(CHAT, "tests/test_tool_calling_server.py::test_auto_finds_the_models_call"),
    "parallel_tool_calls": H(CHAT, "tests/test_structured_server.py::test_required_tool_calls_name_a_tool_with_valid_arguments"),
    "prompt_logprobs": H(BOTH, "tests/test_server_prompt_logprobs.py::test_completions_prompt_logprobs_on_each_choice"),
    # echo: completions' (the prompt leads) and chat's (the last message leads, vLLM's);
    # tests/test_server_prompt_logprobs.py::test_echo_leads_with_the_prompt_streamed_or_not
    "echo": H(BOTH, f"{HERE}::test_chat_echo_starts_with_the_last_message"),
    "priority": H(BOTH, "tests/test_server_prompt_logprobs.py::test_priority_field_is_taken_and_checked"),
}  # fmt: skip

#: Fields of minivllm's request models that vLLM's have not (OpenAI's ``best_of``:
#: refused unless it equals ``n``, as vLLM's protocol dropped it).
MINIVLLM_ONLY = {"best_of"}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def rows(endpoint: str, status: str | None = None) -> dict[str, Row]:
    return {n: r for n, r in VLLM_FIELDS.items()
            if endpoint in r.endpoints and (status is None or r.status == status)}


# ------------------------------------------------------------------ the table against the code


@pytest.mark.parametrize("endpoint", MODELS)
def test_every_vllm_field_is_honoured_or_refused(endpoint):
    model = MODELS[endpoint]
    known = set(model.model_fields)
    for name, row in rows(endpoint).items():
        listed = fields.known_to_vllm(name, endpoint)
        if row.status == "honoured":
            assert name in known, f"{name} is marked honoured but {model.__name__} lacks it"
            assert not listed, f"{name} is marked honoured but fields.REFUSED refuses it"
        elif row.status == "refused":
            assert listed or name in known, f"{name} is marked refused but nothing refuses it"
    for name, refusal in fields.REFUSED.items():
        assert VLLM_FIELDS[name].status == "refused", f"fields.REFUSED has {name}"
        assert set(refusal.endpoints) == set(VLLM_FIELDS[name].endpoints), name
    unknown = known - set(rows(endpoint)) - MINIVLLM_ONLY
    assert not unknown, f"{model.__name__} has fields the table does not list: {unknown}"


def test_every_honoured_field_points_to_a_test_that_exists():
    for name, row in VLLM_FIELDS.items():
        if row.status != "honoured":
            continue
        path, test = row.evidence.split("::")
        tree = ast.parse(pathlib.Path(path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert test in names, f"{name}: {row.evidence} does not exist"


# ------------------------------------------------------------------ the mapping


def _chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


#: (request field, value, SamplingParams attribute, what vLLM makes of it)
SAMPLING = [
    ("n", 3, "n", 3), ("temperature", 0.5, "temperature", 0.5), ("top_p", 0.25, "top_p", 0.25),
    ("top_k", 5, "top_k", 5), ("min_p", 0.125, "min_p", 0.125), ("seed", 7, "seed", 7),
    ("presence_penalty", 0.5, "presence_penalty", 0.5),
    ("frequency_penalty", -1.5, "frequency_penalty", -1.5),
    ("repetition_penalty", 1.25, "repetition_penalty", 1.25),
    ("max_tokens", 9, "max_tokens", 9), ("min_tokens", 4, "min_tokens", 4),
    ("stop", "##", "stop_strings", ["##"]), ("stop_token_ids", [3, 5], "stop_token_ids", [3, 5]),
    ("ignore_eos", True, "ignore_eos", True),
    ("skip_special_tokens", False, "skip_special_tokens", False),
    ("spaces_between_special_tokens", False, "spaces_between_special_tokens", False),
    ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
    ("truncate_prompt_tokens", 6, "truncate_prompt_tokens", 6),
]


@pytest.mark.parametrize("field, value, attr, expected", SAMPLING)
@pytest.mark.parametrize("endpoint", MODELS)
def test_sampling_fields_reach_the_engine_as_vllm_maps_them(endpoint, field, value, attr,
                                                            expected):
    make = (lambda **kw: CompletionRequest(prompt="hi", **kw)) if endpoint == "completions" \
        else _chat
    sp = make(**{field: value}).to_sampling_params()
    assert getattr(sp, attr) == expected
    default = getattr(make().to_sampling_params(), attr)
    assert default != expected, "the value must differ from the default to show an effect"


def test_chat_only_and_beam_fields_map_as_vllm():
    # max_completion_tokens wins over max_tokens; top_logprobs needs logprobs.
    sp = _chat(max_tokens=30, max_completion_tokens=9, logprobs=True, top_logprobs=2)
    assert (sp.to_sampling_params().max_tokens, sp.to_sampling_params().logprobs) == (9, 2)
    assert _chat(logprobs=True).to_sampling_params().logprobs == 0
    beam = CompletionRequest(prompt="hi", use_beam_search=True, n=3, length_penalty=0.5,
                             max_tokens=4).engine_params()
    assert beam == BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5)


def test_response_format_on_completions_merges_with_structured_outputs():
    """vLLM's merge: response_format sets the constraint, structured_outputs' options
    apply to it; two different constraints are a 400 naming response_format."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for make in (lambda **kw: CompletionRequest(prompt="hi", **kw), _chat):
        c = request_constraint(make(response_format=rf))
        assert c.params.json == schema and not c.params.disable_any_whitespace
        c = request_constraint(make(response_format=rf,
                                    structured_outputs={"disable_any_whitespace": True}))
        assert c.params.json == schema and c.params.disable_any_whitespace
        c = request_constraint(make(response_format={"type": "json_object"},
                                    structured_outputs={"json_object": True}))
        assert c.params.json_object is True  # the same constraint twice: no conflict
        assert request_constraint(make(response_format={"type": "text"})) is None
        for so, param in (({"regex": "a+"}, "response_format"),
                          ({"structural_tag": "{}"}, "structured_outputs.structural_tag")):
            with pytest.raises(Exception) as e:
                request_constraint(make(response_format=rf, structured_outputs=so))
            assert (e.value.status, e.value.param) == (400, param)
        with pytest.raises(Exception) as e:
            request_constraint(make(response_format={"type": "structural_tag"}))
        assert (e.value.status, e.value.param) == (400, "response_format")
        with pytest.raises(Exception) as e:
            request_constraint(make(structured_outputs={"regex": "a",
                                                        "disable_any_whitespace": True}))
        assert e.value.param == "structured_outputs.disable_any_whitespace"


def test_spaces_between_special_tokens_decodes_as_the_tokenizer(smollm2_dir):
    """The detokenizer passes the option to ``decode``, as vLLM's does: the oracle is the
    tokenizer's own ``decode`` of the whole output (a fast tokenizer writes no space)."""
    from transformers import AutoTokenizer

    from minivllm.engine.output_processor import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tok.encode("Hi", add_special_tokens=False) + special + special[::-1] + \
        tok.encode(" there", add_special_tokens=False)
    for spaces in (True, False):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
        for t in ids:
            d.update([t])
        assert d.output_text == tok.decode(ids, skip_special_tokens=False,
                                           spaces_between_special_tokens=spaces)


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def served(tiny_model_dir, request):
    """A served tiny model that takes request templates, and its tokenizer."""
    from transformers import AutoTokenizer

    spec = server_backend(request.config.getoption("--backend"))
    path = str(tiny_model_dir("llama"))
    server = ServerProcess(path, "--backend", spec, "--max-model-len", "256",
                           "--served-model-name", "tiny", "--trust-request-chat-template")
    try:
        yield server, AutoTokenizer.from_pretrained(path)
    finally:
        server.stop()


def post(server, endpoint: str, **body) -> httpx.Response:
    path, base = ("completions", {"prompt": "hi"}) if endpoint == "completions" else \
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    return httpx.post(f"{server.base_url}/v1/{path}", timeout=60,
                      json={"model": "tiny", "max_tokens": 2, **base, **body})


REFUSED_CASES = [(e, n) for e in MODELS for n in rows(e, "refused")]


@pytest.mark.parametrize("endpoint, name", REFUSED_CASES)
def test_a_refused_field_is_a_400_naming_it(served, endpoint, name):
    server, _ = served
    r = post(server, endpoint, **{name: VLLM_FIELDS[name].evidence})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"]
    if name in fields.REFUSED:  # the message says why
        assert fields.REFUSED[name].reason in error["message"]


def test_inert_values_of_refused_fields_are_accepted_and_not_logged(served):
    server, _ = served
    for endpoint in MODELS:
        inert = {n: r.inert[-1] for n, r in fields.REFUSED.items() if endpoint in r.endpoints}
        r = post(server, endpoint, **inert, zz_not_a_vllm_field=1)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while sum("zz_not_a_vllm_field" in line for line in server.log) < 2 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    warnings = [line for line in server.log if "zz_not_a_vllm_field" in line]
    assert len(warnings) == 2  # vLLM's rule: fields it does not know are logged
    assert not any(n in w for w in warnings for n in fields.REFUSED)


def test_user_changes_nothing_as_in_vllm(served):
    server, _ = served
    for endpoint in MODELS:
        plain = post(server, endpoint, temperature=0, max_tokens=6).json()
        with_user = post(server, endpoint, temperature=0, max_tokens=6, user="u-1").json()
        assert with_user["choices"] == plain["choices"]
    assert not any("'user'" in line for line in server.log)


def test_request_id_names_the_response(served):
    server, _ = served
    for endpoint, prefix in (("completions", "cmpl"), ("chat", "chatcmpl")):
        a, b = (post(server, endpoint, request_id="my-req-7") for _ in range(2))
        assert a.json()["id"] == b.json()["id"] == f"{prefix}-my-req-7"  # reused: still served
        assert post(server, endpoint).json()["id"].startswith(f"{prefix}-")
        assert post(server, endpoint, request_id="").status_code == 400


def test_add_special_tokens_and_documents_shape_the_prompt(served):
    """The prompt's token count is the tokenizer's count of the text vLLM would render."""
    server, tok = served
    for add in (True, False):
        usage = post(server, "completions", prompt="Hello there", add_special_tokens=add)
        assert usage.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello there",
                                                                        add_special_tokens=add))
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    for add in (True, False):
        r = post(server, "chat", chat_template=template, documents=docs,
                 add_special_tokens=add, add_generation_prompt=False)
        want = tok.encode("[A: alpha][B: beta]hi", add_special_tokens=add)
        assert r.json()["usage"]["prompt_tokens"] == len(want), r.text


def test_return_tokens_as_token_ids(served):
    """Each logprob token is "token_id:N", N the id whose text the plain answer has."""
    server, tok = served
    body = dict(temperature=0, max_tokens=5, ignore_eos=True)
    plain = post(server, "completions", logprobs=2, **body).json()["choices"][0]["logprobs"]
    ids = post(server, "completions", logprobs=2, return_tokens_as_token_ids=True,
               **body).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in ids["tokens"])
    assert [tok.decode([int(t.split(":")[1])]) for t in ids["tokens"]] == plain["tokens"]
    assert all(k.startswith("token_id:") for top in ids["top_logprobs"] for k in top)
    chat = post(server, "chat", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True,
                **body).json()["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in chat)


def test_response_format_on_completions_over_http(served):
    server, _ = served
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for so, space in ((None, True), ({"disable_any_whitespace": True}, False)):
        r = post(server, "completions", response_format=rf, structured_outputs=so,
                 max_tokens=40, temperature=0)
        text = r.json()["choices"][0]["text"]
        jsonschema.validate(json.loads(text), schema)
        assert (" " in text) == space, text
    r = post(server, "completions", response_format=rf, structured_outputs={"choice": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_chat_echo_starts_with_the_last_message(served):
    """vLLM's chat ``echo``: the answer starts with the last message's content when that
    message has the reply's role (continuing an assistant turn), and with nothing else;
    streamed deltas add up to the same text."""
    server, _ = served
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = dict(messages=turn, add_generation_prompt=False, continue_final_message=True,
                temperature=0, max_tokens=4, ignore_eos=True)
    plain = post(server, "chat", **body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "chat", echo=True, **body).json()["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "stream": True, "echo": True, **body}) as r:
        parts = [json.loads(line[6:]) for line in r.iter_lines()
                 if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in parts
                   if c["choices"]) == echoed
    # The last message is the user's and the reply is the assistant's: nothing to echo.
    user_last = dict(temperature=0, max_tokens=4, ignore_eos=True)
    assert post(server, "chat", echo=True, **user_last).json()["choices"][0]["message"][
        "content"] == post(server, "chat", **user_last).json()["choices"][0]["message"]["content"]
