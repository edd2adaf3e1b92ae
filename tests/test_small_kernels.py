"""Equivalence tests of the small kernels: cache write, RMSNorm, SiLU-and-mul, RoPE.

Each kernel is checked against an independent oracle written here from the
formula (float64, or a plain Python loop), so ``--backend=ref`` tests the ref
itself; an implementation that is not the ref is also compared with the ref.
Bad inputs must raise ``ValueError`` naming the offending argument.

Run: ``pytest -q tests/test_small_kernels.py --backend=fast`` (Triton's
interpreter on a CPU, compiled kernels on a GPU) and ``--backend=ref``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import (
    DEVICE,
    DTYPES,
    assert_close,
    examples,
    kernel_backend,  # noqa: F401  (runs every test per kernel backend)
)

import minivllm.ref.activation as ref_activation
import minivllm.ref.layernorm as ref_layernorm
import minivllm.ref.rotary as ref_rotary
from minivllm import backend
from minivllm.testing.strategies import BLOCK_SIZES, SMALL_HEAD_DIMS, gqa_heads

dtypes = st.sampled_from(DTYPES)


# ----------------------------------------------------------------------------- cache write
@settings(max_examples=examples(20))
@given(
    num_tokens=st.integers(1, 13),
    heads=gqa_heads(3),
    head_dim=st.sampled_from(SMALL_HEAD_DIMS),
    block_size=st.sampled_from(BLOCK_SIZES),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_reshape_and_cache(num_tokens, heads, head_dim, block_size, dtype, seed):
    impl = backend.get("cache_write")
    g = torch.Generator().manual_seed(seed)
    num_kv_heads = heads[1]
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    # Distinct random slots, with about a third of the rows as padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    pad = torch.rand(num_tokens, generator=g) < 0.3
    slot_mapping = torch.where(pad, -1, slots).to(torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Poison the cache: slots nobody writes must stay NaN.
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    dev = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slot_mapping)]
    impl.reshape_and_cache(*dev)
    k_out, v_out = dev[2].cpu(), dev[3].cpu()

    # Independent oracle: a plain Python loop over tokens.
    k_exp = _cache_write_oracle(key, k_cache, slot_mapping)
    v_exp = _cache_write_oracle(value, v_cache, slot_mapping)
    torch.testing.assert_close(k_out, k_exp, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_out, v_exp, equal_nan=True, rtol=0, atol=0)


def _cache_write_oracle(rows, cache, slot_mapping):
    """A plain Python loop: row ``t`` goes to block ``slot // bs``, offset ``slot % bs``."""
    out = cache.clone()
    block_size = cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[slot // block_size, slot % block_size] = rows[t]
    return out


def test_reshape_and_cache_strided_input():
    """K/V are often views into the fused qkv projection's output."""
    impl = backend.get("cache_write")
    qkv = torch.randn(5, 4 + 2 + 2, 24)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(3, 4, 2, 24)
    v_cache = torch.zeros(3, 4, 2, 24)
    slot_mapping = torch.tensor([3, -1, 0, 11, 6])
    k_exp = _cache_write_oracle(key, k_cache, slot_mapping)
    v_exp = _cache_write_oracle(value, v_cache, slot_mapping)
    dev = [t.to(DEVICE) for t in (qkv, k_cache, v_cache, slot_mapping)]
    impl.reshape_and_cache(dev[0][:, 4:6], dev[0][:, 6:8], dev[1], dev[2], dev[3])
    torch.testing.assert_close(dev[1].cpu(), k_exp, rtol=0, atol=0)
    torch.testing.assert_close(dev[2].cpu(), v_exp, rtol=0, atol=0)


@pytest.mark.parametrize(
    "key_shape, cache_shape, num_slots, field",
    [
        ((3, 2, 8), (2, 4, 2, 16), 3, "k_cache"),  # head_dim 8 vs the cache's 16
        ((3, 2, 8), (2, 4, 1, 8), 3, "k_cache"),  # 2 KV heads vs the cache's 1
        ((3, 2, 8), (2, 4, 2, 8), 2, "slot_mapping"),  # one slot short
        ((3, 16), (2, 4, 2, 8), 3, "key"),  # key is not (tokens, heads, head_dim)
    ],
)
def test_reshape_and_cache_rejects_bad_shapes(key_shape, cache_shape, num_slots, field):
    impl = backend.get("cache_write")
    key = torch.randn(key_shape).to(DEVICE)
    k_cache = torch.zeros(cache_shape).to(DEVICE)
    v_cache = torch.zeros(cache_shape).to(DEVICE)
    slots = torch.arange(num_slots).to(DEVICE)
    with pytest.raises(ValueError, match=field):
        impl.reshape_and_cache(key, key.clone(), k_cache, v_cache, slots)


# ----------------------------------------------------------------------------- RMSNorm
def _rms_oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` in float64, eps inside the square root."""
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _norm_input(num_tokens, hidden, scale, g):
    """Random rows of magnitude ``scale``, with every third row tiny (about 1e-3).

    For a tiny row ``mean(x^2)`` is about 1e-6, comparable to eps, so putting
    eps outside the square root (or dropping it) changes the output several-fold.
    """
    x = torch.randn(num_tokens, hidden, generator=g) * scale
    x[::3] *= 1e-3 / scale
    return x


@settings(max_examples=examples(25))
@given(
    num_tokens=st.integers(1, 9),
    hidden=st.sampled_from([8, 24, 40, 96, 130, 1000]),
    dtype=dtypes,
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm(num_tokens, hidden, dtype, eps, seed):
    impl = backend.get("layernorm")
    g = torch.Generator().manual_seed(seed)
    x = _norm_input(num_tokens, hidden, 3.0, g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    out = impl.rms_norm(x.to(DEVICE), w.to(DEVICE), eps).cpu()
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, _rms_oracle(x, w, eps), dtype, scale=2)
    if impl is not ref_layernorm:
        assert_close(out, ref_layernorm.rms_norm(x, w, eps), dtype)


def test_rms_norm_eps_inside_the_sqrt():
    """A row of 1e-3s with eps 1e-5: inside the sqrt the output is ~0.3, outside ~1."""
    impl = backend.get("layernorm")
    x = torch.full((2, 40), 1e-3)
    x[1] = 0.0  # an all-zero row must give zeros, not NaN
    w = torch.ones(40)
    out = impl.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    expected = 1e-3 / (1e-6 + 1e-5) ** 0.5  # 0.3015
    torch.testing.assert_close(out[0], torch.full((40,), expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(out[1], torch.zeros(40), rtol=0, atol=0)


@settings(max_examples=examples(25))
@given(
    num_tokens=st.integers(1, 9),
    hidden=st.sampled_from([8, 24, 40, 96, 130, 1000]),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_fused_add_rms_norm(num_tokens, hidden, dtype, seed):
    impl = backend.get("layernorm")
    g = torch.Generator().manual_seed(seed)
    eps = 1e-6
    x = _norm_input(num_tokens, hidden, 1.0, g).to(dtype)
    residual = _norm_input(num_tokens, hidden, 4.0, g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    x_d, r_d = x.clone().to(DEVICE), residual.clone().to(DEVICE)  # the impl may write into them
    out, new_res = impl.fused_add_rms_norm(x_d, r_d, w.to(DEVICE), eps)
    out, new_res = out.cpu(), new_res.cpu()
    assert out.dtype == dtype and new_res.dtype == dtype
    s = x.double() + residual.double()  # the new residual stream
    assert_close(new_res, s, dtype)
    assert_close(out, _rms_oracle(s, w, eps), dtype, scale=2)
    if impl is not ref_layernorm:
        ref_out, ref_res = ref_layernorm.fused_add_rms_norm(x.clone(), residual.clone(), w, eps)
        assert_close(new_res, ref_res, dtype)
        assert_close(out, ref_out, dtype)


def test_rms_norm_rejects_bad_weight():
    impl = backend.get("layernorm")
    x = torch.randn(2, 8).to(DEVICE)
    with pytest.raises(ValueError, match="weight"):
        impl.rms_norm(x, torch.ones(7).to(DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        impl.fused_add_rms_norm(x, x.clone(), torch.ones(7).to(DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        impl.fused_add_rms_norm(x, torch.randn(3, 8).to(DEVICE), torch.ones(8).to(DEVICE), 1e-6)


# ----------------------------------------------------------------------------- SiLU-and-mul
@settings(max_examples=examples(25))
@given(
    shape=st.sampled_from([(1,), (3,), (7,), (2, 3)]),
    inter=st.sampled_from([1, 7, 24, 130, 1100]),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul(shape, inter, dtype, seed):
    impl = backend.get("activation")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, 2 * inter, generator=g) * 3).to(dtype)
    out = impl.silu_and_mul(x.to(DEVICE)).cpu()
    assert out.shape == (*shape, inter) and out.dtype == dtype
    x64 = x.double()
    gate, up = x64[..., :inter], x64[..., inter:]
    oracle = gate / (1 + torch.exp(-gate)) * up
    assert_close(out, oracle, dtype, scale=2)
    if impl is not ref_activation:
        assert_close(out, ref_activation.silu_and_mul(x), dtype)


def test_silu_and_mul_rejects_odd_width():
    impl = backend.get("activation")
    with pytest.raises(ValueError, match="last dimension must be even"):
        impl.silu_and_mul(torch.randn(3, 7).to(DEVICE))


# ----------------------------------------------------------------------------- RoPE
def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (max_pos, rotary_dim)


def _rope_oracle(positions, x, cache, is_neox):
    """Complex-number formulation: rotate pair (a, b) by multiplying a + ib by e^{i theta}."""
    rot = cache.shape[-1]
    half = rot // 2
    cos, sin = cache[positions, :half].double(), cache[positions, half:].double()
    x64 = x.double()
    if is_neox:
        a, b = x64[..., :half], x64[..., half:rot]
    else:
        a, b = x64[..., 0:rot:2], x64[..., 1:rot:2]
    z = torch.complex(a, b) * torch.complex(cos, sin)[:, None, :]
    out = x64.clone()
    if is_neox:
        out[..., :half], out[..., half:rot] = z.real, z.imag
    else:
        out[..., 0:rot:2], out[..., 1:rot:2] = z.real, z.imag
    return out


@settings(max_examples=examples(25))
@given(
    num_tokens=st.integers(1, 9),
    heads=gqa_heads(3),
    head_dim=st.sampled_from((*SMALL_HEAD_DIMS, 64)),
    partial=st.booleans(),
    is_neox=st.booleans(),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_apply_rotary_emb(num_tokens, heads, head_dim, partial, is_neox, dtype, seed):
    impl = backend.get("rotary")
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    rotary_dim = head_dim // 2 if partial and head_dim % 4 == 0 else head_dim
    cache = _cos_sin_cache(64, rotary_dim)
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    dev = [t.to(DEVICE) for t in (positions, q.clone(), k.clone(), cache)]
    q_out, k_out = impl.apply_rotary_emb(*dev, is_neox_style=is_neox)
    q_out, k_out = q_out.cpu(), k_out.cpu()
    assert_close(q_out, _rope_oracle(positions, q, cache, is_neox), dtype, scale=2)
    assert_close(k_out, _rope_oracle(positions, k, cache, is_neox), dtype, scale=2)
    if impl is not ref_rotary:
        q_ref, k_ref = ref_rotary.apply_rotary_emb(positions, q, k, cache, is_neox)
        assert_close(q_out, q_ref, dtype)
        assert_close(k_out, k_ref, dtype)


def test_rotary_on_qkv_views():
    """q and k are usually views into the fused qkv output; rotating them must work."""
    impl = backend.get("rotary")
    qkv = torch.randn(6, 4 + 2 + 2, 40)
    cache = _cos_sin_cache(32, 40)
    positions = torch.tensor([0, 5, 31, 2, 2, 17])
    q_exp = _rope_oracle(positions, qkv[:, :4], cache, True)
    k_exp = _rope_oracle(positions, qkv[:, 4:6], cache, True)
    qkv_d = qkv.clone().to(DEVICE)
    q_out, k_out = impl.apply_rotary_emb(
        positions.to(DEVICE), qkv_d[:, :4], qkv_d[:, 4:6], cache.to(DEVICE)
    )
    assert_close(q_out, q_exp, torch.float32)
    assert_close(k_out, k_exp, torch.float32)


def test_rotary_rejects_bad_shapes():
    impl = backend.get("rotary")
    q, k = torch.randn(4, 2, 16).to(DEVICE), torch.randn(4, 1, 16).to(DEVICE)
    positions = torch.arange(4).to(DEVICE)
    with pytest.raises(ValueError, match="positions"):
        impl.apply_rotary_emb(positions[:3], q, k, _cos_sin_cache(8, 16).to(DEVICE))
    with pytest.raises(ValueError, match="cos_sin_cache"):  # rotary_dim 18 > head_dim 16
        impl.apply_rotary_emb(positions, q, k, _cos_sin_cache(8, 18).to(DEVICE))
    with pytest.raises(ValueError, match="query and key"):
        impl.apply_rotary_emb(positions, q, k[:3], _cos_sin_cache(8, 16).to(DEVICE))
