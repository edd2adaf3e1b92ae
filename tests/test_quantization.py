"""Weight-only quantization: the formats, the matmul twins, GGUF blocks, the engine arg.

Oracles: the formulas of ``minivllm/ref/quantization.py`` rewritten here in
float64 (the test's own unpacking, never the module's), the ``gguf``
package's own quantizer and dequantizer for GGUF blocks, and for whole models
the perplexity of SmolLM2 against bf16. ``backend.get("quantization")`` is the
implementation under test (``--backend=ref`` or ``--backend=fast``).

Run: ``pytest -q tests/test_quantization.py --backend=ref`` and ``--backend=fast``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import examples

from minivllm import backend
from minivllm.model.quantization import check_quantization, gguf_blocks


@pytest.fixture(scope="module")
def ops():
    return backend.get("quantization")


def oracle_dequantize(qw) -> torch.Tensor:
    """float64 ``W`` from the stored integers, unpacked here from the documented layout."""
    if qw.qweight.dim() == 3:  # the ref's simulated ranks: (tp, N, K)
        return torch.stack([oracle_dequantize(qw[r]) for r in range(qw.qweight.shape[0])])
    n, k = qw.shape
    g = qw.scales.shape[-1]
    if qw.method == "int8":
        q = qw.qweight.double()
        s = qw.scales.double().repeat_interleave(k // g, dim=-1)
        return q * s
    b = qw.qweight.numpy().reshape(n, k // 32, 16)
    q = np.concatenate([b & 15, b >> 4], axis=-1).reshape(n, k).astype(np.float64)
    d = qw.scales.double().repeat_interleave(32, dim=-1)
    m = qw.mins.double().repeat_interleave(32, dim=-1)
    return torch.from_numpy(q) * d + m


def weights(n: int, k: int, seed: int, magnitude: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * magnitude
    w[0, :32] = 0.0  # a zero group
    if n > 1:
        w[1, :32] = 0.37  # a constant group
    return w


# --------------------------------------------------------------------------- formats
@settings(max_examples=examples(20), deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 7), seed=st.integers(0, 99),
       magnitude=st.sampled_from([1e-6, 1.0, 3e4]))
def test_int8_round_trip_error_is_at_most_half_a_step(ops, n, groups, seed, magnitude):
    w = weights(n, 32 * groups, seed, magnitude)
    qw = ops.quantize(w, "int8")
    assert qw.qweight.dtype == torch.int8 and qw.scales.shape == (n, 1)
    q = qw.qweight.int()
    assert q.abs().max() <= 127
    s = w.double().abs().amax(dim=-1, keepdim=True) / 127  # the formula, in float64
    torch.testing.assert_close(qw.scales.double(), s, rtol=1e-6, atol=0)
    err = (oracle_dequantize(qw) - w.double()).abs()
    assert (err <= s / 2 * (1 + 1e-5) + 1e-30).all()
    assert (q[0] == 0).all() and qw.scales[0] == 0 or w[0].abs().max() > 0
    # the largest weight of a row lands exactly on +-127
    nonzero = s.squeeze(-1) > 0
    assert (q.abs().amax(dim=-1)[nonzero] == 127).all()
    torch.testing.assert_close(ops.dequantize(qw).double(), oracle_dequantize(qw), rtol=2e-7,
                               atol=0)


@settings(max_examples=examples(20), deadline=None)
@given(n=st.integers(2, 40), groups=st.integers(1, 7), seed=st.integers(0, 99),
       magnitude=st.sampled_from([1e-6, 1.0, 3e4]))
def test_int4_round_trip_error_is_at_most_half_a_step(ops, n, groups, seed, magnitude):
    k = 32 * groups
    w = weights(n, k, seed, magnitude)
    qw = ops.quantize(w, "int4")
    assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (n, k // 2)
    wg = w.double().reshape(n, groups, 32)
    lo, hi = wg.amin(-1), wg.amax(-1)
    torch.testing.assert_close(qw.mins.double(), lo, rtol=0, atol=0)
    torch.testing.assert_close(qw.scales.double(), (hi - lo) / 15, rtol=1e-6, atol=0)
    deq = oracle_dequantize(qw)
    step = ((hi - lo) / 15).repeat_interleave(32, dim=-1)
    assert ((deq - w.double()).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * step.max()).all()
    # zero and constant groups come back exactly
    assert torch.equal(deq[0, :32], w[0, :32].double())
    assert torch.allclose(deq[1, :32], w[1, :32].double(), rtol=0, atol=0)
    # float32 arithmetic against float64: a few ulps of the group's largest value
    torch.testing.assert_close(ops.dequantize(qw).double(), deq, rtol=2e-6,
                               atol=2e-7 * w.abs().max().item())


def test_ties_round_to_even(ops):
    # s = 1 (max 127): 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (torch.round: half to even)
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])
    assert ops.quantize(w, "int8").qweight[0, :4].tolist() == [127, 2, 4, -2]
    # int4: min 0, max 15 -> d = 1; 2.5 -> 2, 7.5 -> 8
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([15.0, 2.5, 7.5, 0.0])
    q = oracle_dequantize(ops.quantize(w, "int4"))[0, :4]
    assert q.tolist() == [15.0, 2.0, 8.0, 0.0]


def test_bad_shapes_are_refused(ops):
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quantize(torch.randn(4, 48), "int4")
    with pytest.raises(ValueError, match="method"):
        ops.quantize(torch.randn(4, 64), "int3")
    with pytest.raises(ValueError, match="quantization"):
        check_quantization("int3")
    qw = ops.quantize(torch.randn(5, 64), "int8")
    with pytest.raises(ValueError, match="K = 64"):
        ops.quantized_linear(torch.randn(2, 63), qw)


# --------------------------------------------------------------------------- matmul
@settings(max_examples=examples(25), deadline=None)
@given(method=st.sampled_from(["int8", "int4"]), m=st.sampled_from([1, 2, 3, 7, 8, 9, 17]),
       n=st.integers(1, 67), groups=st.integers(1, 9), seed=st.integers(0, 99),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
def test_quantized_linear_matches_float64(ops, method, m, n, groups, seed, dtype, bias):
    k = 32 * groups
    w = weights(n, k, seed)
    qw = ops.quantize(w, method)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = ops.quantized_linear(x, qw, b)
    assert y.dtype == dtype and y.shape == (m, n)
    expected = x.double() @ oracle_dequantize(qw).T + (0 if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * k ** 0.5)


def _awkward_case(method, group_size, n, k, magnitude, seed=0):
    w = weights(n, k, seed, magnitude)
    qw = ops_quantize(w, method, group_size)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(seed + 1))
    return qw, x


def ops_quantize(w, method, group_size):
    from minivllm.ref.quantization import quantize_int4, quantize_int8

    return quantize_int8(w, group_size) if method == "int8" else quantize_int4(w)


#: (method, group_size): per channel, Q8_0-style 32, a group of 12 (not a multiple of
#: the 8-lane vectors: the C++ op's plain loop), and the 4-bit format.
FORMATS = [("int8", None), ("int8", 32), ("int8", 12), ("int4", 32)]
#: (N, K): N not a multiple of the tiles' 4 or 8 weight rows, K of 1, 3 and 18 groups.
AWKWARD = [(5, 32), (13, 96), (37, 96), (37, 576)]


@pytest.mark.parametrize("method,group_size", FORMATS)
@pytest.mark.parametrize("n,k", AWKWARD)
@pytest.mark.parametrize("magnitude", [1e-6, 3e4])
def test_decode_shaped_linear_on_awkward_sizes(ops, method, group_size, n, k, magnitude):
    """M = 1..5 rows (the decode kernels' M = 1 tiles, and 2-row tiles plus an odd row)."""
    if group_size and k % group_size:
        pytest.skip("group does not divide K")
    qw, x = _awkward_case(method, group_size, n, k, magnitude)
    w64 = oracle_dequantize(qw)
    for m in (1, 2, 3, 4, 5):
        y = ops.quantized_linear(x[:m], qw)
        expected = x[:m].double() @ w64.T
        torch.testing.assert_close(y.double(), expected, rtol=1e-4,
                                   atol=1e-4 * k ** 0.5 * w64.abs().max().item())


@pytest.mark.parametrize("method,group_size", FORMATS)
@pytest.mark.parametrize("n,k", AWKWARD)
def test_cpp_tiles_and_plain_loop_match_float64(method, group_size, n, k):
    """The C++ ops directly, both paths (``portable=True``: the plain loop), M = 1..8, and
    a batch-64-decode-sized M (odd, so the last row takes the 1-row tile) up to the limit."""
    from minivllm.fast import cpu_ops

    if not cpu_ops.available():
        pytest.skip(f"C++ ops not built: {cpu_ops.unavailable_reason()}")
    if group_size and k % group_size:
        pytest.skip("group does not divide K")
    from minivllm.fast.quantization import GEMV_MAX_ROWS

    qw, x = _awkward_case(method, group_size, n, k, 1.0, seed=5)
    x = torch.cat([x, torch.randn(GEMV_MAX_ROWS - 8, k, generator=torch.Generator().manual_seed(9))])
    w64 = oracle_dequantize(qw)
    for m in [*range(1, 9), 65, GEMV_MAX_ROWS]:
        expected = x[:m].double() @ w64.T
        for portable in (False, True):
            out = torch.full((m, n), float("nan"))
            if method == "int8":
                cpu_ops.ops().int8_linear(out, x[:m], qw.qweight, qw.scales, portable)
            else:
                cpu_ops.ops().int4_linear(out, x[:m], qw.qweight, qw.scales, qw.mins, portable)
            torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4 * k ** 0.5)


def test_int8_per_group_and_gemv(ops):
    """The course's GEMV on a Q8_0-style weight (a scale per 32), and 3-D inputs."""
    w = weights(13, 96, 3)
    qw = ops.quantize_int8(w, group_size=32)
    assert qw.scales.shape == (13, 3)
    x = torch.randn(2, 5, 96)
    expected = x.double() @ oracle_dequantize(qw).T
    torch.testing.assert_close(ops.quantized_linear(x, qw).double(), expected,
                               rtol=1e-4, atol=1e-4)
    y = ops.int8_gemv(x[0], qw.qweight, qw.scales)
    torch.testing.assert_close(y.double(), expected[0], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- GGUF blocks
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_match_the_gguf_dequantizer(ops, type_name):
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    w = weights(11, 96, 7).numpy()
    raw = gguf.quants.quantize(w, qtype)  # (11, bytes per row), the gguf package's own
    expected = gguf.quants.dequantize(raw, qtype)  # (11, 96) float32
    q, d, m = gguf_blocks(raw, type_name)
    from minivllm.ref.quantization import QuantizedWeight, pack_int4

    qt, scales = torch.from_numpy(q), torch.from_numpy(d[:, ::32].copy())
    if type_name == "Q8_0":
        qw = QuantizedWeight("int8", qt.to(torch.int8), scales, None, 32)
    else:
        qw = QuantizedWeight("int4", pack_int4(qt), scales, torch.from_numpy(m[:, ::32].copy()), 32)
    torch.testing.assert_close(oracle_dequantize(qw).float(), torch.from_numpy(expected),
                               rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 96)
    torch.testing.assert_close(ops.quantized_linear(x, qw).double(),
                               x.double() @ torch.from_numpy(expected).double().T,
                               rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- models
def llm_model(llm):
    return llm.llm_engine.executor.worker.model


def _dequantized_twin(quant, dense):
    """Give ``dense`` every quantized weight of ``quant``, dequantized by the oracle.

    A tied LM head gets its own Parameter, so the twin's embedding keeps the float
    rows, as the quantized model's does."""
    for name, layer in quant.named_modules():
        if hasattr(layer, "weight") and not isinstance(layer.weight, torch.Tensor):
            target = dense.get_submodule(name)
            w = oracle_dequantize(layer.weight).float()
            if name == "lm_head":
                del target.weight
                target.weight = torch.nn.Parameter(w, requires_grad=False)
            else:
                target.weight.data.copy_(w)
            repack = getattr(target, "process_weights_after_loading", None)
            if repack is not None:  # a prepacked copy (fast twin) must follow the new weight
                repack()


@pytest.mark.parametrize("method", ["w8a16", "w4a16"])
def test_tiny_model_matches_its_dequantized_float_twin(tiny_model_dir, method):
    """Every projection and the LM head quantized, activations float (W8A16 / W4A16; W8A8
    is tests/test_w8a8.py's); the same model with W := dequantize(W) is the oracle: logits
    of a prefill, and greedy tokens of a decode."""
    from minivllm import LLM, SamplingParams
    from minivllm.bench.quality import logits_of
    from minivllm.model.loader import load_model
    from minivllm.model.quantization import LM_HEAD_METHOD, quantization_scheme
    from minivllm.ref.quantization import QuantizedWeight

    path = tiny_model_dir("llama")
    quant, _, _ = load_model(path, quantization=method)
    dense, _, _ = load_model(path)
    head = quant.lm_head.weight
    fmt = quantization_scheme(method)[0]
    assert isinstance(head, QuantizedWeight) and head.method == LM_HEAD_METHOD[fmt]
    assert head.activations == "float"
    # the embedding (tied to the LM head) still looks up float rows
    assert isinstance(quant.model.embed_tokens.weight, torch.Tensor)
    torch.testing.assert_close(quant.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    _dequantized_twin(quant, dense)
    ids = list(range(3, 40))
    torch.testing.assert_close(logits_of(quant, ids), logits_of(dense, ids),
                               rtol=1e-4, atol=1e-4)
    # Greedy decoding (one row per step: the M = 1 kernels) gives the twin's tokens.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 2, 33, 17]}, {"prompt_token_ids": [40, 41]}]
    # float32 pinned: "auto" is bfloat16 on a CPU with avx512_bf16, where the dequantized
    # float32 weights would not fit the twin and bf16 rounding would blur the comparison.
    llm = LLM(str(path), quantization=method, dtype="float32")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    twin = LLM(str(path), dtype="float32")
    _dequantized_twin(llm_model(llm), llm_model(twin))
    want = [o.outputs[0].token_ids for o in twin.generate(prompts, params)]
    assert got == want


def test_llm_refuses_unknown_quantization():
    from minivllm import LLM

    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM("smollm2", quantization="fp4")


@pytest.fixture(scope="module")
def smollm2_quality(smollm2_dir):
    """Perplexity and argmax of SmolLM2 on a fixed text: bf16, int8, int4, GGUF Q4_1, each
    with float activations (W8A16 / W4A16; tests/test_w8a8.py measures W8A8)."""
    from minivllm.bench.quality import TEXT, perplexity
    from minivllm.model.loader import load_model

    results = {}
    for q in (None, "w8a16", "w4a16", "gguf-a16"):
        model, _, tok = load_model(smollm2_dir, dtype=torch.bfloat16, quantization=q)
        ids = tok.encode(TEXT)
        results[q] = perplexity(model, ids)
        del model
    return results


@pytest.mark.parametrize("method,max_ratio", [("w8a16", 1.02), ("w4a16", 1.05),
                                               ("gguf-a16", 1.01)])
def test_smollm2_perplexity_vs_bf16(smollm2_quality, method, max_ratio):
    """int8 within 2% of bf16 (measured +1.27% with the fast twins, LM head in int8 too;
    +1.16% with the LM head in bf16: the 144-token text moves by about 1% on its own,
    bf16 vs float32 is -0.23%), int4 within 5% (measured +0.54%; its LM head is int8
    as well). SmolLM2's weights are dequantized Q4_1, already
    on a 4-bit grid of groups of 32, so int4 nearly recovers them. The perplexity is
    one prefill, where a quantized layer dequantizes into x's dtype and calls
    F.linear: the GGUF's blocks in bf16 are then bit for bit the bf16 model's
    weights, and the fast twin's perplexity equals bf16's exactly (the ref's
    dequantizes in float32: +0.3%). The decode-shaped kernels are checked in
    test_gguf_native_blocks_are_the_converted_weights."""
    from minivllm.bench.quality import greedy_agreement

    base_ppl, base_argmax = smollm2_quality[None]
    ppl, argmax = smollm2_quality[method]
    assert ppl <= base_ppl * max_ratio, (method, ppl, base_ppl)
    assert greedy_agreement(argmax, base_argmax) >= (0.75 if method == "w4a16" else 0.9)


def test_gguf_native_blocks_are_the_converted_weights(smollm2_dir):
    """The Q4_1 blocks loaded as stored dequantize to exactly what the converter wrote
    (it used ``gguf.quants.dequantize``): the gguf package is the oracle."""
    from minivllm.model.loader import load_model

    quant, _, _ = load_model(smollm2_dir, quantization="gguf-a16")  # float activations
    dense, _, _ = load_model(smollm2_dir)  # float32: the exact dequantized values
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.5.mlp.gate_up_proj",
                 "model.layers.29.mlp.down_proj", "model.layers.3.self_attn.o_proj"):
        qw = quant.get_submodule(name).weight
        assert qw.method == "int4"
        w = dense.get_submodule(name).weight.data
        torch.testing.assert_close(oracle_dequantize(qw).float(), w, rtol=1e-6, atol=1e-7)
    # The tied LM head runs on token_embd's Q8_0 blocks; the embedding keeps float rows.
    head = quant.lm_head.weight
    assert head.method == "int8" and head.group_size == 32
    torch.testing.assert_close(oracle_dequantize(head).float(), dense.lm_head.weight.data,
                               rtol=1e-6, atol=1e-7)
    assert torch.equal(quant.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    # Decode-shaped steps (few rows: the quantized GEMV kernels, not dequantize +
    # F.linear) give the float32 model's logits up to the order of the sums.
    from minivllm.bench.quality import logits_of

    for ids in ([1, 2, 3], list(range(100, 108))):
        torch.testing.assert_close(logits_of(quant, ids), logits_of(dense, ids),
                                   rtol=1e-3, atol=1e-3)  # fmt: skip


def test_gguf_integer_kernels_read_the_blocks_float16_scales_exactly(smollm2_dir):
    """quantization="gguf" (W4A8: int8 activations) keeps the blocks' scales and minimums
    in float16, as the file stores them (2 bytes a block less to read at batch 1), and its
    logits are bit for bit those of the same weights with the scales widened to float32."""
    import dataclasses

    from minivllm.bench.quality import logits_of
    from minivllm.model.loader import load_model
    from minivllm.model.quantization import quantized_layers

    def weights(model):
        return [layer.weight for _, layer in quantized_layers(model)] + [model.lm_head.weight]

    half, _, _ = load_model(smollm2_dir, quantization="gguf")
    wide, _, _ = load_model(smollm2_dir, quantization="gguf")
    for w in weights(half):
        assert w.activations == "int8" and w.scales.dtype == torch.float16
        assert w.mins is None or w.mins.dtype == torch.float16
    layers = [layer for _, layer in quantized_layers(wide)] + [wide.lm_head]
    for layer in layers:
        w = layer.weight
        layer.weight = dataclasses.replace(
            w, scales=w.scales.float(), mins=None if w.mins is None else w.mins.float())
    assert sum(w.nbytes for w in weights(wide)) > 1.15 * sum(w.nbytes for w in weights(half))
    for ids in ([1, 2, 3], list(range(100, 108)), list(range(300, 440))):  # GEMV and prefill
        assert torch.equal(logits_of(half, ids), logits_of(wide, ids))


def test_smollm2_int8_perplexity_within_one_percent_of_float32(smollm2_dir):
    """Per-channel int8 weights, float activations (W8A16), against the float32 model it
    was made from, same compute dtype: measured +0.62% with the LM head in int8 as well
    (+0.50% with it in float32; both twins; mean KL 0.004 nats a token; groups of 32
    would give 0.001). The bf16 comparison above needs 2%: bf16 itself moves this text
    by 0.2%. W8A8 (the default for "int8") is +1.11%: tests/test_w8a8.py."""
    from minivllm.bench.quality import TEXT, perplexity
    from minivllm.model.loader import load_model

    ppl = {}
    for q in (None, "w8a16"):
        model, _, tok = load_model(smollm2_dir, dtype=torch.float32, quantization=q)
        ppl[q], _ = perplexity(model, tok.encode(TEXT))
        del model
    assert ppl["w8a16"] <= ppl[None] * 1.01, ppl
