"""One request that fails over HTTP hurts no one else (issue 14, item 2, the server side).

A failure is injected (monkeypatch, no hook in production code) into ONE
request while it is sampled or detokenized, while other requests stream
beside it. The server runs in this process (``ServerThread``), so the patch
reaches its engine thread. The oracle is the offline engine before the
server took it over: the other requests must stream exactly those texts. The
failed request alone gets an error: a 500 with OpenAI's error JSON when it is
not streamed, a ``data: {"error": ...}`` event when it is. Afterwards
``/health`` is 200, the next request is served as before, and the KV pool is
free.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import offline_backend

from minivllm import LLM, SamplingParams
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.output_processor import IncrementalDetokenizer
from minivllm.entrypoints.openai.api_server import ServerThread
from minivllm.worker import sampling

VICTIM = [7] * 11  # a prompt length no other request has
OTHERS = [  # (token-id prompt, request fields): greedy, seeded, seeded top-k
    ([72, 101, 108, 108, 111], dict(temperature=0, max_tokens=12)),
    ([87, 111, 114, 108, 100, 33], dict(temperature=1.0, seed=11, max_tokens=12)),
    ([1, 2, 3], dict(temperature=0.8, top_k=20, seed=5, max_tokens=9)),
]


class Boom(RuntimeError):
    """The injected failure."""


def _inject_sample(monkeypatch) -> None:
    real = sampling.SamplingMetadata.from_requests

    def from_requests(requests, *args, **kwargs):
        if any(r.prompt_token_ids == VICTIM and r.num_output_tokens >= 3 for r in requests):
            raise Boom("injected into sampling")
        return real(requests, *args, **kwargs)

    monkeypatch.setattr(sampling.SamplingMetadata, "from_requests", from_requests)


def _inject_detokenize(monkeypatch) -> None:
    real = IncrementalDetokenizer._decode_next

    def decode_next(self):
        if self.num_prompt_tokens == len(VICTIM) and self.num_output_tokens >= 4:
            raise Boom("injected into detokenizing")
        return real(self)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode_next", decode_next)


@pytest.fixture(scope="module")
def served(tiny_model_dir, request):
    """(base URL, the offline texts of OTHERS) for a server in this process."""
    spec = offline_backend(request.config.getoption("--backend"))
    llm = LLM(str(tiny_model_dir("llama")), backend=spec, device="cpu", max_model_len=128)
    params = [SamplingParams(ignore_eos=True, **fields) for _, fields in OTHERS]
    want = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": p} for p, _ in OTHERS], params, use_tqdm=False)]
    server = ServerThread.start(AsyncLLM(llm.llm_engine), "tiny")
    try:
        yield server.base_url, want
    finally:
        server.stop()


async def _stream(c: httpx.AsyncClient, body: dict) -> list[dict | str]:
    """The events of a streamed completion (``"[DONE]"`` kept as a string)."""
    events = []
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events
                   if isinstance(e, dict) and e.get("choices"))


def _metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and "{" in line and 'le="' not in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("inject", [_inject_sample, _inject_detokenize],
                         ids=["sampling", "detokenizing"])
def test_a_failing_request_gets_its_own_error_and_the_others_stream_on(served, inject,
                                                                       monkeypatch) -> None:
    base_url, want = served
    victim = {"prompt": VICTIM, "temperature": 1.0, "seed": 3, "max_tokens": 12,
              "ignore_eos": True, "logprobs": 1}
    inject(monkeypatch)

    async def scenario():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
            others = [_stream(c, {"prompt": p, "ignore_eos": True, **fields})
                      for p, fields in OTHERS]
            return await asyncio.wait_for(asyncio.gather(
                *others, c.post("/v1/completions", json=victim), _stream(c, victim)), 120)

    *others, full, streamed = asyncio.run(scenario())
    assert [_text(events) for events in others] == want
    assert all(events[-1] == "[DONE]" for events in others)
    # Not streamed: a 500 with the request's own error.
    assert full.status_code == 500, full.text
    assert "Boom" in full.json()["error"]["message"]
    # Streamed: an error event ends it, instead of [DONE].
    assert "[DONE]" not in streamed
    assert "Boom" in streamed[-1]["error"]["message"]

    monkeypatch.undo()
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    again = asyncio.run(_again(base_url))
    assert again == want[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(base_url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total"] >= 2  # counted, "error" among the reasons


async def _again(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        prompt, fields = OTHERS[0]
        return _text(await _stream(c, {"prompt": prompt, "ignore_eos": True, **fields}))
