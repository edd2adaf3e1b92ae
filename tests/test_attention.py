"""Equivalence tests of paged attention: flash-decoding and the unified prefill kernel.

The implementation under test (``backend.get("attention")``) runs on a paged
cache whose unused slots are poisoned with NaN (a kernel that reads past a
sequence's end, or through a wrong block id, returns NaN). Every implementation, the ref
included, gets the poisoned cache. It is compared with an independent oracle
written here (per-sequence float64 ``scaled_dot_product_attention`` over K/V
collected slot by slot) and, when the implementation is not the ref itself,
with ``minivllm.ref.attention`` on the same cache.

Run: ``pytest -q tests/test_attention.py --backend=fast`` (Triton's
interpreter on a CPU) and ``--backend=ref``; on a GPU add ``-m cuda`` for the
full grid of vLLM's kernel tests.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DEVICE, DTYPES, assert_close, examples

import minivllm.ref.attention as ref_attention
from minivllm import backend
from minivllm.metadata import AttentionMetadata
from minivllm.testing.strategies import BLOCK_SIZES, SMALL_HEAD_DIMS, gqa_heads


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, spare_blocks=3):
    """A random paged batch.

    ``seqs`` is a list of ``(query_len, seq_len)``. Blocks are handed out in a
    random order; the cache's unused slots are NaN. Returns ``(query, k_cache,
    v_cache, metadata, slots)`` with ``slots[i]`` the flat cache slots of
    sequence ``i``'s tokens, in order.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for _, s in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seqs), max(max(blocks_per_seq), 1), dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_flat = torch.full(shape, float("nan"), dtype=dtype)
    v_flat = torch.full(shape, float("nan"), dtype=dtype)
    slots, first = [], 0
    for i, (_, seq_len) in enumerate(seqs):
        blocks = perm[first : first + blocks_per_seq[i]]
        first += blocks_per_seq[i]
        block_tables[i, : len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        s = blocks[pos // block_size] * block_size + pos % block_size  # (seq_len,)
        slots.append(s)
        k_flat[s] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v_flat[s] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    num_tokens = sum(q for q, _ in seqs)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    metadata = AttentionMetadata.build(
        query_lens=[q for q, _ in seqs],
        seq_lens=[s for _, s in seqs],
        block_tables=block_tables,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),  # unused by attention
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return query, k_flat.view(cache_shape), v_flat.view(cache_shape), metadata, slots


def sdpa_oracle(query, k_cache, v_cache, seqs, slots, scale):
    """Per-sequence float64 SDPA with a causal mask offset by the cached prefix."""
    num_heads, head_dim = query.shape[1:]
    k_flat = k_cache.reshape(-1, *k_cache.shape[2:]).double()
    v_flat = v_cache.reshape(-1, *v_cache.shape[2:]).double()
    group = num_heads // k_cache.shape[2]
    out, start = [], 0
    for (q_len, seq_len), s in zip(seqs, slots):
        q = query[start : start + q_len].double().transpose(0, 1)  # (H, q_len, D)
        k = k_flat[s].repeat_interleave(group, dim=1).transpose(0, 1)  # (H, seq_len, D)
        v = v_flat[s].repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = seq_len - q_len + torch.arange(q_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out.append(o.transpose(0, 1))
        start += q_len
    return torch.cat(out)  # (num_tokens, H, D)


def run_and_check(seqs, heads, head_dim, block_size, dtype, seed, device=DEVICE):
    impl = backend.get("attention")
    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, md, slots = make_batch(
        seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    md_dev = md.to(device)
    out = impl.paged_attention(query.to(device), k_cache.to(device), v_cache.to(device), md_dev,
                               scale)  # fmt: skip
    out = out.cpu()
    assert out.shape == query.shape and out.dtype == dtype
    # The oracle collects the valid slots itself; zeroing the poison keeps its maths NaN-free.
    oracle = sdpa_oracle(query, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), seqs, slots,
                         scale)  # fmt: skip
    assert_close(out, oracle, dtype, scale=1.5)
    if impl is not ref_attention:
        assert_close(out, ref_attention.paged_attention(query, k_cache, v_cache, md, scale), dtype)


# ----------------------------------------------------------------------------- random batches
def seq_shapes(max_seqs=3, max_context=60, max_query=24, decode_only=False):
    """Lists of ``(query_len, seq_len)``: decodes, prefills, chunks over a cached prefix."""
    query_len = st.just(1) if decode_only else st.one_of(st.just(1), st.integers(1, max_query))
    one = st.tuples(query_len, st.integers(0, max_context)).map(lambda t: (t[0], t[0] + t[1]))
    return st.lists(one, min_size=1, max_size=max_seqs)


@settings(max_examples=examples(40))
@given(
    seqs=seq_shapes(),
    heads=gqa_heads(2),
    head_dim=st.sampled_from(SMALL_HEAD_DIMS),
    block_size=st.sampled_from(BLOCK_SIZES),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_mixed_batches(seqs, heads, head_dim, block_size, dtype, seed):
    """Prefills, chunked prefills over a cached prefix, and decodes, in one batch."""
    run_and_check(seqs, heads, head_dim, block_size, dtype, seed)


@settings(max_examples=examples(25))
@given(
    seqs=seq_shapes(max_seqs=4, max_context=700, decode_only=True),
    heads=gqa_heads(2),
    head_dim=st.sampled_from(SMALL_HEAD_DIMS),
    block_size=st.sampled_from(BLOCK_SIZES[1:]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_decode_batches(seqs, heads, head_dim, block_size, dtype, seed):
    """All-decode batches (flash-decoding), contexts across partition boundaries."""
    run_and_check(seqs, heads, head_dim, block_size, dtype, seed)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_large_head_dims(head_dim):
    """One small example per production head size, decode and mixed."""
    run_and_check([(1, 21), (1, 3)], (4, 2), head_dim, 16, torch.float32, seed=head_dim)
    run_and_check([(3, 19), (1, 9)], (4, 1), head_dim, 8, torch.bfloat16, seed=head_dim + 1)


def test_many_partitions_merge():
    """Flash-decoding with tiny partitions: many partials merged by log-sum-exp."""
    impl = backend.get("attention")
    if impl.__name__ != "minivllm.fast.attention":
        pytest.skip("implementation-specific: the Triton flash-decoding kernels")
    from minivllm.fast.attention_decode import paged_decode_attention

    seqs = [(1, 1100), (1, 5), (1, 129)]  # 18 partitions: the merge loops over chunks
    query, k_cache, v_cache, md, slots = make_batch(seqs, 4, 2, 16, 8, torch.float32, seed=7)
    query, k_cache, v_cache = query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE)
    out = torch.full_like(query, float("nan"))  # every row must be written
    paged_decode_attention(
        query, k_cache, v_cache, md.block_tables.to(DEVICE), md.seq_lens.to(DEVICE),
        md.query_start_loc.to(DEVICE), md.max_seq_len, 0.25, out, partition_size=64,
    )  # fmt: skip
    oracle = sdpa_oracle(query.cpu(), k_cache.cpu().nan_to_num(0.0), v_cache.cpu().nan_to_num(0.0),
                         seqs, slots, 0.25)  # fmt: skip
    assert_close(out.cpu(), oracle, torch.float32)


def test_rejects_bad_heads():
    impl = backend.get("attention")
    query, k_cache, v_cache, md, _ = make_batch([(2, 5)], 3, 2, 8, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        impl.paged_attention(query, k_cache, v_cache, md, 1.0)


def test_rejects_metadata_of_another_batch():
    """Metadata describes one step's batch; reusing it for another batch must fail loudly.

    Step 1 is a prefill of 5 tokens; step 2 decodes one token of the same
    sequence. Passing step 1's metadata with step 2's query would read the
    query rows against the wrong offsets and lengths.
    """
    impl = backend.get("attention")
    query, k_cache, v_cache, md_prefill, _ = make_batch([(5, 5)], 4, 2, 8, 4, torch.float32, 0)
    decode_query = query[:1].to(DEVICE)  # one row, as the next decode step would have
    with pytest.raises(ValueError, match="query_start_loc"):
        impl.paged_attention(decode_query, k_cache.to(DEVICE), v_cache.to(DEVICE),
                             md_prefill.to(DEVICE), 1.0)  # fmt: skip


# ----------------------------------------------------------------------------- vLLM's grids
# (num_query_heads, num_kv_heads) and (query_len, seq_len) sets from vLLM's kernel tests.
VLLM_HEADS = [(4, 4), (8, 2), (5, 1), (32, 8)]
VLLM_MIXED = [(1, 1328), (5, 18), (129, 463)]
VLLM_DECODE = [(1, 523), (1, 37), (1, 2011)]


@pytest.mark.parametrize("seqs", [VLLM_MIXED, VLLM_DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("heads", VLLM_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_vllm_grid_small_head_dim(heads, seqs):
    """vLLM's shapes with head_dim 16 (cheap enough for the interpreter)."""
    run_and_check(seqs, heads, 16, 16, torch.bfloat16, seed=sum(heads))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("seqs", [VLLM_MIXED, VLLM_DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("heads", VLLM_HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_vllm_grid_cuda(heads, seqs, head_dim, block_size, dtype):
    """The full grid on a GPU, compiled kernels on CUDA tensors."""
    run_and_check(seqs, heads, head_dim, block_size, dtype, seed=head_dim, device="cuda")
