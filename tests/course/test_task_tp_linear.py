"""Course task: tensor-parallel layers where the shards meet: tp above the KV head count,
vocabulary ids on rank boundaries, the row-parallel bias. The oracle is the dense layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm import backend

linear = backend.get("linear")
pytestmark = pytest.mark.skipif(
    not getattr(linear, "SIMULATES_ALL_RANKS", False),
    reason="rank-by-rank checks of a real multi-process twin live in tests/test_linear.py")


@pytest.mark.parametrize("tp,num_kv_heads", [(4, 2), (8, 2), (6, 3)])
def test_qkv_with_more_ranks_than_kv_heads(tp, num_kv_heads):
    head, hidden, num_heads = 3, 10, 2 * tp
    g = torch.Generator().manual_seed(tp)
    w = [torch.randn(n * head, hidden, generator=g) for n in (num_heads, num_kv_heads, num_kv_heads)]
    layer = linear.QKVParallelLinear(hidden, head, num_heads, num_kv_heads, tp_size=tp)
    for shard_id, piece in zip("qkv", w):
        layer.weight.weight_loader(layer.weight, piece, shard_id)
    x = torch.randn(5, hidden, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(w)), msg=lambda m: (
        f"tp={tp}, {num_kv_heads} KV heads (each on {tp // num_kv_heads} ranks): {m}"))


def test_vocab_ids_on_rank_boundaries():
    vocab, dim, tp = 10, 4, 4  # 3 rows per rank, 2 padding rows on the last
    w = torch.randn(vocab, dim)
    embed = linear.VocabParallelEmbedding(vocab, dim, tp_size=tp)
    embed.weight.weight_loader(embed.weight, w)
    ids = torch.arange(vocab)
    got = embed(ids)
    for i in range(vocab):
        assert torch.allclose(got[i], w[i]), f"token {i} (rank {i // 3}) embeds wrongly"


def test_row_parallel_bias_added_once():
    layer = linear.RowParallelLinear(8, 3, bias=True, tp_size=4)
    w, b = torch.randn(3, 8), torch.randn(3)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), F.linear(x, w, b),
                               msg=lambda m: f"bias must be added once, after the all-reduce: {m}")
