"""The quantized KV cache (``kv_cache_dtype="int8"`` / ``"fp8"``): the formula and the kernels.

``minivllm/kv_quant.py`` defines the format: one float32 scale per (token, KV
head) row, ``s = max|x| / QMAX``, codes ``round(x / s)``. Here:

- the round trip stays within half a step of the formula (uniform steps of
  ``s`` for int8; 3 mantissa bits for e4m3), on rows from 1e-6 to 1e3;
- every twin writes the *same bytes*: codes and scales bit for bit equal to
  the ref's (``--backend=fast`` runs the C++ op and the Triton kernel in the
  interpreter); e4m3 codes and int8 ties checked on every e4m3 value and every
  midpoint between two (where a rounding mode shows);
- the ref's write is checked against the formula independently (every written
  row dequantizes within the bound, nothing else changes);
- attention over a quantized cache equals a float64 SDPA over the dequantized
  rows (``q * s`` computed here), within the dtype's float-order tolerance:
  decodes, prefill chunks over a cached prefix (the C++ GEMM tiles from 8 rows),
  block sizes that are not powers of 2, GQA, head_dim 24 / 40, contexts across
  blocks and Triton partitions. Unused slots hold NaN scales (and NaN e4m3 codes):
  a kernel that reads one returns NaN.

Run: ``pytest -q tests/test_kv_quant.py --backend=fast`` and ``--backend=ref``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_utils import (
    DTYPES,
    assert_close,
    examples,
    kernel_backend,  # noqa: F401  (runs every test per kernel backend)
)

import minivllm.ref.attention as ref_attention
import minivllm.ref.cache_write as ref_cache_write
from minivllm import backend, kv_quant
from minivllm.metadata import AttentionMetadata

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # written out, not imported


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|x - q s|`` allowed by the formula: half a step, plus float32 rounding of
    ``x / s`` and ``q * s`` (a relative 2^-22 covers both)."""
    x = x.double()
    s = scale.double().unsqueeze(-1)
    if dtype == torch.int8:
        half_step = s / 2  # uniform steps of s
    else:  # 3 mantissa bits: half a step is |x| / 16 in e4m3's normal range, s 2^-10 below
        half_step = torch.maximum(x.abs() / 16, s * 2.0**-10)
    return half_step + x.abs() * 2.0**-22 + 1e-30


def codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN codes included)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- the formula
@settings(max_examples=examples(40))
@given(
    rows=st.integers(1, 6), dim=st.sampled_from([1, 7, 24, 40, 64]),
    log_magnitude=st.floats(-6, 3), outlier=st.floats(1, 100),
    fmt=st.sampled_from(sorted(FORMATS)), dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_within_half_a_step(rows, dim, log_magnitude, outlier, fmt, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * 10.0**log_magnitude
    x[:, 0] *= outlier  # a dominant channel, as keys have
    x = x.to(dtype)
    assume(torch.isfinite(x).all())  # 1e3 x 100 overflows float16: no finite input to round
    q, s = kv_quant.quantize(x, FORMATS[fmt])
    assert q.dtype == FORMATS[fmt] and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    amax = x.float().abs().amax(-1)
    torch.testing.assert_close(s, amax / QMAX[q.dtype], rtol=0, atol=0)
    err = (x.double() - kv_quant.dequantize(q, s).double()).abs()
    assert (err <= error_bound(x, s, q.dtype)).all(), err.max()
    # The largest value of each row lands on the top code.
    assert (q.float().abs().amax(-1) == QMAX[q.dtype]).all()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_row_of_zeros_has_scale_zero(fmt):
    q, s = kv_quant.quantize(torch.zeros(3, 8), FORMATS[fmt])
    assert (s == 0).all() and (q.float() == 0).all()
    assert (kv_quant.dequantize(q, s) == 0).all()


def test_bytes_per_row_count_the_scale():
    assert kv_quant.bytes_per_token_head(64, torch.float32) == 256
    assert kv_quant.bytes_per_token_head(64, torch.bfloat16) == 128
    assert kv_quant.bytes_per_token_head(64, torch.int8) == 64 + 4
    assert kv_quant.bytes_per_token_head(40, torch.float8_e4m3fn) == 40 + 4


@pytest.mark.parametrize("bad", ["fp16", "FP8", "int4", None, 8])
def test_bad_kv_cache_dtype_names_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.check_kv_cache_dtype(bad)


# ----------------------------------------------------------------------------- cache write
def _write(impl, key, value, dtype, block_size, slots, num_blocks, seed):
    """Write through ``impl`` into a cache pre-filled with random codes and NaN scales."""
    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = key.shape[1:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    raw = torch.randint(0, 256, (2, *shape), generator=g, dtype=torch.uint8)
    k_cache, v_cache = (r.view(dtype) for r in raw.clone())
    k_scale = torch.full(shape[:3], float("nan"))
    v_scale = torch.full(shape[:3], float("nan"))
    impl.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    return k_cache, v_cache, k_scale, v_scale, raw


@settings(max_examples=examples(30))
@given(
    num_tokens=st.integers(1, 20), num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 24, 40]), block_size=st.sampled_from([1, 3, 5, 16]),
    fmt=st.sampled_from(sorted(FORMATS)), dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_cache_write_quantizes_each_row(num_tokens, num_kv_heads, head_dim, block_size, fmt,
                                        dtype, seed):
    """Strided K/V (views of one qkv row, as the model passes them), padding slots: every
    written row dequantizes within the bound, every other slot is untouched, and any
    implementation writes the ref's bytes."""
    impl = backend.get("cache_write")
    g = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + 2) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding rows
    qkv = (torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g)
           * torch.rand(num_tokens, 1, num_kv_heads, 1, generator=g) * 5).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided: token stride 3 * H_kv * D
    cache_dtype = FORMATS[fmt]
    got = _write(impl, key, value, cache_dtype, block_size, slots, num_blocks, seed)
    k_cache, v_cache, k_scale, v_scale, raw = got
    flat = num_blocks * block_size
    valid = slots >= 0
    for cache, scale, rows, before in ((k_cache, k_scale, key, raw[0]),
                                       (v_cache, v_scale, value, raw[1])):
        codes = cache.reshape(flat, num_kv_heads, head_dim)
        scales = scale.reshape(flat, num_kv_heads)
        s = scales[slots[valid]]
        deq = codes[slots[valid]].float() * s.unsqueeze(-1)
        x = rows[valid].float()
        assert (x.double() - deq.double()).abs().le(error_bound(x, s, cache_dtype)).all()
        untouched = torch.ones(flat, dtype=torch.bool)
        untouched[slots[valid]] = False
        assert torch.equal(cache.view(torch.uint8).reshape(flat, -1)[untouched],
                           before.reshape(flat, -1)[untouched])
        assert scales[untouched].isnan().all()
    if impl is not ref_cache_write:
        want = _write(ref_cache_write, key, value, cache_dtype, block_size, slots, num_blocks, seed)
        assert codes_equal(k_cache, want[0]) and codes_equal(v_cache, want[1])
        assert torch.equal(k_scale.nan_to_num(-1), want[2].nan_to_num(-1))
        assert torch.equal(v_scale.nan_to_num(-1), want[3].nan_to_num(-1))


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), and the floats
    just either side of each midpoint: where a rounding mode or a carry shows."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    pos = vals[vals > 0].sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    mids = torch.cat([pos[:1] / 2, mids])  # and half the smallest subnormal
    eps = mids * 2.0**-20
    probes = torch.cat([pos, mids, mids + eps, mids - eps])
    return torch.cat([probes, -probes, torch.zeros(1)])


def test_e4m3_codes_round_to_nearest_even_like_torch():
    """A row whose maximum is 448 has scale 1, so its codes are e4m3(x) exactly:
    every implementation must give torch's codes for every probe value."""
    impl = backend.get("cache_write")
    probes = _e4m3_probe_values()
    d = 64
    rows = math.ceil(probes.numel() / (d - 1))
    x = torch.zeros(rows * (d - 1))
    x[: probes.numel()] = probes
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, d - 1)], dim=1)  # (rows, d)
    key = x.view(rows, 1, d)
    k, v, ks, vs, _ = _write(impl, key, key, torch.float8_e4m3fn, rows, torch.arange(rows), 1, 0)
    assert (ks == 1.0).all()
    assert codes_equal(k.view(rows, d), x.to(torch.float8_e4m3fn))


def test_int8_codes_round_ties_to_even():
    """A row whose maximum is 127 has scale 1: x = k + 1/2 rounds to the even neighbour."""
    impl = backend.get("cache_write")
    ties = torch.arange(-127, 127).float() + 0.5  # -126.5 .. 126.5
    x = torch.cat([torch.tensor([127.0]), ties, torch.tensor([0.49, -0.51, 126.51, -127.0])])
    key = x.view(1, 1, -1)
    k, _, ks, _, _ = _write(impl, key, key, torch.int8, 1, torch.arange(1), 1, 0)
    assert (ks == 1.0).all()
    assert torch.equal(k.view(-1), torch.round(x).to(torch.int8))


# ----------------------------------------------------------------------------- attention
def make_quantized_batch(seqs, heads, head_dim, block_size, dtype, fmt, seed, spare_blocks=2):
    """A random paged batch whose cache is quantized (written by the ref), unused slots
    poisoned: NaN scales, and NaN e4m3 codes. Returns query, the four cache tensors,
    the metadata and each sequence's slots."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    blocks_per_seq = [math.ceil(s / block_size) for _, s in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seqs), max(max(blocks_per_seq), 1), dtype=torch.int32)
    cache = kv_quant.allocate(num_blocks, block_size, num_kv_heads, head_dim, FORMATS[fmt], "cpu")
    k_cache, v_cache, k_scale, v_scale = cache
    k_scale.fill_(float("nan"))
    v_scale.fill_(float("nan"))
    if fmt == "fp8":
        k_cache.view(torch.uint8).fill_(0x7F)  # NaN
        v_cache.view(torch.uint8).fill_(0x7F)
    slots, first = [], 0
    for i, (_, seq_len) in enumerate(seqs):
        blocks = perm[first : first + blocks_per_seq[i]]
        first += blocks_per_seq[i]
        block_tables[i, : len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        s = blocks[pos // block_size] * block_size + pos % block_size  # (seq_len,)
        slots.append(s)
        # Rows of different sizes (a row's scale follows its own maximum).
        size = torch.rand(seq_len, num_kv_heads, 1, generator=g) * 3
        k = (torch.randn(seq_len, num_kv_heads, head_dim, generator=g) * size).to(dtype)
        v = (torch.randn(seq_len, num_kv_heads, head_dim, generator=g) * size).to(dtype)
        ref_cache_write.reshape_and_cache(k, v, k_cache, v_cache, s,
                                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    num_tokens = sum(q for q, _ in seqs)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    md = AttentionMetadata.build(
        query_lens=[q for q, _ in seqs], seq_lens=[s for _, s in seqs],
        block_tables=block_tables, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64))
    return query, cache, md, slots


def dequantized_oracle(query, cache, seqs, slots, scale):
    """Per-sequence float64 SDPA over ``codes * scale``, dequantized here from the formula."""
    k_cache, v_cache, k_scale, v_scale = cache
    num_heads = query.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2:]
    group = num_heads // num_kv_heads
    out, start = [], 0
    for (q_len, seq_len), s in zip(seqs, slots):
        k = (k_cache.reshape(-1, num_kv_heads, head_dim)[s].double()
             * k_scale.reshape(-1, num_kv_heads)[s].double().unsqueeze(-1))
        v = (v_cache.reshape(-1, num_kv_heads, head_dim)[s].double()
             * v_scale.reshape(-1, num_kv_heads)[s].double().unsqueeze(-1))
        q = query[start : start + q_len].double().transpose(0, 1)  # (H, q_len, D)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, seq_len, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = seq_len - q_len + torch.arange(q_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                   .transpose(0, 1))
        start += q_len
    return torch.cat(out)


def run_and_check(seqs, heads, head_dim, block_size, dtype, fmt, seed):
    impl = backend.get("attention")
    query, cache, md, slots = make_quantized_batch(seqs, heads, head_dim, block_size, dtype,
                                                   fmt, seed)
    k_cache, v_cache, k_scale, v_scale = cache
    scale = head_dim**-0.5
    out = impl.paged_attention(query, k_cache, v_cache, md, scale, k_scale=k_scale,
                               v_scale=v_scale)
    assert out.shape == query.shape and out.dtype == dtype
    # The oracle uses the same dequantized values: only the float order differs.
    assert_close(out, dequantized_oracle(query, cache, seqs, slots, scale), dtype, scale=1.5)
    if impl is not ref_attention:
        want = ref_attention.paged_attention(query, k_cache, v_cache, md, scale,
                                             k_scale=k_scale, v_scale=v_scale)
        assert_close(out, want, dtype)


@settings(max_examples=examples(25))
@given(
    seqs=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 40)).map(
        lambda t: (t[0] if t[0] > 6 else 1, t[0] + t[1])), min_size=1, max_size=3),
    heads=st.sampled_from([(2, 2), (4, 2), (6, 3), (8, 1)]),
    head_dim=st.sampled_from([8, 24, 40]),
    block_size=st.sampled_from([1, 5, 16]),
    dtype=st.sampled_from(DTYPES), fmt=st.sampled_from(sorted(FORMATS)),
    seed=st.integers(0, 2**16),
)
def test_attention_over_a_quantized_cache(seqs, heads, head_dim, block_size, dtype, fmt, seed):
    """Decodes and prefill chunks (7-12 rows: the C++ GEMM tiles) over a cached prefix."""
    run_and_check(seqs, heads, head_dim, block_size, dtype, fmt, seed)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decode_and_prefill_cross_blocks_and_partitions(fmt):
    """Contexts across many blocks of 5 (and two of Triton's 512-token partitions)."""
    run_and_check([(1, 530), (1, 7), (9, 61)], (6, 3), 40, 5, torch.float32, fmt, seed=3)
    run_and_check([(1, 97), (1, 1)], (4, 2), 24, 16, torch.bfloat16, fmt, seed=4)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_flash_decoding_merges_quantized_partitions(fmt):
    """Triton flash-decoding with partitions of 64 tokens over a quantized cache."""
    if backend.get("attention").__name__ not in ("minivllm.fast.attention",
                                                  "minivllm.fast.triton.attention"):
        pytest.skip("the Triton flash-decoding kernels")
    from minivllm.fast.attention_decode import paged_decode_attention

    seqs = [(1, 300), (1, 5), (1, 129)]
    query, cache, md, slots = make_quantized_batch(seqs, (4, 2), 16, 8, torch.float32, fmt, 7)
    k_cache, v_cache, k_scale, v_scale = cache
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                           md.query_start_loc, md.max_seq_len, 0.25, out, partition_size=64,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert_close(out, dequantized_oracle(query, cache, seqs, slots, 0.25), torch.float32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_key_returns_its_value_row_exactly(fmt):
    """A one-token context: softmax over one key is 1, so the output is that key's value
    row, dequantized: ``code * s`` exactly, for every finite code of the format (how a
    kernel widens its codes shows here, subnormal e4m3 codes included)."""
    impl = backend.get("attention")
    dtype = FORMATS[fmt]
    if dtype == torch.int8:
        codes = torch.arange(-127, 128, dtype=torch.int8)
    else:
        raw = torch.arange(256, dtype=torch.uint8)
        codes = raw[(raw & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    head_dim = 64
    rows = math.ceil(codes.numel() / head_dim)
    v_codes = torch.zeros(rows * head_dim, dtype=dtype)
    v_codes[: codes.numel()] = codes
    v_cache = v_codes.view(rows, 1, 1, head_dim)  # one block of one slot per sequence
    k_cache = torch.zeros_like(v_cache)
    k_scale = torch.ones(rows, 1, 1)
    v_scale = torch.full((rows, 1, 1), 0.75)  # exact: a product the kernels must not round
    md = AttentionMetadata.build(query_lens=[1] * rows, seq_lens=[1] * rows,
                                 block_tables=torch.arange(rows, dtype=torch.int32)[:, None],
                                 slot_mapping=torch.full((rows,), -1, dtype=torch.int64))
    query = torch.randn(rows, 2, head_dim)  # GQA 2:1
    out = impl.paged_attention(query, k_cache, v_cache, md, 0.125, k_scale=k_scale,
                               v_scale=v_scale)
    want = (v_codes.float() * 0.75).view(rows, 1, head_dim).expand(rows, 2, head_dim)
    assert torch.equal(out, want)


def test_a_quantized_cache_needs_its_scales():
    impl = backend.get("attention")
    writer = backend.get("cache_write")
    query, cache, md, _ = make_quantized_batch([(2, 5)], (2, 1), 8, 4, torch.float32, "int8", 0)
    k_cache, v_cache, k_scale, v_scale = cache
    with pytest.raises(ValueError, match="k_scale"):
        impl.paged_attention(query, k_cache, v_cache, md, 1.0)
    with pytest.raises(ValueError, match="k_scale"):
        writer.reshape_and_cache(query[:, :1], query[:, :1], k_cache, v_cache, md.slot_mapping)
    with pytest.raises(ValueError, match="v_scale"):
        impl.paged_attention(query, k_cache, v_cache, md, 1.0, k_scale=k_scale,
                             v_scale=v_scale[:, :2])
    float_k, float_v = torch.zeros(k_cache.shape), torch.zeros(v_cache.shape)
    with pytest.raises(ValueError, match="quantized"):
        impl.paged_attention(query, float_k, float_v, md, 1.0, k_scale=k_scale, v_scale=v_scale)
