"""The C++ attention op's GEMM-shaped prefill path (``csrc/attention_tile.h``) against float64.

Sequences with at least 8 query rows run as packed tiles (items of about 96
query vectors per KV head, keys in tiles of 64, a 4 x 24 or 4 x 48 register
block); the rest, and every sequence with ``gemm_prefill=False``, run the
per-query-vector row loop. Both paths are checked against the float64 oracle
of ``test_cpu_ops`` (softmax of the causally masked scores, written from the
formula, per head) on the sizes where a tiled kernel breaks: query counts just
under, at and over the tile and item sizes, key counts one short of and one
past a key tile, GQA groups that do not divide the item size (3, 5, 7), head
dims that are not a multiple of the register block (18, 36, 70, 100), block
size 1 and 16, chunks over a cached prefix, prefills mixed with decodes in one
batch, and bfloat16. Unused cache slots are NaN, so a read outside a sequence's
blocks (or of a stale tile row) shows.

Run: ``pytest -q tests/test_attention_tile.py``.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import assert_close
from test_cpu_ops import attention_oracle, paged_batch

from minivllm.fast import attention, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")


def check(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, gemm_prefill=True):
    query, k_cache, v_cache, md, slots = paged_batch(seqs, num_kv_heads, group, head_dim,
                                                     block_size, dtype, seed)  # fmt: skip
    scale = head_dim**-0.5
    out = attention.paged_attention_cpu(query, k_cache, v_cache, md, scale,
                                        gemm_prefill=gemm_prefill)  # fmt: skip
    assert out.shape == query.shape and out.dtype == dtype
    assert not out.isnan().any(), "a NaN-poisoned slot (or a stale tile row) was read"
    oracle = attention_oracle(query, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), seqs,
                              slots, scale)  # fmt: skip
    assert_close(out, oracle, dtype, scale=1.5)


@pytest.mark.parametrize("gemm_prefill", [True, False])
@pytest.mark.parametrize("group", [1, 3, 5, 8])
def test_prefill_across_items_and_key_tiles(group, gemm_prefill):
    """One prompt long enough for several items and key tiles, and one that ends a
    key past a 64-key tile; GQA groups that leave a partial item."""
    seqs = [(129, 129), (65, 65), (8, 8), (7, 7)]
    check(seqs, 2, group, 40, 16, torch.float32, seed=group, gemm_prefill=gemm_prefill)


@pytest.mark.parametrize("head_dim", [18, 36, 64, 70, 100])
def test_head_dims_off_the_register_block(head_dim):
    """head_dim pads V and O to a multiple of 4 rows; the padding must stay out."""
    check([(50, 50), (33, 97)], 1, 3, head_dim, 16, torch.float32, seed=head_dim)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_chunked_prefill_over_a_cached_prefix(block_size):
    """Chunks that start mid-sequence: the cached keys are all visible, the chunk's causal."""
    seqs = [(40, 103), (64, 64 + 63), (9, 200), (100, 101)]
    check(seqs, 3, 3, 64, block_size, torch.float32, seed=block_size)


def test_mixed_prefill_and_decode_batch():
    """Decodes (row loop) and prefills (tiles) in one call, sharing the thread split."""
    seqs = [(1, 300), (120, 120), (1, 1), (30, 77), (1, 65), (8, 64)]
    check(seqs, 3, 3, 64, 16, torch.float32, seed=11)


@pytest.mark.parametrize("gemm_prefill", [True, False])
def test_bfloat16(gemm_prefill):
    check([(97, 130), (1, 40), (64, 64)], 2, 4, 80, 16, torch.bfloat16, seed=7,
          gemm_prefill=gemm_prefill)  # fmt: skip


def test_small_magnitude_scores_and_one_hot_values():
    """Large scores (a sharp softmax) stress the running max: a wrong rescale shows."""
    seqs = [(70, 140)]
    query, k_cache, v_cache, md, slots = paged_batch(seqs, 1, 3, 24, 16, torch.float32, seed=2)
    query = query * 30  # scores of hundreds: exp overflows unless the max is subtracted
    scale = 24**-0.5
    out = attention.paged_attention_cpu(query, k_cache, v_cache, md, scale)
    oracle = attention_oracle(query, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), seqs,
                              slots, scale)  # fmt: skip
    assert_close(out, oracle, torch.float32, scale=4)
