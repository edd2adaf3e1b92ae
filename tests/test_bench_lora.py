"""``python -m minivllm.bench lora`` runs, and its fast and ref columns agree (no timing asserted)."""

from __future__ import annotations

import pytest
import torch

from minivllm.bench import lora


def test_rows_and_agreement():
    from minivllm.fast import cpu_ops

    if not torch.cuda.is_available() and not cpu_ops.available():
        pytest.skip(f"the C++ CPU kernels are not available ({cpu_ops.unavailable_reason()})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = lora.run(rank=4, device=device, token_counts=(1, 5), adapter_counts=(1, 3))
    assert [(r["tokens"], r["adapters"]) for r in rows] == [(1, 1), (5, 1), (5, 3)]
    for r in rows:
        assert r["max_abs_err"] < 1e-4 and r["fast_ms"] > 0 and r["ref_ms"] > 0
    assert lora.delta_flops(2, 4) == 2 * 2 * 4 * (3 * 576 + 960 + 2 * 576 + 3072 + 1536 + 576
                                                  + 576 + 576)


def test_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path):
    """The --e2e rows run (tiny sizes), and the adapter written in PEFT's format is read
    back by the engine's reader with every module at its rank."""
    from transformers import AutoConfig

    from minivllm.bench import _lora_e2e as lora_e2e
    from minivllm.lora.peft_format import load_adapter
    from minivllm.lora.request import LoRARequest

    path = tiny_model_dir("llama")
    rows = lora_e2e.run(str(path), batch_sizes=(1, 3), adapter_counts=(1, 2), rank=4,
                        output_len=3, backend="ref", dtype="float32")
    assert [(r["batch"], r["adapters"]) for r in rows] == [
        (1, 0), (3, 0), (1, 1), (3, 1), (3, 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    hf_config = AutoConfig.from_pretrained(str(path))
    adapter = lora_e2e.write_random_adapter(tmp_path / "a", hf_config, rank=4, seed=0)
    model = load_adapter(LoRARequest("a", 1, str(adapter)), hf_config, 16, torch.float32)
    assert model.rank == 4
    assert len(model.loras) == hf_config.num_hidden_layers * len(lora_e2e.MODULES)
