"""The model runner twins: the fast one is the model's own forward, bit for bit, or steps aside.

``model_runner`` (``minivllm/ref/model_runner.py``, ``minivllm/fast/model_runner.py``)
runs a step's forward. The ref calls the model's forward; the fast twin runs
the C++ layer stack on a CPU (CUDA graphs on a GPU). The oracle is the same
engine with ``enforce_eager=True`` (the model's own forward, whose correctness
test_engine.py checks against transformers): a fast path that skipped a layer,
a norm or a residual add, swapped q and k, wrote the cache at the wrong slot,
or ignored a model feature (a bias, a q/k norm) would change the tokens or the
logprobs here. Every registered architecture is covered.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from conftest import _ARCHS, TINY_CONFIGS

from minivllm import LLM, SamplingParams
from minivllm.fast import cpu_ops
from minivllm.fast.linear_prepack import _panel_width
from minivllm.model.architectures import MODEL_REGISTRY
from minivllm.model.llama import LlamaDecoderLayer

needs_cpp = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops did not build")


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _generate(llm: LLM, prompts, max_tokens: int):
    llm.llm_engine.scheduler.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       logprobs=2),
                        use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


def _runner(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner


def _stack_rows(monkeypatch, logits: list[bool] | None = None) -> list[int]:
    """Rows of every step the C++ layer stack runs from now on (and into ``logits``,
    whether that step's logits came out of the same call)."""
    from minivllm.fast.model_runner import LayerStack

    calls: list[int] = []
    run = LayerStack.run

    def spy(self, mi, **kw):
        calls.append(mi.input_ids.shape[0])
        if logits is not None:
            logits.append(kw.get("logits", False))
        return run(self, mi, **kw)

    monkeypatch.setattr(LayerStack, "run", spy)
    return calls


def test_every_registered_architecture_has_a_tiny_model():
    assert set(_ARCHS.values()) == set(MODEL_REGISTRY)
    assert {TINY_CONFIGS[a]["model_type"] for a in TINY_CONFIGS} == set(_ARCHS)


@needs_cpp
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_fast_runner_gives_the_models_own_forward_bit_for_bit(tiny_model_dir, monkeypatch, arch):
    """Every architecture: the tokens and logprobs of enforce_eager, exactly.

    A small token budget makes prefill chunks and decodes share steps, so
    mixed batches run too; the stack must have served the decode steps of
    every model whose features it implements, and no other.
    """
    from minivllm.fast.model_runner import SUPPORTED_FEATURES

    path = str(tiny_model_dir(arch, num_hidden_layers=3))
    kw = dict(backend="fast", dtype="float32", device="cpu", max_num_batched_tokens=32,
              max_num_seqs=4, block_size=4)
    eager = LLM(path, enforce_eager=True, **kw)
    prompts = _prompts(5, eager.llm_engine.vocab_size, seed=len(arch))
    expect = _generate(eager, prompts, 12)
    assert _runner(eager).fast_paths == ()
    fast = LLM(path, **kw)
    rows = _stack_rows(monkeypatch)
    got = _generate(fast, prompts, 12)
    assert got[0] == expect[0]
    assert got[1] == expect[1]  # bit for bit: the same kernels on the same inputs
    model = fast.llm_engine.executor.worker.model
    if model.features <= SUPPORTED_FEATURES:
        assert _runner(fast).fast_paths == ("cpu_layer_stack",)
        assert rows and max(rows) <= _runner(fast).layer_stack.max_rows
    else:
        assert rows == [] and _runner(fast).fast_paths == ()
        assert "does not implement" in _runner(fast).fallback_reason


@needs_cpp
def test_fast_runner_gives_the_models_own_forward_on_smollm2(smollm2_dir):
    kw = dict(backend="fast", dtype="float32", device="cpu", max_model_len=256)
    eager, fast = LLM(str(smollm2_dir), enforce_eager=True, **kw), LLM(str(smollm2_dir), **kw)
    tok = fast.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                       "Paging in an operating system means")]
    assert _runner(fast).fast_paths == ("cpu_layer_stack",)
    assert _generate(fast, prompts, 16) == _generate(eager, prompts, 16)


@needs_cpp
@pytest.mark.parametrize("dtype,quantization", [
    ("float32", None), ("bfloat16", None), ("float32", "w8a16"), ("float32", "w4a16"),
    ("bfloat16", "w8a16"), ("float32", "w8a8"), ("float32", "w4a8"), ("bfloat16", "w8a8"),
    ("bfloat16", "w4a8"),
])
def test_cpp_layer_stack_gives_the_models_own_bits_for_every_weight_kind(
        tiny_model_dir, monkeypatch, dtype, quantization):
    """Float and quantized projections (W8A16, W4A16, W8A8, W4A8): a projection of the
    wrong kind, a skipped norm, activations quantized differently (or not at all) or the
    rounding of a quantized output to bf16 done differently would show."""
    path = str(tiny_model_dir("llama", num_hidden_layers=3))
    kw = dict(backend="fast", dtype=dtype, device="cpu", max_num_batched_tokens=32,
              max_num_seqs=4, block_size=4, quantization=quantization)
    eager = LLM(path, enforce_eager=True, **kw)
    prompts = _prompts(5, eager.llm_engine.vocab_size, seed=7)
    expect = _generate(eager, prompts, 10)
    fast = LLM(path, **kw)
    in_call: list[bool] = []
    rows = _stack_rows(monkeypatch, in_call)
    assert _generate(fast, prompts, 10) == expect
    assert rows
    # The embedding lookup, the final norm and the LM head ran in the stack's call too.
    stack = _runner(fast).layer_stack
    assert stack.lm_head is not None and stack.embedding is not None and all(in_call)
    if dtype == "float32" and quantization is None and _panel_width():
        # float32 weights with panels: the prefill steps' 17-32 rows ran the panel GEMM
        # inside the stack too (the GEMV takes up to 16)
        assert max(rows) > cpu_ops.ops().float_gemv_max_rows()


@needs_cpp
def test_an_undeclared_feature_runs_the_models_forward(tiny_model_dir, caplog):
    """A feature the C++ stack does not know (added to the model later) is never run by
    it: the runner falls back to the model's forward and says why, once."""
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    worker = llm.llm_engine.executor.worker
    assert worker.model_runner.fast_paths == ("cpu_layer_stack",)
    worker.model.features = worker.model.features | {"sliding_window"}
    with caplog.at_level(logging.INFO, logger="minivllm"):
        runner = worker.build_model_runner(enforce_eager=False)
    assert runner.fast_paths == () and "sliding_window" in runner.fallback_reason
    assert [r for r in caplog.records if "sliding_window" in r.getMessage()]


def test_enforce_eager_runs_the_decoder_layers_own_forward(tiny_model_dir, monkeypatch):
    """A reader's breakpoint in LlamaDecoderLayer.forward fires on every step."""
    calls = []
    forward = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, *a: calls.append(1) or forward(self, *a))
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), dtype="float32",
              device="cpu", enforce_eager=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert len(calls) == 2 * 4  # 2 layers, 4 steps (the prefill and 3 decodes)


def test_the_ref_runner_is_the_models_forward(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="ref",
              dtype="float32", device="cpu")
    runner = _runner(llm)
    assert runner.fast_paths == () and runner.describe() == "the model's own forward"


@needs_cpp
def test_fast_runner_steps_aside_while_a_profiler_records(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    import minivllm

    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    rows = _stack_rows(monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with minivllm.Profiler(str(tmp_path / "t.json"), print_summary=False) as prof:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert rows == [] and prof.op_times["attention"] > 0  # the model's forward, with ranges
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(rows) == 3
    assert torch.is_inference_mode_enabled() is False


@needs_cpp
def test_cpp_layer_stack_steps_aside_for_long_prefills(tiny_model_dir, monkeypatch):
    """A step with more rows than the GEMVs take runs the model's forward."""
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    rows = _stack_rows(monkeypatch)
    limit = _runner(llm).layer_stack.max_rows
    llm.generate([{"prompt_token_ids": list(range(limit + 5))}],
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert rows == [1]  # the prefill ran plainly, the one decode in the stack


@needs_cpp
@pytest.mark.parametrize("feature", ["n", "structured", "both"])
def test_n_and_structured_outputs_stay_in_the_cpp_layer_stack(tiny_model_dir, monkeypatch,
                                                               feature):
    """Features the engine serves by default cost no fast path: every step of a batch-1
    request with ``n`` > 1 (its siblings fork child 0's blocks) or a grammar (masks are
    applied to the logits, after the forward) runs in one C++ call, and no layer's own
    forward runs."""
    from minivllm import StructuredOutputsParams

    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    rows = _stack_rows(monkeypatch)
    eager: list[int] = []
    forward = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, *a, **k: eager.append(1) or forward(self, *a, **k))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True,
                            n=3 if feature in ("n", "both") else 1,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{4,12}")
                            if feature in ("structured", "both") else None)
    out = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], params, use_tqdm=False)
    assert len(out[0].outputs) == params.n
    assert eager == [], "a step left the C++ layer stack"
    assert rows and rows[0] == 5  # the prefill, in the stack too (5 rows)
    num_decode_tokens = sum(len(c.token_ids) for c in out[0].outputs) - params.n
    assert sum(rows) - 5 == num_decode_tokens  # every decode token's row in the stack
