"""``minivllm bench prefill``: its kernel case and its row-loop attention backend.

The timings mean nothing here; what is checked is that both prefill paths and SDPA
are run on the same work and agree (the bench's own error column), and that the
import path ``minivllm.bench.prefill`` serves as the ``attention`` component of an
engine, giving the fast attention's tokens.

Run: ``pytest -q tests/test_bench_prefill.py``.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.bench import prefill
from minivllm.fast import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")


def test_kernel_case_runs_both_paths_and_sdpa():
    r = prefill.bench_kernel(70, repeats=1)
    assert r["max_abs_err"] < 1e-4
    assert r["gemm_ms"] > 0 and r["rows_ms"] > 0 and r["sdpa_ms"] > 0


def test_row_loop_backend_gives_the_fast_attention_tokens(tiny_model_dir):
    prompts = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [7, 8, 9]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for backend in (None, {"attention": "minivllm.bench.prefill"}):
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", backend=backend)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)])
        llm.shutdown()
    assert tokens[0] == tokens[1]
