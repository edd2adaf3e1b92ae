"""The tool-call parsers of ``tool_choice="auto"`` (``minivllm/entrypoints/openai/tool_parsers/``).

The oracle is hand-written: each answer below is written in the format its
model family produces (Hermes 2 Pro / Qwen2.5's ``<tool_call>`` blocks, Llama
3.1's JSON calls, as their chat templates describe them), next to the parse a
reader expects from it: the content, and each call's name and ``arguments``
text. The streaming mode is fed the same answers cut one character at a time
and at random points (hypothesis); the pieces, put back together the way the
``openai`` client does, must give that same parse, and each call's first piece
must carry its index, id, type and name before any argument.

Run: ``pytest -q tests/test_tool_parsers.py`` (no model, no backend involved).
"""

from __future__ import annotations

import json
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    AutoToolCalls,
    get_tool_parser,
    import_tool_parser,
)

HERMES, LLAMA = TOOL_PARSERS["hermes"], TOOL_PARSERS["llama3_json"]

# (parser, answer, content, [(name, arguments text)]); no calls: the answer is all content.
CASES = [
    # Qwen2.5 writes the call alone, tags on lines of their own.
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
             '</tool_call>',
     None, [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    # Text before the call, two calls, a newline between them and after them.
    (HERMES, 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"zone": "CET", "exact": true}}\n</tool_call>\n',
     "Let me check both.\n",
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET", "exact": true}')]),
    # Arguments with nesting, braces and escaped quotes in strings, non-ASCII, no spaces.
    (HERMES, '<tool_call>{"name":"search","arguments":{"q":"say \\"}\\" {ok}","tags":["a",'
             '{"b":null}],"n":-1.5e3,"lang":"français"}}</tool_call>',
     None, [("search", '{"q":"say \\"}\\" {ok}","tags":["a",{"b":null}],"n":-1.5e3,'
                       '"lang":"français"}')]),
    # "arguments" before "name"; a function without parameters; no closing tag at the end.
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "first"}\n</tool_call>\n'
             '<tool_call>\n{"name": "now"}',
     None, [("first", '{"x": 1}'), ("now", "{}")]),
    # Text after the call is content too; a "<" that is no tag is content.
    (HERMES, 'a < b, so:\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.',
     "a < b, so:\n\nDone.", [("f", "{}")]),
    # Blank lines before and between calls are dropped; those before text are kept.
    (HERMES, '\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
             '"arguments": {"k": [1]}}</tool_call>\nDone.',
     "\nDone.", [("a", "{}"), ("b", '{"k": [1]}')]),
    # No call at all: the answer, untouched.
    (HERMES, "  The weather in Paris is sunny. <tool is not a tag>\n",
     "  The weather in Paris is sunny. <tool is not a tag>\n", []),
    # Malformed: Python's quotes, a call as a function, a string for arguments.
    (HERMES, "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
     "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>", []),
    (HERMES, 'Sure. <tool_call>get_weather(city="Paris")</tool_call>',
     'Sure. <tool_call>get_weather(city="Paris")</tool_call>', []),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', []),
    (HERMES, '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    # A well-formed call, then a malformed one: the call, and the rest as content.
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{oops}',
     "\n<tool_call>{oops}", [("f", '{"a": 1}')]),
    # Llama 3.1 with <|python_tag|> (skip_special_tokens=false), and without it.
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}',
     None, [("get_weather", '{"city": "Lima", "days": 2}')]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Lima"}}',
     None, [("get_weather", '{"city": "Lima"}')]),
    # Several calls separated by ";", "arguments" as the key of one of them.
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
            '"arguments": {"zone": "UTC"}};{"name": "ping", "parameters": {}}',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}'),
            ("ping", "{}")]),
    # Leading whitespace, then text after the calls.
    (LLAMA, '\n {"name": "f", "parameters": {"s": "a;b}"}} \nThat is the call.',
     " \nThat is the call.", [("f", '{"s": "a;b}"}')]),
    # An answer that does not begin with a call is all content, JSON inside or not.
    (LLAMA, 'Here: {"name": "f", "parameters": {}}', 'Here: {"name": "f", "parameters": {}}', []),
    (LLAMA, "Paris is the capital of France.", "Paris is the capital of France.", []),
    # JSON that is no call (no name), and Llama's python tool (code, no JSON).
    (LLAMA, '{"city": "Paris"}', '{"city": "Paris"}', []),
    (LLAMA, '<|python_tag|>print(2 + 2)', '<|python_tag|>print(2 + 2)', []),
]
IDS = [f"{cls.name}-{i}" for i, (cls, *_) in enumerate(CASES)]


def reassemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Stream deltas put back together as the openai client does; checks each call's
    first piece carries index, id, type and name, and later pieces only arguments."""
    content, calls, ids = "", {}, {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"} and delta, delta
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            i = piece["index"]
            if i not in calls:
                assert i == len(calls), "calls must come in index order"
                assert piece["type"] == "function" and piece["id"].startswith("chatcmpl-tool-")
                assert piece["function"]["name"], "the name comes first"
                calls[i], ids[i] = [piece["function"]["name"], ""], piece["id"]
            else:
                assert set(piece) == {"index", "function"}, piece
                assert set(piece["function"]) == {"arguments"}, piece
            calls[i][1] += piece["function"].get("arguments", "")
    assert len(set(ids.values())) == len(ids)
    return content or None, [tuple(c) for c in calls.values()]


def stream(cls, pieces: list[str]) -> tuple[list[dict], bool]:
    parser = cls()
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces]
    deltas.append(parser.finish_streaming())
    return [d for d in deltas if d is not None], parser.tools_called


def expected(answer: str, content: str | None, calls: list) -> tuple[str | None, list]:
    return (answer if not calls else content), calls


@pytest.mark.parametrize("cls,answer,content,calls", CASES, ids=IDS)
def test_whole_answer_parses_as_written_by_hand(cls, answer, content, calls):
    info = cls().extract_tool_calls(answer)
    assert info.tools_called == bool(calls)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in info.tool_calls]
    assert (info.content, got) == expected(answer, content, calls)
    for c in info.tool_calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


@pytest.mark.parametrize("cls,answer,content,calls", CASES, ids=IDS)
def test_streamed_one_character_at_a_time_adds_up_to_the_same(cls, answer, content, calls):
    deltas, called = stream(cls, list(answer))
    assert called == bool(calls)
    assert reassemble(deltas) == expected(answer, content, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_streamed_at_random_cuts_adds_up_to_the_same(case, cuts):
    cls, answer, content, calls = case
    bounds = sorted({0, len(answer), *(c % (len(answer) + 1) for c in cuts)})
    pieces = [answer[a:b] for a, b in zip(bounds, bounds[1:])]
    deltas, called = stream(cls, pieces)
    assert called == bool(calls)
    assert reassemble(deltas) == expected(answer, content, calls)


def test_stream_announces_a_call_before_its_arguments_end():
    """The name goes out as soon as it is read; the arguments follow in pieces."""
    parser = HERMES()
    assert parser.extract_tool_calls_streaming("Ok.\n<tool_") == {"content": "Ok.\n"}
    assert parser.extract_tool_calls_streaming('call>\n{"name": "get_wea') is None
    first = parser.extract_tool_calls_streaming('ther", "arguments": {"ci')
    (piece,) = first["tool_calls"]
    assert piece["index"] == 0 and piece["function"] == {"name": "get_weather",
                                                         "arguments": '{"ci'}
    more = parser.extract_tool_calls_streaming('ty": "Par')
    assert more == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Par'}}]}


@pytest.mark.parametrize("cls,answer,name", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "get_weather"),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "f"),  # "}" short
    (LLAMA, '{"name": "g", "parameters": {"a": 1}, }', "g"),
    (LLAMA, '{"name": "h", "parameters": {}, "arguments": {}}', "h"),  # both keys
    (HERMES, '<tool_call>{"name": "d", "arguments": {"a": 1}, "arguments": {}}', "d"),
])
def test_a_call_broken_after_it_was_announced(cls, answer, name):
    """Cut by max_tokens or broken late: the whole answer is content when parsed whole;
    the stream had announced it (it cannot take it back) and calls nothing."""
    info = cls().extract_tool_calls(answer)
    assert not info.tools_called and info.content == answer and info.tool_calls == []
    deltas, called = stream(cls, list(answer))
    assert not called
    assert [n for n, _ in reassemble(deltas)[1]] == [name]


def test_auto_reply_and_stream_shapes():
    auto = AutoToolCalls(HERMES)
    answer = CASES[1][1]
    message, finish = auto.reply(answer, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check both.\n"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert auto.reply("Sunny.", "length") == ({"role": "assistant", "content": "Sunny."},
                                              "length")
    s = auto.stream()
    deltas = [s.delta(answer[:40], None), s.delta(answer[40:], "stop")]
    assert deltas[0][1] is None and deltas[1][1] == "tool_calls"
    assert reassemble([d for d, _ in deltas if d]) == ("Let me check both.\n", CASES[1][3])


def test_registry_names_and_plugins(tmp_path):
    assert get_tool_parser("hermes") is HERMES and get_tool_parser("llama3_json") is LLAMA
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("qwen25")
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(textwrap.dedent("""
        from minivllm.entrypoints.openai.tool_parsers.hermes import Hermes2ProToolParser

        class Functionary(Hermes2ProToolParser):
            name = "my_hermes"
            arguments_keys = ("args",)
    """))
    cls = get_tool_parser("my_hermes", str(plugin))
    assert set(import_tool_parser(str(plugin))) == {"my_hermes"}
    info = cls().extract_tool_calls('<tool_call>{"name": "f", "args": {"a": 1}}</tool_call>')
    assert info.tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    with pytest.raises(ValueError, match="choose from hermes, llama3_json, my_hermes"):
        get_tool_parser("nope", str(plugin))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no ToolParser"):
        import_tool_parser(str(tmp_path / "empty.py"))
    with pytest.raises(ValueError, match="no such file"):
        import_tool_parser(str(tmp_path / "missing.py"))
