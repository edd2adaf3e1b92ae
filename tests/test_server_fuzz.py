"""Fuzzing a running ``minivllm serve``: no body, however bad, gets a 5xx or a hang.

Hypothesis writes request bodies, valid and invalid: wrong types, extreme
integers (``2**70`` seeds) and floats (NaN and infinity, which Python's JSON
parser accepts, and the same as strings), huge strings, empty and nested
lists, unknown fields, junk bytes and wrong content types, and sends them to
every POST endpoint of a server on 127.0.0.1. Every answer must be a 2xx or a
4xx within the time bound, and a 2xx stream must carry no error event. The
oracle afterwards is the server itself before the run: a fixed greedy prompt
gets the same answer, nothing is running, and the KV pool is entirely free
(``vllm:kv_cache_usage_perc`` is 0).

Bounded for CI: each request has a timeout, and the number of examples
follows the hypothesis profile (``CI=true``: about a minute in all).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_utils import ServerProcess, server_backend

MAX_MODEL_LEN = 128
BODY_CAP = 1 << 16
TIMEOUT_S = 60.0  # per request: a hang fails the test instead of stalling CI
GREEDY = {"prompt": "The fixed greedy prompt", "temperature": 0, "max_tokens": 8,
          "ignore_eos": True}

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = ["model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options",
          "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt",
          "add_special_tokens", "tokens", "echo", "logit_bias", "best_of", "suffix", "user",
          "an_unknown_field"]

EXTREME_INTS = [0, 1, -1, 2, 3, 255, 256, 319, 320, MAX_MODEL_LEN, 2**31, 2**31 - 1, -2**31,
                2**53 + 1, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 2**70, -2**70, 10**30]
FLOATISH = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-9,
            "NaN", "nan", "Infinity", "-Infinity", "inf", "1e999"]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.integers(-5, 400),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(FLOATISH),
    st.text(max_size=20),
    st.sampled_from(["", " ", "\x00", "\ud800", "a" * 5000, "日本🚀" * 100, "x" * 70000]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"])},
    optional={"content": st.one_of(st.text(max_size=30), values,
                                   st.lists(st.fixed_dictionaries(
                                       {"type": st.sampled_from(["text", "image_url"]),
                                        "text": values}), max_size=2))}), max_size=3)

BASES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


@st.composite
def bodies(draw) -> tuple[str, bytes, str | None]:
    """(endpoint, body bytes, content type): a valid body with fields replaced,
    added or dropped, a JSON value of the wrong shape, or junk bytes."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "json", "bytes"]))
    content_type: str | None = "application/json"
    if kind == "fields":
        body = dict(BASES[endpoint])
        for name in draw(st.lists(st.sampled_from(list(body)), max_size=1)):
            del body[name]
        special = {"messages": messages, "prompt": st.one_of(
            values, st.lists(st.integers(-3, 400), max_size=40),
            st.lists(st.lists(st.integers(0, 319), max_size=4), max_size=4))}
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
            body[name] = draw(special.get(name, values))
        if draw(st.booleans()):  # keep most generations short: the run stays bounded
            body["max_tokens"] = draw(st.integers(1, 6))
        raw = json.dumps(body, allow_nan=True).encode()
    elif kind == "json":
        raw = json.dumps(draw(values), allow_nan=True).encode()
    else:
        raw = draw(st.one_of(st.binary(max_size=200),
                             st.sampled_from([b"", b"{", b'{"prompt": "x"', b"\xff\xfe{}",
                                              b"[" * 5000, b"{}" * 40000])))
        content_type = draw(st.sampled_from(["application/json", "text/plain", None,
                                             "application/x-www-form-urlencoded"]))
    if draw(st.integers(0, 9)) == 0:
        content_type = draw(st.sampled_from(["text/plain", None, "multipart/form-data"]))
    return endpoint, raw, content_type


@pytest.fixture(scope="module")
def server(tiny_model_dir, request):
    spec = server_backend(request.config.getoption("--backend"))
    srv = ServerProcess(str(tiny_model_dir("llama")), "--backend", spec,
                        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                        "--max-request-body-bytes", str(BODY_CAP), "--max-prompt-chars", "2048",
                        "--served-model-name", "tiny")
    try:
        yield srv
    finally:
        srv.stop()


def metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and "{" in line and 'le="' not in line:
            name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def greedy(base_url: str) -> str:
    r = httpx.post(f"{base_url}/v1/completions", json=GREEDY, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _completion(**fields) -> tuple[str, bytes, str]:
    body = {**BASES["/v1/completions"], **fields}
    return "/v1/completions", json.dumps(body, allow_nan=True).encode(), "application/json"


#: Bodies that once broke a server like this one, always tried first.
KNOWN = [
    _completion(seed=2**70), _completion(seed=-1), _completion(seed=2**64 - 1, n=3),
    _completion(temperature=float("nan")), _completion(top_p="NaN"),
    _completion(top_k=2**70), _completion(min_p=float("inf")), _completion(n=2**70),
    _completion(max_tokens=2**70), _completion(min_tokens=2**63), _completion(logprobs=2**70),
    _completion(stop_token_ids=[2**70]), _completion(stop_token_ids=[319, -1]),
    _completion(repetition_penalty=1e308), _completion(presence_penalty=float("-inf")),
    _completion(stop=[""]), _completion(stop=[]), _completion(prompt=[[]]),
    _completion(prompt=["\ud800"]), _completion(prompt=[2**70]),
    _completion(stream=True, seed=2**70), _completion(stream_options={"include_usage": 1}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": 5}]}]}', "application/json"),
    ("/detokenize", b'{"tokens": [18446744073709551616]}', "application/json"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "application/json"),
]


def send(client: httpx.Client, endpoint: str, raw: bytes, content_type: str | None):
    """POST one body; return (status, body text), reading a stream to its end."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    with client.stream("POST", endpoint, content=raw, headers=headers) as r:
        return r.status_code, r.read().decode("utf-8", "replace")


def test_no_body_gets_a_5xx_or_a_hang_and_the_server_is_unchanged(server) -> None:
    before = greedy(server.base_url)
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:

        @settings(max_examples=max(4 * settings.default.max_examples, 60),
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture])
        @given(bodies())
        def one(case) -> None:
            endpoint, raw, content_type = case
            status, text = send(client, endpoint, raw, content_type)
            assert 200 <= status < 500, (status, text[:500], raw[:300])
            if status == 200 and text.startswith("data:"):
                assert '{"error"' not in text, (text[-500:], raw[:300])
            # A body answered 4xx must not have broken the engine for everyone else.
            health = client.get("/health")
            assert health.status_code == 200, (health.text[:300], "after", raw[:300])

        for case in KNOWN:
            one = example(case)(one)
        one()

    assert greedy(server.base_url) == before
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server.base_url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0, m
