"""The CPU fast path (``minivllm/engine/cpu_fast_path.py``) against the plain forward.

The fast path must be an optimisation only: the same kernels on the same
inputs, so the same bits. The oracle is the plain path of the same engine
(its own correctness is checked against transformers in test_engine.py); a
fast path that skipped a layer, a norm or a residual add, swapped q and k,
or wrote the cache at the wrong slot would change the tokens here.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.cpu_fast_path import why_not
from minivllm.fast import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops did not build")


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _generate(llm: LLM, prompts, max_tokens: int, fast: bool):
    worker = llm.llm_engine.executor.worker
    assert worker.set_cpu_fast_path(fast) == fast
    llm.llm_engine.scheduler.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       logprobs=2),
                        use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "mistral"])
def test_fast_path_gives_the_plain_paths_tokens_and_logprobs(tiny_model_dir, arch):
    # Small token budget: prefill chunks and decodes share steps, so mixed batches run too.
    llm = LLM(str(tiny_model_dir(arch, num_hidden_layers=3)), backend="fast", dtype="float32",
              device="cpu", max_num_batched_tokens=32, max_num_seqs=4, block_size=4)
    prompts = _prompts(5, llm.llm_engine.vocab_size, seed=len(arch))
    plain = _generate(llm, prompts, 12, fast=False)
    fast = _generate(llm, prompts, 12, fast=True)
    assert fast[0] == plain[0]
    assert fast[1] == plain[1]  # bit for bit: the same kernels on the same inputs


def test_fast_path_gives_the_plain_paths_tokens_on_smollm2(smollm2_dir):
    llm = LLM(str(smollm2_dir), backend="fast", dtype="float32", device="cpu",
              max_model_len=256)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is",
                                       "def fibonacci(n):",
                                       "Paging in an operating system means")]
    plain = _generate(llm, prompts, 16, fast=False)
    fast = _generate(llm, prompts, 16, fast=True)
    assert fast[0] == plain[0]
    assert fast[1] == plain[1]


def test_fast_path_is_used_with_the_cpp_ops_and_not_with_the_ref(tiny_model_dir):
    path = str(tiny_model_dir("llama", num_hidden_layers=2))
    fast = LLM(path, backend="fast", dtype="float32", device="cpu")
    assert fast.llm_engine.executor.worker.cpu_fast_path is not None
    ref = LLM(path, backend="ref", dtype="float32", device="cpu")
    worker = ref.llm_engine.executor.worker
    assert worker.cpu_fast_path is None
    assert "not the C++ op" in why_not(worker.model, worker.kv_caches)


def test_fast_path_steps_aside_while_a_profiler_records(tiny_model_dir, tmp_path):
    import minivllm

    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    worker = llm.llm_engine.executor.worker
    calls = []
    run = worker.cpu_fast_path.run
    worker.cpu_fast_path.run = lambda mi: calls.append(1) or run(mi)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with minivllm.Profiler(str(tmp_path / "t.json"), print_summary=False) as prof:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert calls == [] and prof.op_times["attention"] > 0  # the plain path, with its ranges
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(calls) == 3
    assert torch.is_inference_mode_enabled() is False


def _stack_calls(monkeypatch) -> list[int]:
    """Rows of every step the C++ layer stack runs from now on."""
    from minivllm.engine.cpu_layer_stack import LayerStack

    calls: list[int] = []
    run = LayerStack.run
    monkeypatch.setattr(LayerStack, "run",
                        lambda self, hidden, *a: calls.append(hidden.shape[0]) or run(self, hidden, *a))
    return calls


@pytest.mark.parametrize("dtype,quantization", [
    ("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4"),
    ("bfloat16", "int8"),
])
def test_cpp_layer_stack_gives_the_plain_paths_bits(tiny_model_dir, monkeypatch, dtype,
                                                   quantization):
    """Decode steps run the whole stack in one C++ call; prefills keep the Python loop.

    Both must give the plain forward's tokens and logprobs exactly, for float and
    quantized projections (a projection of the wrong kind, a skipped norm or the
    rounding of a quantized output to bf16 done differently would show).
    """
    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=3)), backend="fast", dtype=dtype,
              device="cpu", max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
              quantization=quantization)
    prompts = _prompts(5, llm.llm_engine.vocab_size, seed=7)
    plain = _generate(llm, prompts, 10, fast=False)
    calls = _stack_calls(monkeypatch)
    fast = _generate(llm, prompts, 10, fast=True)
    assert fast == plain
    assert calls and max(calls) <= llm.llm_engine.executor.worker.cpu_fast_path.stack.max_rows


def test_cpp_layer_stack_steps_aside_where_a_projection_is_not_a_plain_gemv(tiny_model_dir):
    from minivllm.engine.cpu_layer_stack import LayerStack

    llm = LLM(str(tiny_model_dir("qwen2", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    worker = llm.llm_engine.executor.worker
    assert worker.cpu_fast_path is not None and worker.cpu_fast_path.stack is None
    assert "bias" in LayerStack.why_not(worker.model.model.layers, worker.kv_caches)
