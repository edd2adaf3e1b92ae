"""Linear layers with vLLM's tensor-parallel names (tp_size=1 for now).

PLACEHOLDER: only ``tp_size=1`` is implemented; tensor parallelism (issue 5)
replaces this file. The public API below is the contract the model uses:

- every layer takes ``tp_size`` (default 1);
- every parameter has a ``weight_loader(param, loaded_weight[, shard_id])``
  that copies a checkpoint tensor (or one shard of a fused one) into it;
- ``QKVParallelLinear.num_heads`` / ``.num_kv_heads`` are the head counts the
  caller sees after the layer (per rank when the layer is really sharded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_tp(tp_size: int) -> None:
    if tp_size != 1:
        raise ValueError(f"tp_size must be 1 until tensor parallelism lands, got {tp_size}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into ``param`` (shapes must match)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape {tuple(loaded_weight.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """``y = x W^T + b`` with a weight loader attached to each parameter."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_size: int) -> None:
        super().__init__()
        _check_tp(tp_size)
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, tp_size: int = 1) -> None:
        super().__init__(input_size, output_size, bias, tp_size)
        self.gather_output = gather_output


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, tp_size: int = 1) -> None:
        super().__init__(input_size, output_size, bias, tp_size)
        self.input_is_parallel = input_is_parallel


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_size=tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded_weight)
        start = sum(self.output_sizes[:shard_id])
        param.data[start : start + self.output_sizes[shard_id]].copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused in one matmul."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_size: int = 1) -> None:
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = total_num_heads, total_num_kv_heads
        out = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, out, bias, tp_size=tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded_weight)
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data[start : start + size].copy_(loaded_weight)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1) -> None:
        super().__init__()
        _check_tp(tp_size)
        self.num_embeddings, self.embedding_dim, self.tp_size = num_embeddings, embedding_dim, tp_size
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits; may share the embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size=tp_size)
        if bias:
            raise ValueError("ParallelLMHead: bias is not supported")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, vocab)
        return F.linear(hidden, self.weight)
