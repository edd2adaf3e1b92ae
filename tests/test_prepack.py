"""Prepacked float weights (``minivllm.fast.linear.prepack``) for the CPU GEMM path.

The oracle is a float64 matmul of the same weights: the packed GEMM must give
``x W^T + b`` for every row count above the GEMV's, and a packed layer must
still serve few rows through the GEMV (which reads the plain weight).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.fast import linear as fast_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")


@pytest.mark.parametrize("m", [fast_linear.GEMV_MAX_ROWS + 1, 64, 131])
@pytest.mark.parametrize("n,k", [(1537, 576), (17, 33), (3, 1)])
def test_packed_gemm_matches_float64(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = fast_linear.prepack_weight(w)
    assert packed is not None
    x = torch.randn(2, m, k, generator=g)  # 3-D input: (batch, rows, K)
    y = fast_linear.linear(x, w, b, packed=packed)
    expect = x.double() @ w.double().T + b.double()
    assert y.shape == (2, m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_few_rows_still_read_the_plain_weight():
    w = torch.randn(40, 24)
    packed = fast_linear.prepack_weight(w)
    x = torch.randn(3, 24)
    w_changed = w * 2  # a plain weight that disagrees with the packed copy
    # The GEMV serves 3 rows from the plain weight; the packed copy is not read.
    torch.testing.assert_close(fast_linear.linear(x, w_changed, packed=packed), x @ w_changed.T)


def test_what_is_never_packed():
    from minivllm.ref.quantization import quantize

    assert fast_linear.prepack_weight(quantize(torch.randn(8, 32), "int8")) is None
    assert fast_linear.prepack_weight(torch.randn(8)) is None


def test_prepack_off_keeps_no_copy(tiny_model_dir, monkeypatch):
    """``prepack=False`` (``$MINIVLLM_PREPACK=0``, read once into the engine's config)
    reaches every layer's hook: no packed copy, and the same tokens."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.config import EngineConfig

    monkeypatch.setenv("MINIVLLM_PREPACK", "0")
    assert EngineConfig().prepack is False
    monkeypatch.delenv("MINIVLLM_PREPACK")
    assert EngineConfig().prepack is True
    path = str(tiny_model_dir("llama", num_hidden_layers=2))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1, 40))}  # a prefill past the GEMV's rows
    tokens = []
    for prepack in (False, True):
        llm = LLM(path, backend="fast", dtype="float32", device="cpu", prepack=prepack)
        model = llm.llm_engine.executor.worker.model
        layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
        assert layers and all((m.packed_weight is not None) == prepack for m in layers)
        tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_the_loader_packs_every_float_projection(tiny_model_dir):
    from minivllm import LLM

    llm = LLM(str(tiny_model_dir("llama", num_hidden_layers=2)), backend="fast",
              dtype="float32", device="cpu")
    model = llm.llm_engine.executor.worker.model
    layers = [m for m in model.modules() if hasattr(m, "process_weights_after_loading")]
    assert len(layers) == 2 * 4 + 1  # 4 projections a layer, and the LM head
    assert all(m.packed_weight is not None for m in layers)
