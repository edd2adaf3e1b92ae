"""Tensor-parallel linear layers, simulated: every rank's shard in one process.

Tensor parallelism (Megatron-LM, as vLLM does it) splits each weight matrix
across ``tp_size`` GPUs ("ranks") so that each holds ``1/tp_size`` of it:

- :class:`ColumnParallelLinear` splits the *output* features: rank ``r``
  holds rows ``r*n/tp : (r+1)*n/tp`` of ``W`` (shape ``(out, in)``) and
  computes those output columns from the full input. No communication,
  unless the full output is wanted on every rank (an *all-gather*).
- :class:`RowParallelLinear` splits the *input* features: rank ``r`` holds
  columns ``r*k/tp : (r+1)*k/tp`` of ``W`` and multiplies them with its own
  slice of the input, which is exactly what the column-parallel layer before
  it produced. Each rank gets a partial sum of the full output; an
  *all-reduce* (sum over ranks) completes it.

A transformer block pairs them: ``qkv_proj`` (column) -> attention on this
rank's heads -> ``o_proj`` (row, all-reduce); ``gate_up_proj`` (column) ->
SiLU-and-mul -> ``down_proj`` (row, all-reduce). Two all-reduces per layer,
nothing else. The vocabulary of the embedding and of the LM head is split the
same way (:class:`VocabParallelEmbedding`, :class:`ParallelLMHead`), padded up
to a multiple of ``tp_size`` (the padding rows are zero, their logits cut off).

This module *simulates* all ranks in one process so that a reader can see
what each one holds and what each collective does: every parameter holds all
ranks' shards, stacked (``weight[r]`` is what rank ``r`` would hold);
``forward`` loops over the ranks with plain torch, and the collectives are
written out (an all-reduce is a sum over the per-rank results, a gather a
concatenation). Each parameter's ``weight_loader(param, full_tensor[,
shard_id])`` cuts every rank's shard out of the full checkpoint tensor.
Uneven splits are refused with a ``ValueError`` listing the sizes that work.

**Contract: different from the fast twin's, under the same names.** Here a
layer's output is always the *dense* (``tp_size=1``) output, and
``QKVParallelLinear.num_heads`` / ``.num_kv_heads`` are the model's totals
(``gather_output`` changes nothing); :mod:`minivllm.fast.linear` runs one
process per rank and returns *this rank's shard* and per-rank head counts.
At ``tp_size=1`` the two are the same layer. The model reads the head counts
from the layer, so it works with either; the executor learns which it has
from ``SIMULATES_ALL_RANKS``. ``tests/test_linear.py::test_twins_contracts``
checks both halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.ref.quantization import apply_linear
from minivllm.tp_shards import (
    check_qkv_split,
    check_shape,
    check_tp_size,
    default_weight_loader,
    divide,
    divisors,
    kv_head_partition,
    qkv_tp_sizes,
    vocab_partition,
)

__all__ = [
    "linear", "ColumnParallelLinear", "MergedColumnParallelLinear",
    "QKVParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
    "check_tp_size", "default_weight_loader", "divide", "divisors", "kv_head_partition",
    "qkv_tp_sizes", "vocab_partition",
]

#: True: this module computes every rank in one process (no worker processes
#: are needed for ``tp_size > 1``). The fast twin sets it to False.
SIMULATES_ALL_RANKS = True


# --------------------------------------------------------------------------
# Column-parallel layers: split the output features
# --------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           portable: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, ``(..., K) -> (..., N)``: the textbook matmul.

    The fast twin runs a C++ GEMV here for decode-shaped inputs on a CPU, and a
    GEMM on a prepacked copy of the weight for more rows; ``portable`` and
    ``packed`` select those and mean nothing here.
    A quantized weight multiplies through its quantization component.
    """
    if not isinstance(weight, torch.Tensor):
        return apply_linear(x, weight, bias)
    y = x @ weight.T  # (..., N)
    return y if bias is None else y + bias


class _Loaded:
    """The loader's hook once every weight is loaded (the fast twin repacks there)."""

    def process_weights_after_loading(self, *, prepack: bool = True) -> None:
        """Nothing to do: the textbook layer multiplies by its weight as loaded."""


class ColumnParallelLinear(_Loaded, nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows split across ranks.

    Args:
        input_size: in features (every rank sees the whole input).
        output_size: out features, split into ``tp_size`` equal slices.
        bias: add a (split) bias.
        gather_output: all-gather the output on every rank (no effect in the
            simulation: its output is always in dense order).
        tp_size: number of ranks.

    Shapes: ``weight (tp_size, output_size / tp_size, input_size)``,
    ``bias (tp_size, output_size / tp_size)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        check_tp_size(tp_size)
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.gather_output = gather_output
        # The pieces of one rank's output, in order. Plain column-parallel has
        # one; the merged gate/up and qkv layers have several, and the gather
        # must interleave them back into dense order.
        self.output_partition_sizes = self._partition_sizes()
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.weight = nn.Parameter(
            torch.empty(tp_size, self.output_size_per_partition, input_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(
                torch.empty(tp_size, self.output_size_per_partition), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> list[int]:
        return [divide(self.output_size, self.tp_size, "output_size")]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy rank ``r``'s rows of the full ``(output_size[, input_size])`` tensor into ``param[r]``."""
        # BEGIN SOLUTION
        check_shape(loaded_weight, (self.output_size, *param.shape[2:]), type(self).__name__)
        shard = self.output_size_per_partition
        for rank in range(self.tp_size):
            param.data[rank].copy_(loaded_weight[rank * shard : (rank + 1) * shard])
        # END SOLUTION

    def _per_rank_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What each rank computes from the (replicated) input: ``(..., out / tp)`` each."""
        # BEGIN SOLUTION
        outputs = []
        for rank in range(self.tp_size):
            bias = None if self.bias is None else self.bias[rank]
            outputs.append(apply_linear(x, self.weight[rank], bias))
        return outputs
        # END SOLUTION

    def _gather(self, outputs: list[torch.Tensor], keep: list[list[int]]) -> torch.Tensor:
        """The all-gather: put the per-rank pieces back in dense order.

        ``keep[i]`` lists the ranks whose copy of piece ``i`` goes into the
        result (all of them, except for replicated KV heads, where one copy of
        each head is enough).
        """
        # BEGIN SOLUTION
        pieces = []
        start = 0
        for i, size in enumerate(self.output_partition_sizes):
            pieces += [outputs[rank][..., start : start + size] for rank in keep[i]]
            start += size
        return torch.cat(pieces, dim=-1)
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        outputs = self._per_rank_outputs(x)  # tp x (T, out / tp)
        all_ranks = list(range(self.tp_size))
        return self._gather(outputs, [all_ranks] * len(self.output_partition_sizes))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused into one matmul (``gate_proj`` and ``up_proj``).

    Each rank holds its slice of *every* sub-layer, ``[gate_r; up_r]``, so that
    the activation (SiLU(gate) * up) can run locally on each rank.
    ``weight_loader(param, w, shard_id)`` loads sub-layer ``shard_id`` (0, 1, ...)
    from its full checkpoint tensor; with ``shard_id=None`` ``w`` is the whole
    fused tensor.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size=tp_size)

    def _partition_sizes(self) -> list[int]:
        return [divide(n, self.tp_size, f"output_sizes[{i}]") for i, n in enumerate(self.output_sizes)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy sub-layer ``shard_id``'s rank slices (from its full tensor) into every rank."""
        if shard_id is None:  # the whole fused tensor: load each sub-layer in turn
            for i, piece in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, piece, i)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[2:]),
                     f"MergedColumnParallelLinear shard {shard_id}")
        size = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])  # where it sits on each rank
        for rank in range(self.tp_size):
            param.data[rank, offset : offset + size].copy_(
                loaded_weight[rank * size : (rank + 1) * size]
            )


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused into one column-parallel matmul.

    Attention heads are independent, so each rank takes ``num_heads / tp``
    query heads and the KV heads they read. With grouped-query attention there
    may be fewer KV heads than ranks; then each KV head is *replicated* on
    ``tp / num_kv_heads`` ranks (rank ``r`` holds KV head
    ``r // replicas``), which keeps every query head next to its KV head.

    ``num_heads`` / ``num_kv_heads``: the head counts of this layer's output,
    which in the simulation is the dense layout, so the totals.
    ``weight_loader(param, w, shard_id)`` with ``shard_id`` in ``"q"``, ``"k"``,
    ``"v"`` takes the full ``q_proj`` / ``k_proj`` / ``v_proj`` tensor.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_size: int = 1) -> None:
        check_qkv_split(total_num_heads, total_num_kv_heads, tp_size)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads_per_rank = total_num_heads // tp_size
        self.num_kv_heads_per_rank, self.num_kv_head_replicas = kv_head_partition(
            total_num_kv_heads, tp_size
        )
        # The caller sees the dense layout, so the totals (see the class docstring).
        self.num_heads, self.num_kv_heads = total_num_heads, total_num_kv_heads
        out = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, out, bias, tp_size=tp_size)

    def _partition_sizes(self) -> list[int]:
        q = self.num_heads_per_rank * self.head_size
        kv = self.num_kv_heads_per_rank * self.head_size
        return [q, kv, kv]

    def _rows_for_rank(self, shard_id: str, rank: int) -> tuple[int, int]:
        """(first row in the full q/k/v tensor, rows) that rank ``rank`` holds."""
        # BEGIN SOLUTION
        if shard_id == "q":
            heads = self.num_heads_per_rank
            return rank * heads * self.head_size, heads * self.head_size
        heads = self.num_kv_heads_per_rank
        first_head = (rank // self.num_kv_head_replicas) * heads
        return first_head * self.head_size, heads * self.head_size
        # END SOLUTION

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str | None = None) -> None:
        """Copy each rank's heads of the full ``q``/``k``/``v`` tensor into ``param[rank]``."""
        q_rows = self.total_num_heads * self.head_size
        kv_rows = self.total_num_kv_heads * self.head_size
        if shard_id is None:  # the whole fused tensor, dense order [q; k; v]
            for sid, piece in zip("qkv", loaded_weight.split([q_rows, kv_rows, kv_rows], dim=0)):
                self.weight_loader(param, piece, sid)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        full_rows = q_rows if shard_id == "q" else kv_rows
        check_shape(loaded_weight, (full_rows, *param.shape[2:]), f"QKVParallelLinear {shard_id}")
        q, kv, _ = self.output_partition_sizes
        offset = {"q": 0, "k": q, "v": q + kv}[shard_id]  # where it sits on each rank
        for rank in range(self.tp_size):
            start, rows = self._rows_for_rank(shard_id, rank)
            param.data[rank, offset : offset + rows].copy_(loaded_weight[start : start + rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, (H + 2 H_kv) D)
        # BEGIN SOLUTION
        outputs = self._per_rank_outputs(x)  # tp x (T, (H + 2 H_kv) D / tp)
        all_ranks = list(range(self.tp_size))
        # A replicated KV head is computed by several ranks; keep one copy.
        kv_owners = all_ranks[:: self.num_kv_head_replicas]
        return self._gather(outputs, [all_ranks, kv_owners, kv_owners])
        # END SOLUTION


# --------------------------------------------------------------------------
# Row-parallel layer: split the input features, all-reduce the output
# --------------------------------------------------------------------------


class RowParallelLinear(_Loaded, nn.Module):
    """``y = x W^T + b`` with ``W``'s input columns split across ranks.

    Rank ``r`` multiplies its slice of the input features by its slice of
    ``W``'s columns, giving a partial sum of the whole output; the all-reduce
    adds the partial sums. The bias is added once, after the all-reduce.

    Args:
        input_size: in features, split into ``tp_size`` equal slices.
        output_size: out features (every rank gets the whole output).
        bias: add a (replicated) bias.
        input_is_parallel: the input arrives already split (the output of a
            column-parallel layer); False means each rank cuts its slice out
            of a full input. The simulation always receives the dense input.
        tp_size: number of ranks.

    Shapes: ``weight (tp_size, output_size, input_size / tp_size)``,
    ``bias (output_size,)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, tp_size: int = 1) -> None:
        super().__init__()
        check_tp_size(tp_size)
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, tp_size, "input_size")
        self.weight = nn.Parameter(
            torch.empty(tp_size, output_size, self.input_size_per_partition), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight: copy rank ``r``'s input columns into ``param[r]``; bias: copy it whole."""
        if param.dim() == 1:  # the bias is not split
            check_shape(loaded_weight, (self.output_size,), "RowParallelLinear bias")
            param.data.copy_(loaded_weight)
            return
        check_shape(loaded_weight, (self.output_size, self.input_size), "RowParallelLinear")
        shard = self.input_size_per_partition
        for rank in range(self.tp_size):
            param.data[rank].copy_(loaded_weight[:, rank * shard : (rank + 1) * shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        # What each rank receives: its slice of the input features.
        # BEGIN SOLUTION
        x_shards = x.split(self.input_size_per_partition, dim=-1)  # tp x (T, in / tp)
        partial_sums = [apply_linear(x_shards[r], self.weight[r]) for r in range(self.tp_size)]
        y = torch.stack(partial_sums).sum(dim=0)  # the all-reduce: (T, out)
        if self.bias is not None:
            y = y + self.bias  # once, after the reduce (not tp times)
        return y
        # END SOLUTION


# --------------------------------------------------------------------------
# Vocabulary-parallel embedding and LM head
# --------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks.

    Rank ``r`` holds rows ``[r * V_r, (r + 1) * V_r)`` of the (padded) table,
    ``V_r = ceil(vocab / tp_size)``. Each rank looks up the ids that fall in
    its range and writes zeros for the others; the all-reduce (a sum) then
    leaves every token with exactly its one real embedding row.

    Shapes: ``weight (tp_size, V_r, embedding_dim)``; rows past ``vocab`` are
    zero padding.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp_size = num_embeddings, embedding_dim, tp_size
        self.num_embeddings_per_partition, self.num_embeddings_padded = vocab_partition(
            num_embeddings, tp_size
        )
        self.weight = nn.Parameter(
            torch.zeros(tp_size, self.num_embeddings_per_partition, embedding_dim),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy the full ``(vocab, dim)`` table into the per-rank row ranges (padding stays zero)."""
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        padded = torch.zeros(self.num_embeddings_padded, self.embedding_dim, dtype=param.dtype)
        padded[: self.num_embeddings] = loaded_weight
        param.data.copy_(padded.view_as(param))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        # BEGIN SOLUTION
        rows = self.num_embeddings_per_partition
        partial_sums = []
        for rank in range(self.tp_size):
            start = rank * rows
            mine = (input_ids >= start) & (input_ids < start + rows)  # (T,) ids this rank owns
            local_ids = torch.where(mine, input_ids - start, 0)  # others read row 0 ...
            e = F.embedding(local_ids, self.weight[rank])  # (T, dim)
            partial_sums.append(e * mine.unsqueeze(-1).to(e.dtype))  # ... and are zeroed
        return torch.stack(partial_sums).sum(dim=0)  # the all-reduce
        # END SOLUTION


class ParallelLMHead(_Loaded, VocabParallelEmbedding):
    """The projection from hidden states to vocabulary logits, vocabulary split across ranks.

    Each rank computes the logits of its own vocabulary slice; an *all-gather*
    concatenates them on every rank (each rank of the last stage then samples
    alike, as vLLM v1's do) and the padding columns are cut off. Its weight has the embedding's layout, so tying the two
    (``lm_head.weight = embed_tokens.weight``) works for every ``tp_size``.
    A quantized LM head (``quantization=``) multiplies through :func:`linear`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size=tp_size)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(tp_size, self.num_embeddings_per_partition), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy the full ``(vocab, dim)`` weight or ``(vocab,)`` bias into the rank slices."""
        if param.dim() == 2:  # the bias
            check_shape(loaded_weight, (self.num_embeddings,), "ParallelLMHead bias")
            padded = torch.zeros(self.num_embeddings_padded, dtype=param.dtype)
            padded[: self.num_embeddings] = loaded_weight
            param.data.copy_(padded.view_as(param))
            return
        super().weight_loader(param, loaded_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, dim) -> (T, vocab)
        """Full logits (on every rank: the fast twin all-gathers them)."""
        # BEGIN SOLUTION
        logits = []
        for rank in range(self.tp_size):
            bias = None if self.bias is None else self.bias[rank]
            logits.append(linear(hidden, self.weight[rank], bias))  # (T, V_r)
        full = torch.cat(logits, dim=-1)  # the all-gather: (T, V_padded)
        return full[..., : self.num_embeddings]  # drop the padding columns
        # END SOLUTION
