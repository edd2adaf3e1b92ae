"""SIGTERM or SIGINT to ``minivllm serve`` while a stream runs: the stream's last event is
an error naming the shutdown (never a stream cut off without a word), the server exits
within 30 s, and no child process or port is left (docs/serving.md, "Shutdown").

Run: ``pytest -q tests/test_server_shutdown.py --backend=ref``.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from server_utils import ServerProcess, alive, children, port_is_free, server_backend


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_open_streams_with_an_error_and_the_server_exits(tiny_model_dir, request,
                                                                       sig):
    spec = server_backend(request.config.getoption("--backend"))
    server = ServerProcess(str(tiny_model_dir("llama")), "--backend", spec,
                           "--max-model-len", "512")
    try:
        kids = children(server.proc.pid)
        events: list[str] = []
        body = {"prompt": [3, 1, 4], "n": 8, "max_tokens": 500, "stream": True,
                "ignore_eos": True, "temperature": 1.0, "seed": 0}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:  # the stream is running: now the signal
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            sent = time.monotonic()
            server.proc.send_signal(sig)
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
        last = json.loads(events[-1])
        assert "error" in last, events[-3:]
        assert "shutting down" in last["error"]["message"] and sig.name in \
            last["error"]["message"]
        server.proc.wait(30)
        assert time.monotonic() - sent < 30
        deadline = time.monotonic() + 15
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)]
        assert port_is_free(server.port)
    finally:
        server.stop(check=False)


def test_a_stopped_in_process_server_lets_its_engine_go(tiny_model_dir):
    """A process that starts servers one after another (a tutorial, the book build) must
    not keep every stopped engine: fastapi's endpoint caches held them (the book build
    grew to 20 GB)."""
    import gc
    import weakref

    from minivllm import LLM
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import ServerThread

    llm = LLM(str(tiny_model_dir("llama")), device="cpu", max_model_len=128, backend="ref")
    server = ServerThread.start(AsyncLLM(llm.llm_engine), "tiny")
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200
    engine = weakref.ref(llm.llm_engine)
    server.stop()
    del server, llm
    gc.collect()
    assert engine() is None
