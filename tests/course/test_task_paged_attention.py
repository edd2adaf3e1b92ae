"""Course task: paged attention, head by head, against softmax(q k^T * scale) v in float64.

GQA group sizes above 1 (query head h reads KV head h // group), a prefill
chunk over a cached prefix that ends mid-block, and decodes of different
lengths in one batch. The oracle loops over sequences and heads and reads
K/V slot by slot through the block table.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, assert_close

from minivllm import backend
from minivllm.metadata import AttentionMetadata


def _batch(seqs, num_heads, num_kv_heads, head_dim, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for _, seq_len in seqs:
        n = -(-seq_len // block_size)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))  # reversed blocks
        next_block += n
    width = max(len(t) for t in tables)
    k_cache = torch.randn(next_block + 1, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(next_block + 1, block_size, num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(q for q, _ in seqs), num_heads, head_dim, generator=g)
    md = AttentionMetadata.build(
        query_lens=[q for q, _ in seqs], seq_lens=[s for _, s in seqs],
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.full((query.shape[0],), -1, dtype=torch.int64))
    return query, k_cache, v_cache, md, tables


def _oracle(query, k_cache, v_cache, seqs, tables, scale):
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for (q_len, seq_len), table in zip(seqs, tables):
        for j in range(q_len):
            pos = seq_len - q_len + j  # this query row's absolute position
            for h in range(num_heads):
                kv = h // group
                keys = torch.stack([k_cache[table[p // block_size], p % block_size, kv]
                                    for p in range(pos + 1)]).double()
                values = torch.stack([v_cache[table[p // block_size], p % block_size, kv]
                                      for p in range(pos + 1)]).double()
                weights = torch.softmax(keys @ query[row, h].double() * scale, dim=0)
                out[row, h] = weights @ values
            row += 1
    return out


@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (6, 3)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_gqa_chunk_over_a_cached_prefix_and_decodes(heads):
    # (query_len, seq_len): a chunk of 5 after 14 cached tokens (block_size 4: it starts and
    # ends mid-block), a fresh prefill of 3, decodes at lengths 1, 9 and 17.
    seqs = [(5, 19), (1, 9), (3, 3), (1, 1), (1, 17)]
    query, k_cache, v_cache, md, tables = _batch(seqs, *heads, 8, 4, seed=sum(heads))
    scale = 8**-0.5
    out = backend.get("attention").paged_attention(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md.to(DEVICE), scale).cpu()
    want = _oracle(query, k_cache, v_cache, seqs, tables, scale)
    row = 0
    for i, (q_len, seq_len) in enumerate(seqs):
        for j in range(q_len):
            for h in range(heads[0]):
                torch.testing.assert_close(
                    out[row, h].double(), want[row, h], rtol=1e-4, atol=1e-4,
                    msg=lambda m, i=i, j=j, h=h, s=seq_len: (
                        f"sequence {i} (seq_len {s}), query row {j}, head {h} "
                        f"(reads KV head {h // (heads[0] // heads[1])}): {m}"))
            row += 1
    assert_close(out, want, torch.float32)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    """Random mixes of decodes, fresh prefills and chunks over cached prefixes."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 4])
    head_dim, block_size = pick([8, 24, 40]), pick([1, 3, 8, 16])
    seqs = []
    for _ in range(pick([1, 2, 4, 5])):
        q_len = pick([1, 1, 2, 7, 13])
        seqs.append((q_len, q_len + pick([0, 1, block_size - 1, block_size, 21])))
    heads = (num_kv_heads * group, num_kv_heads)
    query, k_cache, v_cache, md, tables = _batch(seqs, *heads, head_dim, block_size, seed)
    scale = head_dim**-0.5
    out = backend.get("attention").paged_attention(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md.to(DEVICE), scale).cpu()
    want = _oracle(query, k_cache, v_cache, seqs, tables, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4, msg=lambda m: (
        f"seqs (query_len, seq_len) = {seqs}, heads {heads}, block_size {block_size}: {m}"))


@pytest.mark.parametrize("magnitude", [30.0, 300.0])
def test_large_logits_do_not_overflow(magnitude):
    """Scores of several hundred: exp() overflows float32 (past 88.7) unless the row's max
    is subtracted first, and the result must still be softmax(q k^T * scale) v."""
    seqs = [(3, 11), (1, 6), (4, 4)]
    query, k_cache, v_cache, md, tables = _batch(seqs, 4, 2, 16, 4, seed=int(magnitude))
    query = query * magnitude / 4  # scores ~ magnitude * |k| * scale: hundreds to thousands
    scale = 16**-0.5
    out = backend.get("attention").paged_attention(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md.to(DEVICE), scale).cpu()
    want = _oracle(query, k_cache, v_cache, seqs, tables, scale)
    assert torch.isfinite(out).all(), (
        f"scores up to {magnitude:g}x larger than usual give inf/NaN: is the row max "
        f"subtracted before exp()?")
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-3)
