"""Chat templates as vLLM renders them: ``chat_template``, ``chat_template_kwargs``,
``continue_final_message``, ``add_generation_prompt``, ``tools``, and multi-turn tool
messages, offline (``LLM.chat``) and over HTTP (``--chat-template``, ``/tokenize``,
``/v1/chat/completions``). docs/serving.md, "Chat templates".

Oracle: transformers' own ``tokenizer.apply_chat_template`` called with the same
template and options, the tool calls' arguments written as the objects a template
indexes (the request sends them as JSON strings, as OpenAI's clients do).

Run: ``pytest -q tests/test_chat_template.py --backend=ref`` and ``--backend=fast``.
"""

from __future__ import annotations

import inspect

import httpx
import pytest
from server_utils import ServerProcess, offline_backend, server_backend

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.chat_utils import ChatOptions, load_chat_template, render_chat

TEMPLATE = (
    "{% if tools %}[{{ tools | length }} tools]{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<tool {{ m['tool_call_id'] }}>{{ m['content'] }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}"
    "[call {{ c['function']['name'] }}({{ c['function']['arguments']['city'] }})]"
    "{% endfor %}{% endif %}</s>"
    "{% endfor %}"
    "{% if shout %}!!{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def tool_turns(arguments):
    """A user asks, the assistant calls a tool, the tool answers (an agent loop's turn)."""
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]


SENT = tool_turns('{"city": "Paris"}')  # as a client sends it
SEEN = tool_turns({"city": "Paris"})    # as a template reads it
CASES = {  # name: (messages sent, messages the oracle renders, LLM.chat keyword arguments)
    "plain": ([{"role": "user", "content": "hi"}], None, {}),
    "kwargs": ([{"role": "user", "content": "hi"}], None,
               {"chat_template_kwargs": {"shout": True}}),
    "continue": ([{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "The answer is"}], None,
                 {"continue_final_message": True, "add_generation_prompt": False}),
    "tools": ([{"role": "user", "content": "hi"}], None, {"tools": [TOOL]}),
    "tool_turns": (SENT, SEEN, {"tools": [TOOL]}),
}


def oracle_ids(tok, messages, template=TEMPLATE, **kw) -> list[int]:
    kw.setdefault("add_generation_prompt", True)
    extra = kw.pop("chat_template_kwargs", None) or {}
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   **kw, **extra)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir, request):
    spec = offline_backend(server_backend(request.config.getoption("--backend")))
    llm = LLM(str(tiny_model_dir("llama")), backend=spec, device="cpu", dtype="float32",
              max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
def test_llm_chat_renders_as_transformers_does(tiny_llm, case):
    sent, seen, kw = CASES[case]
    out = tiny_llm.chat(sent, SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=TEMPLATE, **kw)[0]
    want = oracle_ids(tiny_llm.get_tokenizer(), seen or sent, **kw)
    assert out.prompt_token_ids == want
    text = tiny_llm.get_tokenizer().decode(want)
    if case == "continue":  # left open: no end-of-turn after the prefilled answer
        assert text.endswith("The answer is")
    if case == "tool_turns":
        assert "[call get_weather(Paris)]" in text and "<tool call_1>21C" in text


def test_the_tokenizers_own_template_is_the_default(tiny_llm):
    messages = [{"role": "user", "content": "hi"}]
    out = tiny_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    tok = tiny_llm.get_tokenizer()
    assert out.prompt_token_ids == oracle_ids(tok, messages, template=tok.chat_template)


def test_llm_chat_takes_vllms_parameters_in_vllms_order():
    names = list(inspect.signature(LLM.chat).parameters)
    assert names[:11] == ["self", "messages", "sampling_params", "use_tqdm", "lora_request",
                          "chat_template", "chat_template_content_format",
                          "add_generation_prompt", "continue_final_message", "tools",
                          "chat_template_kwargs"]


def test_options_no_template_can_honour_are_refused_naming_the_field(tiny_llm, tmp_path):
    tok = tiny_llm.get_tokenizer()
    hi = [{"role": "user", "content": "hi"}]
    for options, field in (
            (ChatOptions(TEMPLATE, add_generation_prompt=True, continue_final_message=True),
             "continue_final_message"),
            (ChatOptions(TEMPLATE, chat_template_kwargs={"tokenize": True}),
             "chat_template_kwargs"),
            (ChatOptions("{% for %}"), "chat_template")):
        with pytest.raises(ValueError, match=field):
            render_chat(tok, hi, options)
    with pytest.raises(ValueError, match="arguments must be a JSON object"):
        render_chat(tok, tool_turns("{not json"), ChatOptions(TEMPLATE))
    with pytest.raises(ValueError, match="chat_template_content_format"):
        tiny_llm.chat(hi, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="neither"):
        load_chat_template(str(tmp_path / "no_such_template.jinja"))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE


def test_chat_templates_over_http(tiny_model_dir, tmp_path, request):
    """``--chat-template FILE`` for every request; a request's own template refused
    without ``--trust-request-chat-template``; the options and tool turns rendered as
    transformers renders them (``/tokenize``), and served (``/v1/chat/completions``)."""
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(path)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    spec = server_backend(request.config.getoption("--backend"))
    server = ServerProcess(str(path), "--backend", spec, "--max-model-len", "256",
                           "--chat-template", str(tmp_path / "t.jinja"))
    try:
        url = server.base_url
        for sent, seen, kw in CASES.values():
            body = {"messages": sent, **kw}
            r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == oracle_ids(tok, seen or sent, **kw)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": SENT, "max_tokens": 2})  # an agent loop's turn, answered
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(oracle_ids(tok, SEEN))
        for extra, field in (({"chat_template": "{{ 'x' }}"}, "chat_template"),
                             ({"continue_final_message": True}, "continue_final_message"),
                             ({"chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs")):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == field
    finally:
        server.stop()
    server = ServerProcess(str(path), "--backend", spec, "--max-model-len", "256",
                           "--trust-request-chat-template")
    try:
        hi = [{"role": "user", "content": "hi"}]
        r = httpx.post(f"{server.base_url}/tokenize", timeout=30,
                       json={"messages": hi, "chat_template": TEMPLATE})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == oracle_ids(tok, hi)
    finally:
        server.stop()
