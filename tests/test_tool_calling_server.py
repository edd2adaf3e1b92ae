"""``tool_choice="auto"`` over HTTP on the real model, spoken to with the official ``openai`` client.

One ``minivllm serve smollm2 --enable-auto-tool-choice --tool-call-parser hermes
--chat-template T`` for the module, where ``T`` is a Hermes-style template
(the tools in ``<tools>``, calls in ``<tool_call>``; SmolLM2's own template
ignores tools). SmolLM2-135M does not call tools on its own, so the call is
elicited honestly: the request constrains its answer with a regex
(``structured_outputs``) to "some text, then a ``<tool_call>`` naming
``get_weather``" and leaves the city and the days to the model. ``tool_choice``
stays ``"auto"`` (nothing about tools is constrained): the server's Hermes
parser must find the call in the text.

Oracles: the offline engine with the same seed, template and constraint
gives the text; the expected call is read out of that text with the test's own
regex (the city and the days), not by the parser; transformers'
``apply_chat_template`` counts the prompt (the tools are described to the
template even with ``tool_choice="none"``, as vLLM does); OpenAI's response
types as the client parses them.

Run: ``pytest -q tests/test_tool_calling_server.py --backend=ref`` (and ``=fast``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest
from server_utils import ServerProcess, offline_backend, server_backend

from minivllm import LLM, SamplingParams, StructuredOutputsParams

MAX_MODEL_LEN = 512
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call these functions, described in <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
To call one, write <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather forecast for a city",
                                           "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris tomorrow?"}]
# The answer the constraint allows: a sentence, then one Hermes call. The test's own reading
# of it (the groups) is the oracle for the call the server must return.
CALL = (r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Oslo|Lima)", "days": ([1-3])\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory, request):
    """The hermes server and the offline LLM (same implementations) as its oracle."""
    spec = server_backend(request.config.getoption("--backend"))
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(str(smollm2_dir), "--backend", spec, "--max-model-len",
                           str(MAX_MODEL_LEN), "--served-model-name", "smol",
                           "--chat-template", str(template), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes")
    llm = LLM(str(smollm2_dir), backend=offline_backend(spec), device="cpu",
              max_model_len=MAX_MODEL_LEN)
    try:
        yield server, llm
    finally:
        llm.shutdown()
        server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=300)


def offline(llm: LLM, regex: str | None, **kw):
    so = StructuredOutputsParams(regex=regex) if regex else None
    return llm.chat(MESSAGES, SamplingParams(structured_outputs=so, **kw), use_tqdm=False,
                    chat_template=TEMPLATE, tools=TOOLS)[0].outputs[0]


def collect(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """A stream put back together: content, [(name, arguments)], the last finish_reason.
    Each call's first piece must carry its id, type and name, later ones arguments only."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index][1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for c in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_the_models_call(served, stream):
    server, llm = served
    want = offline(llm, CALL, seed=4, max_tokens=120)
    found = re.fullmatch(CALL, want.text)
    assert found and want.finish_reason == "stop", want.text
    city, days = found.groups()
    expected = ("I will check.\n", [("get_weather", f'{{"city": "{city}", "days": {days}}}')])
    got = client(server).chat.completions.create(
        model="smol", messages=MESSAGES, tools=TOOLS, seed=4, max_tokens=120, stream=stream,
        extra_body={"structured_outputs": {"regex": CALL}})  # tool_choice: "auto", the default
    if stream:
        content, calls, finish = collect(got)
    else:
        message, finish = got.choices[0].message, got.choices[0].finish_reason
        content = message.content
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-")
                   for c in message.tool_calls)
    assert (content, calls) == expected and finish == "tool_calls"
    assert json.loads(calls[0][1]) == {"city": city, "days": int(days)}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_is_content(served, stream):
    server, llm = served
    want = offline(llm, None, seed=2, max_tokens=24)
    assert "<tool_call>" not in want.text  # else this seed tests the case above
    got = client(server).chat.completions.create(
        model="smol", messages=MESSAGES, tools=TOOLS, tool_choice="auto", seed=2,
        max_tokens=24, stream=stream)
    if stream:
        content, calls, finish = collect(got)
    else:
        content, finish = got.choices[0].message.content, got.choices[0].finish_reason
        calls = got.choices[0].message.tool_calls or []
    assert (content, calls, finish) == (want.text, [], want.finish_reason)


def test_tool_choice_none_describes_the_tools_but_parses_no_call(served, smollm2_dir):
    from transformers import AutoTokenizer

    server, llm = served
    want = offline(llm, CALL, seed=4, max_tokens=120)
    got = client(server).chat.completions.create(
        model="smol", messages=MESSAGES, tools=TOOLS, tool_choice="none", seed=4,
        max_tokens=120, extra_body={"structured_outputs": {"regex": CALL}})
    choice = got.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == want.text  # the call's text, left as text
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with_tools, without = (tok.encode(tok.apply_chat_template(
        MESSAGES, tools=tools, chat_template=TEMPLATE, add_generation_prompt=True,
        tokenize=False), add_special_tokens=False) for tools in (TOOLS, None))
    assert got.usage.prompt_tokens == len(with_tools) > len(without)


def test_the_call_goes_back_for_the_next_turn(served):
    """An agent loop: the returned call and the tool's result, sent back, are answered."""
    server, _ = served
    c = client(server)
    first = c.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, seed=4,
                                      max_tokens=120,
                                      extra_body={"structured_outputs": {"regex": CALL}})
    call = first.choices[0].message.tool_calls[0]
    turn = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    again = c.chat.completions.create(model="smol", messages=turn, tools=TOOLS, seed=1,
                                      max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("flags,message", [
    (["--enable-auto-tool-choice", "--tool-call-parser", "qwen25"],
     "--tool-call-parser 'qwen25' is not a tool parser; choose from hermes, llama3_json"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "only with --enable-auto-tool-choice"),
])
def test_bad_tool_flags_stop_the_server_at_start(smollm2_dir, flags, message):
    done = subprocess.run([sys.executable, "-m", "minivllm.cli", "serve", str(smollm2_dir),
                           "--device", "cpu", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert "on http://" not in done.stdout  # it never listened
