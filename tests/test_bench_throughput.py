"""``minivllm bench throughput``'s own engine run, on a tiny model (the timing is not tested)."""

from __future__ import annotations

from types import SimpleNamespace

from minivllm.bench.throughput import run_minivllm


def test_run_minivllm_generates_every_token_and_names_the_components(tiny_model_dir,
                                                                      backend_spec):
    args = SimpleNamespace(model=str(tiny_model_dir("llama")), backend=backend_spec,
                           dtype="float32", device="cpu", max_num_seqs=4,
                           max_num_batched_tokens=64, tensor_parallel_size=1,
                           enforce_eager=False, quiet=True)
    prompts = [[3, 5, 7, 11, 13, 17, 19, 23, 29], [2, 4, 6], [9] * 12]
    out_lens = [5, 1, 7]
    result = run_minivllm(args, prompts, out_lens)
    assert result["output_tokens"] == sum(out_lens)
    assert result["elapsed_s"] > 0 and result["dtype"] == "float32"
    assert "attention" in result["backends"] and "model_runner" in result["backends"]
