"""The model's generation_config.json: sampling defaults and every EOS id (vLLM's
``--generation-config auto|vllm|DIR``; docs/sampling.md, "The model's defaults").

Oracles: the values written into the file here (what the defaults must become); for the
EOS ids, the same
engine's greedy tokens without the file, which the file's extra EOS id must cut at its
first occurrence, and leave whole with ``ignore_eos`` or ``generation_config="vllm"``.

Run: ``pytest -q tests/test_generation_config.py --backend=ref`` and ``--backend=fast``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from server_utils import ServerProcess, offline_backend, server_backend

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.model.generation_config import (
    GenerationDefaults,
    check_generation_config,
    read_generation_config,
)

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.05, "max_new_tokens": 7}
MODEL_EOS = 257  # conftest's tiny models


@pytest.fixture
def spec(request) -> str:
    return server_backend(request.config.getoption("--backend"))


def with_config(tiny_model_dir, tmp_path, config: dict | None):
    """A copy of the tiny llama with ``config`` as its generation_config.json."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    if config is not None:
        (path / "generation_config.json").write_text(json.dumps(config))
    return path


def make_llm(path, spec, **kw) -> LLM:
    return LLM(str(path), backend=offline_backend(spec), device="cpu", dtype="float32",
               max_model_len=128, **kw)


def test_the_files_values_become_the_defaults(tiny_model_dir, tmp_path, spec):
    path = with_config(tiny_model_dir, tmp_path, {**RECOMMENDED, "do_sample": True})
    llm = make_llm(path, spec)
    try:
        got = llm.get_default_sampling_params()
        assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty,
                got.max_tokens) == (0.6, 0.9, 20, 0.05, 1.05, 7)
    finally:
        llm.shutdown()
    llm = make_llm(path, spec, generation_config="vllm")  # ignored: SamplingParams' own
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.shutdown()


def test_only_the_sampling_keys_the_file_sets_are_taken(tmp_path):
    """vLLM's keys, as the file writes them (even a value equal to a library default);
    nothing else (bos, pad, do_sample), and no key the file leaves out or sets to null."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_k": 50, "top_p": None, "do_sample": True,
         "eos_token_id": 5, "bos_token_id": 4, "pad_token_id": 5}))
    got = read_generation_config(tmp_path / "generation_config.json")
    assert got.sampling == {"temperature": 1.0, "top_k": 50} and got.eos_token_ids == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    got = read_generation_config(tmp_path / "generation_config.json")
    assert got.sampling == {"max_tokens": 40} and got.eos_token_ids == ()


def test_bad_generation_configs_are_refused_with_the_field_or_the_file(tmp_path):
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm'"):
        check_generation_config("nope")
    with pytest.raises(ValueError, match="no .*generation_config.json"):
        check_generation_config(str(tmp_path))
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(tmp_path), generation_config=3)  # before anything is loaded
    f = tmp_path / "generation_config.json"
    for text, what in (('{"temperature": -1}', "temperature"), ("{not json", "JSON"),
                       ('{"eos_token_id": "x"}', "eos_token_id"), ("[1]", "JSON object")):
        f.write_text(text)
        with pytest.raises(ValueError, match=what) as e:
            read_generation_config(f)
        assert str(f) in str(e.value)


def test_every_eos_id_of_the_generation_config_stops_generation(tiny_model_dir, tmp_path,
                                                                spec):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    plain = with_config(tiny_model_dir, tmp_path, None)
    llm = make_llm(plain, spec)
    try:
        want = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    # The first token that is new in the run (and not the model's EOS), after a few.
    cut = next(i for i in range(2, len(want))
               if want[i] not in want[:i] and want[i] != MODEL_EOS)
    extra = want[cut]
    shutil.rmtree(plain)
    path = with_config(tiny_model_dir, tmp_path, {"eos_token_id": [MODEL_EOS, extra]})
    for mode, params, expect in (
            ("auto", greedy, list(want[:cut + 1])),
            ("auto", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), None),
            (str(path), greedy, list(want[:cut + 1])),  # a folder: read from there
            ("vllm", greedy, list(want))):
        llm = make_llm(path, spec, generation_config=mode)
        try:
            out = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
        if expect is None:  # ignore_eos: every EOS id is ignored, the run is as long as asked
            assert len(out.token_ids) == 12 and list(out.token_ids[:cut + 1]) == \
                list(want[:cut + 1])
            continue
        assert list(out.token_ids) == expect, mode
        if len(expect) < len(want):
            assert out.finish_reason == "stop" and out.stop_reason == extra


def test_the_server_takes_the_models_defaults_where_a_request_sets_nothing():
    d = {"temperature": 0.3, "top_k": 7, "max_tokens": 5, "repetition_penalty": 1.1}
    p = CompletionRequest(prompt="x").engine_params(d)
    assert (p.temperature, p.top_k, p.max_tokens, p.repetition_penalty, p.top_p) == \
        (0.3, 7, 5, 1.1, 1.0)  # completions' max_tokens 16, capped by the model's 5
    p = CompletionRequest(prompt="x", temperature=0.9, top_k=0, max_tokens=3).engine_params(d)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.9, 0, 3)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**chat).engine_params(d).max_tokens == 5
    assert ChatCompletionRequest(**chat, max_tokens=9).engine_params(d).max_tokens == 5
    assert ChatCompletionRequest(**chat).engine_params(None).max_tokens is None
    assert GenerationDefaults().default_sampling_params() == SamplingParams()


def test_served_requests_take_the_models_defaults_over_http(tiny_model_dir, tmp_path, spec):
    """Greedy (temperature 0) and 4 tokens by the model's say: a request that sets neither
    gets the offline greedy answer, whatever its seed; the server logs what it took."""
    path = with_config(tiny_model_dir, tmp_path, {"temperature": 0.0, "max_new_tokens": 4})
    llm = make_llm(path, spec)
    try:
        want = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                           ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    server = ServerProcess(str(path), "--backend", spec, "--max-model-len", "128")
    try:
        for seed in (1, 2):
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
                "prompt": [3, 1, 4, 1, 5], "seed": seed, "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 4
            assert body["choices"][0]["text"] == want
        assert "generation config" in server.output()
    finally:
        server.stop()
