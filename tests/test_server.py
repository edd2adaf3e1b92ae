"""``minivllm serve`` as a real subprocess, spoken to with the official ``openai`` client.

The oracle is the offline engine: at temperature 0 (and with a seed) the
server must return exactly what ``LLM.generate`` returns for the same
prompt, streamed or not. Every server runs on 127.0.0.1 on a free port, is
started once per module and stopped at the end, and the fixture checks that
no process (tensor-parallel workers included) and no port is left behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from server_utils import (
    ServerProcess,
    alive,
    children,
    cmdline,
    offline_backend,
    server_backend,
)

from minivllm import LLM, BeamSearchParams, SamplingParams

KEY = "test-key-123"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello there, ", "The quick brown fox", "a", "Paged attention splits the KV cache"]


@pytest.fixture(scope="module")
def spec(request) -> str:
    return server_backend(request.config.getoption("--backend"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, spec):
    """A served tiny model (with an API key) and the offline LLM as its oracle."""
    path = str(tiny_model_dir("llama"))
    server = ServerProcess(path, "--backend", spec, "--max-model-len", str(MAX_MODEL_LEN),
                           "--api-key", KEY, "--served-model-name", "tiny",
                           "--max-prompt-chars", "4096", "--max-detokenize-tokens", "256")
    llm = LLM(path, backend=offline_backend(spec), device="cpu", max_model_len=MAX_MODEL_LEN)
    try:
        yield server, llm
    finally:
        llm.shutdown()
        server.stop()


def client(server, key: str = KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=60, **kw)


def offline(llm: LLM, prompt: str, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def metrics(server, key: str | None = KEY) -> dict[str, float]:
    """``/metrics`` parsed into ``{name: value}`` (label sets dropped; one model)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


# --------------------------------------------------------------------------
# Tiny model: exactness, parameters, errors, auth, concurrency
# --------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_streamed_equals_full_equals_offline_with_exact_usage(tiny, prompt) -> None:
    server, llm = tiny
    c = client(server)
    want = offline(llm, prompt, temperature=0, max_tokens=13, ignore_eos=True)
    full = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=13,
                                extra_body={"ignore_eos": True})
    assert full.choices[0].text == want.outputs[0].text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(want.prompt_token_ids)
    assert full.usage.completion_tokens == 13
    assert full.usage.total_tokens == len(want.prompt_token_ids) + 13
    chunks = list(c.completions.create(model="tiny", prompt=prompt, temperature=0,
                                       max_tokens=13, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == want.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 13  # the usage chunk comes last
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(ch.usage is None for ch in text_chunks)
    # vLLM's continuous_usage_stats: every chunk says the tokens so far, the last 13.
    chunks = list(c.completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=13, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    so_far = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert so_far == sorted(so_far) and so_far[-1] == 13 and so_far[0] >= 1
    assert all(ch.usage.prompt_tokens == len(want.prompt_token_ids) for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.outputs[0].text


def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(tiny) -> None:
    server, llm = tiny
    ids = llm.get_tokenizer().encode(PROMPTS[3])
    want = llm.generate({"prompt_token_ids": ids[-5:]},
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0]
    got = client(server).completions.create(
        model="tiny", prompt=PROMPTS[3], temperature=0, max_tokens=6,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.prompt_tokens == 5


def test_chat_uses_the_chat_template(tiny) -> None:
    server, llm = tiny
    messages = [{"role": "user", "content": "hi, who are you?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                    use_tqdm=False)[0]
    got = client(server).chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=9,
        extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_n2_with_seed_is_reproducible_distinct_and_matches_seed_plus_i(tiny) -> None:
    server, llm = tiny
    c = client(server)
    kw = dict(model="tiny", prompt=PROMPTS[0], n=2, seed=7, temperature=1.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert texts[0] != texts[1]
    for i in range(2):
        want = offline(llm, PROMPTS[0], temperature=1.0, seed=7 + i, max_tokens=12,
                       ignore_eos=True)
        assert texts[i] == want.outputs[0].text
    assert a.usage.completion_tokens == 24


def test_n_streams_every_choice_with_its_index_as_offline(tiny) -> None:
    """Two prompts x n=3: one engine request per prompt, choice p * 3 + i being
    completion i of prompt p, streamed interleaved, each ending once."""
    server, llm = tiny
    kw = dict(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    want = [c.text for p in PROMPTS[:2]
            for c in llm.generate(p, SamplingParams(n=3, **kw), use_tqdm=False)[0].outputs]
    chunks = list(client(server).completions.create(
        model="tiny", prompt=PROMPTS[:2], n=3, seed=3, temperature=1.0, max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, ends = [""] * 6, [0] * 6
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            ends[choice.index] += choice.finish_reason is not None
    assert texts == want
    assert ends == [1] * 6
    assert chunks[-1].usage.completion_tokens == 60
    assert chunks[-1].usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(p))
                                                 for p in PROMPTS[:2])


@pytest.mark.parametrize("stream", [False, True])
def test_use_beam_search_returns_the_offline_beams(tiny, stream) -> None:
    server, llm = tiny
    prompt = llm.get_tokenizer().encode(PROMPTS[3])
    want = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=True))[0]
    got = client(server).completions.create(
        model="tiny", prompt=prompt, n=3, max_tokens=7, stream=stream,
        extra_body={"use_beam_search": True, "ignore_eos": True})
    texts = [""] * 3
    for ch in (got if stream else [got]):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [s.text for s in want.sequences]


def test_stop_strings_cut_the_text_streamed_or_not(tiny) -> None:
    server, llm = tiny
    c = client(server)
    text = offline(llm, PROMPTS[1], temperature=0, max_tokens=30, ignore_eos=True).outputs[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2)
                if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    want = text[:text.index(stop)]
    kw = dict(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=30, stop=[stop],
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw)
    assert full.choices[0].text == want and full.choices[0].finish_reason == "stop"
    streamed = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in streamed) == want
    assert streamed[-1].finish_reason == "stop"


def test_logprobs_match_the_offline_engine_streamed_or_not(tiny) -> None:
    server, llm = tiny
    c = client(server)
    want = offline(llm, PROMPTS[2], temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    want_lp = [d[t].logprob for d, t in zip(want.outputs[0].logprobs,
                                            want.outputs[0].token_ids)]
    kw = dict(model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=6, logprobs=2,
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].logprobs
    assert full.token_logprobs == pytest.approx(want_lp, abs=1e-4)
    # Keyed by token text (OpenAI's format): two byte tokens may both decode to U+FFFD.
    assert all(1 <= len(top) <= 2 for top in full.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert [max(top.values()) for top in full.top_logprobs] == pytest.approx(want_lp, abs=1e-4)
    streamed = [lp for ch in c.completions.create(stream=True, **kw)
                for lp in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs
                           else [])]
    assert streamed == pytest.approx(want_lp, abs=1e-4)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


BAD = [  # (request fields, status, a word the message must contain)
    (dict(top_p=2.0), 400, "top_p"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(n=0), 400, "n must be"),
    (dict(n=129), 400, "--max-n"),
    (dict(prompt=["a", "b"], n=65), 400, "--max-n"),
    (dict(n=2, logprobs=1, extra_body={"use_beam_search": True}), 400, "logprobs"),
    (dict(n=2, stop=["a"], extra_body={"use_beam_search": True}), 400, "stop"),
    (dict(extra_body={"length_penalty": 2.0}), 400, "use_beam_search"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=MAX_MODEL_LEN), 400, "max_model_len"),
    (dict(prompt="x" * (MAX_MODEL_LEN + 5)), 400, "max_model_len"),
    (dict(prompt=[999_999]), 400, "prompt_token_ids must be in"),
    (dict(prompt=""), 400, "empty"),
    (dict(logprobs=21), 400, "logprobs"),
    (dict(extra_body={"truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens"),
    (dict(presence_penalty=3), 400, "presence_penalty"),
    (dict(extra_body={"min_tokens": 9}, max_tokens=4), 400, "min_tokens"),
    (dict(extra_body={"top_k": -3}), 400, "top_k"),
    (dict(extra_body={"prompt_logprobs": -2}), 400, "prompt_logprobs"),
    (dict(logit_bias={"1": 200.0}), 400, "logit_bias"),
    (dict(logit_bias={"one": 1.0}), 400, "logit_bias"),
    (dict(logit_bias={"99999": 1.0}), 400, "logit_bias"),
    (dict(extra_body={"allowed_token_ids": []}), 400, "allowed_token_ids"),
    (dict(extra_body={"allowed_token_ids": [1, 99999]}), 400, "allowed_token_ids"),
    (dict(extra_body={"bad_words": [" "]}), 400, "bad_words"),
    (dict(stop=[f"s{i}" for i in range(17)]), 400, "--max-stop-strings"),
    (dict(stop=["x" * 257]), 400, "--max-stop-string-chars"),
    (dict(extra_body={"stop_token_ids": list(range(17))}), 400, "--max-stop-strings"),
    (dict(prompt="y" * 5000), 400, "--max-prompt-chars"),
    (dict(prompt=list(range(MAX_MODEL_LEN + 1))), 400, "257 tokens"),
    (dict(model="no-such-model"), 404, "no-such-model"),
]


def test_logit_bias_allowed_token_ids_and_bad_words_match_the_offline_engine(tiny) -> None:
    """OpenAI's logit_bias (string ids) and vLLM's allowed_token_ids / bad_words reach the
    engine: the server's text is the offline engine's with the same controls, which
    differs from the unshaped text (so a field dropped on the way would show)."""
    server, llm = tiny
    c, tok = client(server), llm.get_tokenizer()
    prompt, n = "Hello there, ", 6
    base = offline(llm, prompt, temperature=0, max_tokens=n, ignore_eos=True).outputs[0]
    x = next(t for t in range(256) if tok.decode([t]).isalpha() and tok.decode([t + 1]).isalpha()
             and t not in base.token_ids)
    word = next(w for w in (tok.decode([t]) for t in base.token_ids) if w.strip().isalnum())
    cases = [(dict(logit_bias={str(x): 100}), dict(logit_bias={x: 100.0})),
             (dict(extra_body={"allowed_token_ids": [x, x + 1]}),
              dict(allowed_token_ids=[x, x + 1])),
             (dict(extra_body={"bad_words": [word]}), dict(bad_words=[word]))]
    for http, engine in cases:
        want = offline(llm, prompt, temperature=0, max_tokens=n, ignore_eos=True, **engine)
        assert want.outputs[0].text != base.text, engine
        http = {**http, "extra_body": {"ignore_eos": True, **http.get("extra_body", {})}}
        got = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n,
                                   **http)
        assert got.choices[0].text == want.outputs[0].text, engine
    assert set(want.outputs[0].token_ids) != set(base.token_ids)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                     temperature=0, max_tokens=4, logit_bias={str(x): 100},
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tok.decode([x] * 4)


def test_every_bad_input_gets_its_4xx_and_the_server_still_answers(tiny) -> None:
    server, llm = tiny
    c = client(server)
    for fields, status, word in BAD:
        kw = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kw)
            pytest.fail(f"no error for {fields}")
        assert e.value.status_code == status, (fields, e.value)
        assert word in e.value.message, (fields, e.value.message)
    for messages, word in (([], "messages"), ([{"role": "robot", "content": "x"}], "role"),
                           ([{"role": "user", "content": "z" * 5000}], "--max-prompt-chars")):
        with pytest.raises(openai.BadRequestError, match=word):
            c.chat.completions.create(model="tiny", messages=messages)
    want = offline(llm, "hi", temperature=0, max_tokens=5, ignore_eos=True).outputs[0].text
    ok = c.completions.create(model="tiny", prompt="hi", temperature=0, max_tokens=5,
                              extra_body={"ignore_eos": True})
    assert ok.choices[0].text == want
    assert metrics(server)["vllm:num_requests_running"] == 0


def test_unknown_fields_are_accepted_and_named_in_a_warning(tiny) -> None:
    server, llm = tiny
    want = offline(llm, "hi", temperature=0, max_tokens=3, ignore_eos=True).outputs[0].text
    got = client(server).completions.create(
        model="tiny", prompt="hi", temperature=0, max_tokens=3,
        extra_body={"ignore_eos": True, "topk_misspelt": 3, "langchain_extra": {"a": 1}})
    assert got.choices[0].text == want
    deadline = time.monotonic() + 10
    while not any("topk_misspelt" in line for line in server.log) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    warning = next(line for line in server.log if "topk_misspelt" in line)
    assert "langchain_extra" in warning and "ignoring" in warning


def test_a_body_over_the_cap_is_413(tiny) -> None:
    server, _ = tiny
    h = {"Authorization": f"Bearer {KEY}"}
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(f"{server.base_url}/v1/completions", content=big, headers=h, timeout=30)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the cap counts the bytes as they come
        for _ in range(40):
            yield b"a" * 65536

    r = httpx.post(f"{server.base_url}/tokenize", content=chunked(), headers=h, timeout=30)
    assert r.status_code == 413
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "b" * 5000}, headers=h,
                   timeout=30)
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [1] * 300}, headers=h,
                   timeout=30)
    assert r.status_code == 400 and "300 tokens" in r.json()["error"]["message"]


def test_a_client_hang_up_aborts_every_choice_and_frees_the_kv_pool(tiny) -> None:
    # n=2: the merged stream of two engine requests; both must be aborted.
    server, _ = tiny
    before = metrics(server)["vllm:generation_tokens_total"]
    body = {"model": "tiny", "prompt": "hang up", "n": 2, "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h, \
            h.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            while not next(lines).startswith("data:"):
                pass
        assert metrics(server)["vllm:num_requests_running"] == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:generation_tokens_total"] - before < 400  # aborted, not run out


def test_api_key_guards_v1_but_not_health_metrics_or_docs(tiny) -> None:
    server, _ = tiny
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError, match="API key"):
            client(server, key=key).models.list()
    for path in ("/health", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 200, path
    for path in ("/tokenize", "/detokenize", "/v1/completions"):
        assert httpx.post(f"{server.base_url}{path}", json={}, timeout=10).status_code == 401
    assert [m.id for m in client(server).models.list().data] == ["tiny"]


def test_api_key_from_the_environment_and_all_paths_guarded(tiny_model_dir, spec) -> None:
    secret = "env-secret-456"
    server = ServerProcess(str(tiny_model_dir("llama")), "--backend", spec,
                           "--max-model-len", "128", "--api-key-all-paths",
                           env={"MINIVLLM_API_KEY": secret})
    try:
        assert secret not in cmdline(server.proc.pid)  # not visible in `ps`
        for path in ("/health", "/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 401, path
            ok = httpx.get(f"{server.base_url}{path}", timeout=10,
                           headers={"Authorization": f"Bearer {secret}"})
            assert ok.status_code == 200, path
    finally:
        server.stop()


def test_tokenize_and_detokenize_round_trip(tiny) -> None:
    server, llm = tiny
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "héllo"}, headers=h).json()
    assert r["tokens"] == llm.get_tokenizer().encode("héllo") and r["count"] == len(r["tokens"])
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]},
                      headers=h).json()
    assert back["prompt"] == llm.get_tokenizer().decode(r["tokens"])
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [-1]}, headers=h)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    # No messages at all (the fuzz test found a 500): a 400 naming the field.
    bad = httpx.post(f"{server.base_url}/tokenize", json={"messages": []}, headers=h)
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_64_concurrent_streaming_clients_all_complete_correctly(tiny) -> None:
    server, llm = tiny
    prompts = [f"{PROMPTS[i % 4]} #{i}" for i in range(64)]
    lengths = [4 + i % 9 for i in range(64)]
    want = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                  for n in lengths], use_tqdm=False)

    async def one(c: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, int]:
        text, usage = "", None
        stream = await c.completions.create(model="tiny", prompt=prompt, temperature=0,
                                            max_tokens=n, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage.completion_tokens
        return text, usage

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY,
                                      max_retries=0, timeout=120) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 240)

    got = asyncio.run(all_of_them())
    assert [t for t, _ in got] == [w.outputs[0].text for w in want]
    assert [u for _, u in got] == lengths
    m = metrics(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


# --------------------------------------------------------------------------
# A queue that is full, and a tensor-parallel worker that dies
# --------------------------------------------------------------------------


def test_full_queue_is_503_and_a_killed_tp_worker_ends_the_server(tiny_model_dir):
    # tp=2 with the fast linear layers: a real worker process we can kill.
    server = ServerProcess(str(tiny_model_dir("llama")), "--backend", "auto",
                           "--tensor-parallel-size", "2", "--max-model-len", "512",
                           "--max-num-seqs", "2", "--max-waiting-requests", "1")
    try:
        workers = server.workers()
        assert len(workers) == 1, workers

        model = _model(server)

        async def scenario():
            async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x",
                                          max_retries=0, timeout=60) as c:
                kw = dict(model=model, prompt="abc", max_tokens=480, stream=True,
                          extra_body={"ignore_eos": True})
                streams = [await c.completions.create(**kw) for _ in range(3)]
                # max-num-seqs 2: two run (their first tokens arrive), the third waits.
                firsts = [await s.__anext__() for s in streams[:2]]
                assert all(f.choices for f in firsts)
                with pytest.raises(openai.APIStatusError) as e:
                    await c.completions.create(**kw)
                assert e.value.status_code == 503 and "max-waiting-requests" in e.value.message
                os.kill(workers[0], signal.SIGKILL)
                start = time.monotonic()
                for s in streams:
                    with pytest.raises(openai.APIError, match="engine failed"):
                        async for _ in s:
                            pass
                return time.monotonic() - start

        kids = children(server.proc.pid)  # the spawned rank and its helpers
        elapsed = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert elapsed < 60
        # Until it exits (DEAD_ENGINE_GRACE_S), health checks see the dead engine.
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503 and "engine failed" in health.text
        # vLLM's behaviour: a server whose engine died exits, non-zero, on its own.
        assert server.proc.wait(60) == 1, server.output()
        assert "the engine died" in server.output()
        deadline = time.monotonic() + 15
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)]  # no rank process outlives it
    finally:
        server.stop()
    assert not any(alive(w) for w in workers)


def _model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


# --------------------------------------------------------------------------
# SmolLM2: the real model
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_dir, spec):
    # float32 pinned: "auto" is bfloat16 on a CPU with avx512_bf16, where a prefix-cache hit
    # (a different kernel path) can round a greedy answer onto another token.
    server = ServerProcess(str(smollm2_dir), "--backend", spec, "--max-model-len", "1024",
                           "--served-model-name", "smollm2", "--dtype", "float32")
    llm = LLM(str(smollm2_dir), backend=offline_backend(spec), device="cpu",
              max_model_len=1024, dtype="float32")
    try:
        yield server, llm
    finally:
        llm.shutdown()
        server.stop()


@pytest.mark.slow
def test_smollm2_chat_streamed_equals_full_equals_offline(smol) -> None:
    server, llm = smol
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24),
                    use_tqdm=False)[0].outputs[0]
    c = client(server, key="none")
    full = c.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                     max_tokens=24)
    assert full.choices[0].message.content == want.text
    assert "Paris" in want.text
    assert full.usage.completion_tokens == len(want.token_ids)

    async def streamed() -> tuple[str, str | None]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                                      max_retries=0, timeout=120) as ac:
            text, reason = "", None
            async for ch in await ac.chat.completions.create(
                    model="smollm2", messages=messages, temperature=0, max_tokens=24,
                    stream=True):
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
            return text, reason

    text, reason = asyncio.run(asyncio.wait_for(streamed(), 180))
    assert text == want.text and reason == want.finish_reason


@pytest.mark.slow
def test_smollm2_stop_string(smol) -> None:
    server, llm = smol
    prompt = "List three colours:\n1."
    text = offline(llm, prompt, temperature=0, max_tokens=20).outputs[0].text
    assert "\n" in text
    got = client(server, key="none").completions.create(
        model="smollm2", prompt=prompt, temperature=0, max_tokens=20, stop=["\n"])
    assert got.choices[0].text == text[:text.index("\n")]
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_disconnect_mid_stream_frees_the_kv_pool(smol) -> None:
    server, _ = smol
    body = {"model": "smollm2", "prompt": "Once upon a time " * 20, "max_tokens": 500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{server.base_url}/v1/completions",
                                                 json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens arrive: the request holds KV blocks
            while not next(lines).startswith("data:"):
                pass
        busy = metrics(server, key=None)
        assert busy["vllm:num_requests_running"] == 1
        assert busy["vllm:kv_cache_usage_perc"] > 0
    # The connection is closed: the server must abort the request and free its blocks.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server, key=None)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0, m
    assert m["vllm:kv_cache_usage_perc"] == 0, m
    assert m["vllm:generation_tokens_total"] < 500  # aborted, not run to the end

    # A non-streamed request whose client gives up (times out) is aborted too.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=3) as h:
        h.post(f"{server.base_url}/v1/completions", json=body)
    deadline = time.monotonic() + 30
    while (metrics(server, key=None)["vllm:num_requests_running"] or
           metrics(server, key=None)["vllm:kv_cache_usage_perc"]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    m2 = metrics(server, key=None)
    assert m2["vllm:num_requests_running"] == 0 and m2["vllm:kv_cache_usage_perc"] == 0
    assert m2["vllm:generation_tokens_total"] - m["vllm:generation_tokens_total"] < 500


def test_serve_help_documents_the_server_flags(capsys) -> None:
    from minivllm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-waiting-requests", "127.0.0.1",
                 "MINIVLLM_API_KEY", "--api-key-all-paths", "--max-request-body-bytes",
                 "--max-prompt-chars", "--max-stop-strings", "--max-stop-string-chars",
                 "--max-detokenize-tokens"):
        assert flag in out
