"""``minivllm bench throughput --compare llamacpp`` without the optional extra installed."""

from __future__ import annotations

import sys

import pytest

from minivllm.bench import llamacpp


def test_missing_binding_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(SystemExit, match=r"\[llamacpp\]"):
        llamacpp.require_llama_cpp()


def test_find_gguf_reports_where_it_looked(tmp_path):
    with pytest.raises(SystemExit, match="no.*gguf|gguf.*none"):
        llamacpp.find_gguf(str(tmp_path), tmp_path)
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    assert llamacpp.find_gguf(str(tmp_path), tmp_path).name == "model.Q4_1.gguf"


def test_missing_tool_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MINIVLLM_LLAMACPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(SystemExit) as e:
        llamacpp.find_tool("llama-batched-bench", tmp_path)
    msg = str(e.value)
    assert "minivllm bench llamacpp --build" in msg
    assert "cmake" in msg and "llama-batched-bench" in msg and "llama-cpp-python" in msg


def test_build_steps_build_the_three_tools_from_the_vendored_source(tmp_path):
    steps = [" ".join(c) for c in llamacpp.build_steps(tmp_path)]
    assert any("--no-binary :all:" in s and "llama-cpp-python" in s for s in steps)
    assert any("vendor/llama.cpp" in s and "-DGGML_NATIVE=ON" in s for s in steps)
    assert any(all(t in s for t in llamacpp.TOOLS) and "-j2" in s for s in steps)


def _fake_tool(bin_dir, name, lines):
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / name
    tool.write_text("#!/bin/sh\necho 'a log line'\n" + "".join(f"echo '{ln}'\n" for ln in lines))
    tool.chmod(0o755)
    return tool


def test_batched_bench_reads_llamas_jsonl_per_batch_size(tmp_path):
    rows = ['{"pl": 1, "speed": 273.5, "speed_tg": 109.0, "speed_pp": 600.0, '
            '"t_pp": 0.2, "t_tg": 0.5, "t": 0.7}',
            '{"pl": 64, "speed": 968.0, "speed_tg": 800.0, "speed_pp": 900.0, '
            '"t_pp": 9.1, "t_tg": 5.1, "t": 14.2}']
    _fake_tool(tmp_path / "bin", "llama-batched-bench", rows)
    got = llamacpp.batched_bench(tmp_path / "m.gguf", 128, 64, [1, 64], 2, tmp_path)
    assert got[1]["total_tok_s"] == 273.5 and got[1]["decode_tok_s"] == 109.0
    assert got[64]["total_tok_s"] == 968.0


def test_llama_bench_names_pp_and_tg(tmp_path):
    rows = ['{"n_prompt": 4096, "n_gen": 0, "avg_ts": 634.0}',
            '{"n_prompt": 0, "n_gen": 128, "avg_ts": 158.0}']
    _fake_tool(tmp_path / "bin", "llama-bench", rows)
    assert llamacpp.llama_bench(tmp_path / "m.gguf", 4096, 128, 2, 1, tmp_path) == {
        "pp4096": 634.0, "tg128": 158.0}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_weight_bytes_per_token_counts_what_a_decode_step_reads(tiny_model_dir, tie, quantization):
    """The roofline's denominator, against the config's own arithmetic: every projection,
    norm and the LM head once; the embedding table only where it is the LM head."""
    import json

    from minivllm import LLM
    from minivllm.bench.llamacpp import weight_bytes_per_token

    path = tiny_model_dir("llama", tie_word_embeddings=tie)
    c = json.loads((path / "config.json").read_text())
    h, inter, layers, vocab = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                               c["vocab_size"])
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    projections = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]  # (N, K) a layer
    llm = LLM(str(path), dtype="float32", device="cpu", quantization=quantization)
    model = llm.llm_engine.executor.worker.model
    if quantization is None:
        per_layer = sum(4 * n * k for n, k in projections)
    else:  # int8 weights and a float32 scale per output row and group
        qw = model.model.layers[0].self_attn.qkv_proj.weight
        group = qw.group_size
        per_layer = sum(n * k + 4 * n * (k // group) for n, k in projections)
    head = model.lm_head.weight
    head_bytes = (4 * vocab * h if not hasattr(head, "qweight")
                  else head.qweight.nbytes + head.scales.nbytes)
    # A quantized LM head is its own tensor: the float table beside it is read a row a step.
    expected = layers * (per_layer + 2 * 4 * h) + 4 * h + head_bytes
    assert weight_bytes_per_token(model) == expected
    # Moved into huge pages (each storage a huge page longer than its tensor): the same.
    from minivllm.fast import model_runner_hugepages as hugepages

    model._minivllm_hugepages = False
    if hugepages.rehome(model, min_bytes=1):
        assert weight_bytes_per_token(model) == expected
    llm.shutdown()
