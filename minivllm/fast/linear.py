"""Tensor-parallel linear layers, for real: one process per rank.

**Contract: different from the ref twin's, under the same names.** Here a
layer's output is *this rank's shard* (column-parallel layers, the QKV
projection), and ``QKVParallelLinear.num_heads`` / ``.num_kv_heads`` count
this rank's heads; :mod:`minivllm.ref.linear` returns the dense output and
the totals, because it computes every rank in one process. At ``tp_size=1``
the two are the same layer. ``SIMULATES_ALL_RANKS = False`` tells the
executor to start one process per rank.
``tests/test_linear.py::test_twins_contracts`` checks both halves.

The same layers as :mod:`minivllm.ref.linear` (read that first: it explains
column- and row-parallel splitting and shows every rank side by side). Here
each process holds only *its own* rank's shard, ``1/tp_size`` of the memory,
and the collectives are real ``torch.distributed`` calls (gloo on CPU, NCCL
on CUDA) through :mod:`minivllm.distributed`:

- :class:`ColumnParallelLinear`, :class:`MergedColumnParallelLinear`,
  :class:`QKVParallelLinear`: no communication; each rank's output is its own
  slice (``QKVParallelLinear.num_heads`` / ``.num_kv_heads`` are per rank).
  ``gather_output=True`` adds an all-gather.
- :class:`RowParallelLinear`: one all-reduce of the ``(T, out)`` partial
  sums, then the bias.
- :class:`VocabParallelEmbedding`: a local lookup of the ids this rank owns
  (zeros for the rest), then one all-reduce.
- :class:`ParallelLMHead`: local logits for this rank's vocabulary slice,
  gathered to rank 0 only (the sampler runs there): ``forward`` returns the
  full ``(T, vocab)`` logits on rank 0 and ``None`` elsewhere.

Why it is faster: each rank reads ``1/tp_size`` of the weights per token, and
decode is bound by weight reads, so with fast links the step time drops
nearly ``tp_size``-fold (the all-reduces are ``2 * num_layers`` small
messages of ``T * hidden`` elements). With ``tp_size=1`` no process group is
needed and every layer is a plain matmul / ``F.embedding``.

The matmul itself is :func:`linear`: ``F.linear`` (oneDNN/MKL on a CPU,
cuBLAS on CUDA), except for decode-shaped inputs on a CPU. With at most
:data:`GEMV_MAX_ROWS` token rows and bf16 or float32 weights, the C++ op
``torch.ops.minivllm.linear_small_m`` (``csrc/gemv.cpp``) reads each weight row once at memory bandwidth and does
all the rows' arithmetic while it sits in L1: AVX-512 BF16 dot products where
the CPU has them, float32 FMAs elsewhere. A GEMM library tiles for a reuse
that a few rows do not have: MKL's sgemm packs the whole float32 weight first,
so 2 or 4 rows (a speculative-decoding verification) cost 2-3x one row, and
for a single row MKL's sgemv reached only about 40% of two cores' read
bandwidth (``docs/kernels.md`` has the numbers). The fused QKV and gate/up
weights stay fused: one call streams the whole matrix.

A layer learns its rank from :func:`minivllm.distributed.get_tp_rank` when it
is built, so build it after :func:`minivllm.distributed.init_distributed`
(before it, the process builds rank 0's shards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import distributed
from minivllm.fast.linear_kernel import FLOAT_GEMV_MAX_ROWS
from minivllm.fast.linear_prepack import (  # noqa: F401  (prepack_weight, packed_rows: API)
    PACKED_CHUNK_ROWS,
    Prepacked,
    packed_rows,
    prepack_weight,
    prepacked_linear,
)
from minivllm.quantized_weight import QuantizedWeight
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

#: False: one process per rank (see :func:`minivllm.executor.abstract.simulates_all_ranks`).
SIMULATES_ALL_RANKS = False


#: Token rows up to which a linear on a CPU runs the C++ GEMV (above: oneDNN/MKL); the
#: dispatch rule's number (:mod:`minivllm.fast.linear_kernel`).
GEMV_MAX_ROWS = FLOAT_GEMV_MAX_ROWS


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True if ``linear(x, weight)`` should run the C++ small-M kernel.

    The weight's kernel is :func:`minivllm.fast.linear_kernel.projection_kernel`'s
    (the rule the C++ layer stack follows too: bf16 or float32, 2-D,
    contiguous, on a CPU), for 1 to its ``max_rows`` (:data:`GEMV_MAX_ROWS`) rows.
    """
    from minivllm.fast.linear_kernel import projection_kernel

    if x.dtype not in (torch.bfloat16, torch.float32) or torch.compiler.is_compiling():
        return False
    kernel = projection_kernel(weight)
    if isinstance(kernel, str) or x.shape[-1] != weight.shape[1]:
        return False
    rows = x.numel() // max(1, weight.shape[1])
    return 1 <= rows <= kernel.max_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           portable: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, ``(..., K) -> (..., N)``: ``F.linear``, or the GEMV for few rows.

    On a CPU with few rows (see :func:`_gemv_applies`: bf16 or float32 weights,
    at most :data:`GEMV_MAX_ROWS` rows) it calls
    ``torch.ops.minivllm.linear_small_m`` (float32 accumulation; the output has
    ``x``'s dtype, which may be float32 or bfloat16). ``portable=True`` forces
    that op's float32-FMA path even where AVX-512 BF16 is there (for tests).
    ``packed`` is :func:`prepack_weight`'s copy of ``weight``: more rows than the GEMV
    takes then run :func:`prepacked_linear` on it (float32 with AVX-512: the C++ panel
    GEMM up to :data:`~minivllm.fast.linear_prepack.PANEL_MAX_ROWS` rows; else oneDNN's
    GEMM in chunks of at most :data:`PACKED_CHUNK_ROWS` rows, rounded up to
    :func:`packed_rows`).
    A :class:`~minivllm.ref.quantization.QuantizedWeight` multiplies through the
    quantization component it was made with.
    """
    if isinstance(weight, QuantizedWeight):
        from minivllm.fast.quantization import apply_linear

        return apply_linear(x, weight, bias)
    if not _gemv_applies(x, weight):
        if packed is not None and x.dtype == weight.dtype and not torch.compiler.is_compiling():
            return prepacked_linear(x, weight, packed, bias)
        return F.linear(x, weight, bias)
    from minivllm.fast import cpu_ops

    rows = x.reshape(-1, x.shape[-1])  # (M, K); a view where x's rows allow it
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)  # (M, N)
    cpu_ops.ops().linear_small_m(out, rows, weight,
                                 None if bias is None else bias.contiguous(), portable)
    return out.view(*x.shape[:-1], weight.shape[0])


def _this_rank(tp_size: int) -> int:
    """This process's rank for a layer built for ``tp_size`` ranks."""
    check_tp_size(tp_size)
    if tp_size == 1:
        return 0
    if distributed.is_initialized() and distributed.get_tp_size() != tp_size:
        raise ValueError(
            f"tp_size={tp_size} but this process joined a group of {distributed.get_tp_size()}"
        )
    return distributed.get_tp_rank()


class ColumnParallelLinear(Prepacked, nn.Module):
    """``y = x W^T + b``; this rank holds ``output_size / tp_size`` rows of ``W``.

    Shapes: ``weight (output_size / tp_size, input_size)``, ``bias (output_size / tp_size,)``.
    ``forward``: ``(T, input_size) -> (T, output_size / tp_size)``, or
    ``(T, output_size)`` with ``gather_output=True``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.tp_rank = _this_rank(tp_size)
        self.gather_output = gather_output
        self.output_partition_sizes = self._partition_sizes()
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> list[int]:
        return [divide(self.output_size, self.tp_size, "output_size")]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``(output_size[, input_size])`` tensor."""
        check_shape(loaded_weight, (self.output_size, *param.shape[1:]), type(self).__name__)
        shard = self.output_size_per_partition
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out / tp)
        y = linear(x, self.weight, self.bias, packed=self.packed_weight)
        if self.gather_output:
            y = distributed.tensor_model_parallel_all_gather(y, dim=-1)  # (T, out)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate/up fused: this rank holds ``[gate_r; up_r]``, its slice of each sub-layer."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size=tp_size)

    def _partition_sizes(self) -> list[int]:
        return [divide(n, self.tp_size, f"output_sizes[{i}]") for i, n in enumerate(self.output_sizes)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy this rank's slice of sub-layer ``shard_id`` (its full tensor) into place."""
        if shard_id is None:  # the whole fused tensor
            for i, piece in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, piece, i)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]),
                     f"MergedColumnParallelLinear shard {shard_id}")
        size = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])
        param.data[offset : offset + size].copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q/k/v fused; this rank holds its query heads and the KV heads they read.

    ``num_heads`` / ``num_kv_heads`` are this rank's counts. With fewer KV
    heads than ranks each KV head is replicated on ``tp_size / num_kv_heads``
    ranks (this rank holds KV head ``tp_rank // replicas``).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp_size: int = 1) -> None:
        check_qkv_split(total_num_heads, total_num_kv_heads, tp_size)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads, self.num_kv_head_replicas = kv_head_partition(
            total_num_kv_heads, tp_size
        )
        out = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, out, bias, tp_size=tp_size)

    def _partition_sizes(self) -> list[int]:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return [q, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str | None = None) -> None:
        """Copy this rank's heads of the full ``q``/``k``/``v`` tensor into place."""
        q_rows = self.total_num_heads * self.head_size
        kv_rows = self.total_num_kv_heads * self.head_size
        if shard_id is None:  # the whole fused tensor, dense order [q; k; v]
            for sid, piece in zip("qkv", loaded_weight.split([q_rows, kv_rows, kv_rows], dim=0)):
                self.weight_loader(param, piece, sid)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded_weight, (q_rows if shard_id == "q" else kv_rows, *param.shape[1:]),
                     f"QKVParallelLinear {shard_id}")
        q, kv, _ = self.output_partition_sizes
        if shard_id == "q":
            offset, first_head, rows = 0, self.tp_rank * self.num_heads, q
        else:
            offset = q if shard_id == "k" else q + kv
            first_head = (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads
            rows = kv
        start = first_head * self.head_size
        param.data[offset : offset + rows].copy_(loaded_weight.narrow(0, start, rows))


class RowParallelLinear(Prepacked, nn.Module):
    """``y = all_reduce(x_r W_r^T) + b``; this rank holds ``input_size / tp_size`` columns.

    Shapes: ``weight (output_size, input_size / tp_size)``, ``bias (output_size,)``
    (replicated, added once after the all-reduce). ``forward``: ``(T, input_size
    / tp_size)`` (``input_is_parallel=True``) or ``(T, input_size)`` ->
    ``(T, output_size)``, the same on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, tp_size: int = 1) -> None:
        super().__init__()
        self.input_size, self.output_size, self.tp_size = input_size, output_size, tp_size
        self.tp_rank = _this_rank(tp_size)
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, tp_size, "input_size")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight: copy this rank's input columns; bias: copy it whole."""
        if param.dim() == 1:
            check_shape(loaded_weight, (self.output_size,), "RowParallelLinear bias")
            param.data.copy_(loaded_weight)
            return
        check_shape(loaded_weight, (self.output_size, self.input_size), "RowParallelLinear")
        shard = self.input_size_per_partition
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / tp) -> (T, out)
        return self._reduce(self._partial_sum(x)[0])

    # The forward's two halves: a LoRA delta joins the partial sum between them
    # (minivllm.lora.layers.ProjectionLoRA, with its rank's columns of A).
    def _partial_sum(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_r W_r^T, x_r)``: this rank's partial sum (T, out) and its input shard."""
        if not self.input_is_parallel:  # a full input: take this rank's features
            shard = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * shard, shard)
        return linear(x, self.weight, packed=self.packed_weight), x

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The partial sums of every rank added up, then the bias (once)."""
        y = distributed.tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding; this rank holds rows ``[rank * V_r, (rank + 1) * V_r)``.

    ``V_r = ceil(vocab / tp_size)`` (the vocabulary is padded to a multiple of
    ``tp_size``; padding rows are zero). Shape: ``weight (V_r, embedding_dim)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp_size = num_embeddings, embedding_dim, tp_size
        self.tp_rank = _this_rank(tp_size)
        self.num_embeddings_per_partition, self.num_embeddings_padded = vocab_partition(
            num_embeddings, tp_size
        )
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def _load_rows(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full (vocab, ...) tensor; zero the padding."""
        start = self.vocab_start_index
        n = max(0, min(self.num_embeddings - start, self.num_embeddings_per_partition))
        param.data.zero_()
        param.data[:n].copy_(loaded_weight[start : start + n])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``(vocab, dim)`` table (padding stays zero)."""
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        self._load_rows(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, dim)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start = self.vocab_start_index
        mine = (input_ids >= start) & (input_ids < start + self.num_embeddings_per_partition)
        local_ids = torch.where(mine, input_ids - start, 0)  # (T,)
        e = F.embedding(local_ids, self.weight)  # (T, dim)
        e.masked_fill_(~mine.unsqueeze(-1), 0)  # ids another rank owns
        return distributed.tensor_model_parallel_all_reduce(e)


class ParallelLMHead(Prepacked, VocabParallelEmbedding):
    """Vocabulary logits; this rank computes its ``V_r`` columns, all-gathered.

    ``forward``: ``(T, dim) -> (T, vocab)`` on every rank (padding cut off), as
    vLLM v1 gathers them: every rank of the last stage samples alike, so a
    draft model's forward runs on all of them together. Tying
    ``lm_head.weight = embed_tokens.weight`` works: both hold the same rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size=tp_size)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``(vocab, dim)`` weight or ``(vocab,)`` bias."""
        if param.dim() == 1:
            check_shape(loaded_weight, (self.num_embeddings,), "ParallelLMHead bias")
            self._load_rows(param, loaded_weight)
            return
        super().weight_loader(param, loaded_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, dim) -> (T, vocab)
        logits = linear(hidden, self.weight, self.bias, packed=self.packed_weight)  # (T, V_r)
        logits = distributed.tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]  # (T, vocab): drop the padding columns
