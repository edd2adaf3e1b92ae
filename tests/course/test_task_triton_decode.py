"""Course task: the flash-decoding kernel's inner loop, in Triton, against float64 softmax.

On a machine without CUDA the kernel runs in Triton's interpreter (numpy, one
program at a time), so the cases are small: a few decodes of awkward lengths,
GQA group 2, head_dim 24 (padded to 32 and masked). Three regimes: one
partition per sequence (the kernel writes the output itself), many partitions
merged by log-sum-exp, and scores in the hundreds (the running max).
"""

from __future__ import annotations

import pytest
import torch
from kernel_task import kernel_module, triton_runs_here
from test_task_paged_attention import _batch, _oracle

if not triton_runs_here():
    pytest.skip("needs CUDA or Triton's interpreter: run with --backend=PKG (or fast), which "
                "sets TRITON_INTERPRET=1 on a CPU", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQS = [(1, 1), (1, 9), (1, 70), (1, 150)]  # one query row each: decodes


def _run(seqs, partition_size, magnitude=1.0, seed=0):
    query, k_cache, v_cache, md, tables = _batch(seqs, 4, 2, 24, 4, seed)
    query = query * magnitude
    scale = 24**-0.5
    decode = kernel_module("attention", "attention_decode")
    out = torch.full_like(query, float("nan")).to(DEVICE)  # every row must be written
    decode.paged_decode_attention(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md.block_tables.to(DEVICE),
        md.seq_lens.to(DEVICE), md.query_start_loc.to(DEVICE), md.max_seq_len, scale, out,
        partition_size=partition_size)
    return out.cpu(), _oracle(query, k_cache, v_cache, seqs, tables, scale)


def _check(out, want, what):
    for i, (_, seq_len) in enumerate(SEQS):
        torch.testing.assert_close(out[i].double(), want[i], rtol=1e-4, atol=1e-4, msg=lambda m, i=i, s=seq_len: (
            f"{what}: sequence {i} (seq_len {s}): {m}"))


def test_one_partition_per_sequence():
    """Partitions of 512: each program walks its whole context, several 64-token tiles."""
    out, want = _run(SEQS, 512)
    _check(out, want, "one partition (the online softmax over tiles)")


def test_many_partitions_merged():
    """Partitions of 64: the merge kernel combines the partial (max, sum, acc) triples."""
    out, want = _run(SEQS, 64, seed=1)
    _check(out, want, "partitions of 64 (each program's partial result)")


def test_large_scores_use_the_running_max():
    """Scores in the hundreds: exp2 overflows unless the running max is subtracted."""
    out, want = _run(SEQS, 512, magnitude=40.0, seed=2)
    assert torch.isfinite(out).all(), "inf/NaN with large scores: is the running max used?"
    _check(out, want, "large scores")
