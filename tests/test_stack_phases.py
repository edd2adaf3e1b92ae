"""The C++ layer stack's own clock (``csrc/layer_stack_clock.h``) and ``bench latency``'s
table of it (``minivllm/bench/_stack_phases.py``)."""

from __future__ import annotations

import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.bench import _stack_phases as stack_phases
from minivllm.bench import latency
from minivllm.fast import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")

PHASES = ["norm", "qkv", "rope + cache write", "attention", "o", "post-attention norm",
          "gate_up", "silu_and_mul", "down", "final norm", "lm head"]


def _llm(tiny_model_dir, **kw):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", backend="fast", **kw)
    if llm.llm_engine.executor.worker.model_runner.layer_stack is None:
        pytest.skip("the tiny model's decode steps do not take the C++ layer stack here")
    return llm


def _tokens(llm, prompts, n):
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def test_phases_are_named_in_the_order_a_layer_runs_them():
    assert cpu_ops.ops().decode_layers_phases() == PHASES


def test_every_decode_step_is_counted_once_and_its_phases_fit_in_the_steps(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    prompts = latency.random_prompts(2, 11, llm.llm_engine.vocab_size, seed=1)
    start = time.perf_counter()
    got = stack_phases.measure(llm, prompts, 6)
    elapsed_ms = 1000 * (time.perf_counter() - start)
    assert got is not None and got["calls"] == 5  # 6 tokens: the prefill's, then 5 steps
    assert list(got["phases"]) == PHASES
    ms = {name: p["ms"] for name, p in got["phases"].items()}
    assert all(v >= 0 for v in ms.values())
    for name in ("qkv", "attention", "o", "gate_up", "down", "lm head"):
        assert ms[name] > 0, name
    assert sum(ms.values()) * got["calls"] < elapsed_ms  # inside the steps' wall time
    for name in ("qkv", "o", "gate_up", "down", "lm head"):
        assert got["phases"][name]["gbps"] > 0
    assert "gbps" not in got["phases"]["attention"]
    # The clock is off again: steps now add nothing to it.
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=3))
    assert cpu_ops.ops().decode_layers_timing(False) == [0.0] * (1 + len(PHASES))


def test_the_clock_does_not_change_a_token_or_a_logprob(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    prompts = latency.random_prompts(3, 9, llm.llm_engine.vocab_size, seed=2)
    quiet = _tokens(llm, prompts, 5)
    cpu_ops.ops().decode_layers_timing(True)
    try:
        timed = _tokens(llm, prompts, 5)
    finally:
        calls = cpu_ops.ops().decode_layers_timing(False)[0]
    assert calls > 0 and timed == quiet


def test_weight_bytes_are_what_a_step_of_that_many_rows_reads(tiny_model_dir):
    """Float: the weight. Quantized: qweight and its scales (and minimums), or at one row
    the prepacked copy where the layer has one (it holds the scales)."""
    for quantization in (None, "int8", "int4", "w8a16"):
        llm = _llm(tiny_model_dir, quantization=quantization)
        stack = llm.llm_engine.executor.worker.model_runner.layer_stack
        for kernel in [*stack.projections, stack.lm_head]:
            weight, scales, mins, packed = kernel.tensors
            if kernel.kind == "float":
                expected = {1: weight.numel() * weight.element_size()}
                expected[7] = expected[1]
            else:
                stored = sum(t.numel() * t.element_size()
                             for t in {id(t): t for t in (weight, scales, mins)}.values())
                copy = packed.numel() * packed.element_size()
                expected = {1: copy if packed is not weight else stored, 7: stored}
            for rows, want in expected.items():
                assert stack_phases.weight_bytes(kernel, rows) == want
        llm.llm_engine.shutdown()
