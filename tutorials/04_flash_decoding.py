"""
04 · Flash-decoding (paged decode attention), from a gather to a Triton kernel
==============================================================================

During decoding every sequence brings **one** new query row per head, and
attention must read that sequence's whole cached context of keys and values.
There is almost no arithmetic per byte: decode attention is a *memory-bound
stream* through the KV cache, and a good kernel is one that reads each cached
byte once, from every corner of the GPU at the same time.

We go in four steps, checking each against the reference
(``minivllm.ref.attention.paged_attention``):

1. **naive**: gather each sequence's blocks into a contiguous tensor, then
   ``softmax(q k^T * scale) v`` (what the ref does, one sequence at a time);
2. **online softmax over blocks**: walk the block table, one block at a time,
   keeping a running max ``m``, a running sum ``l`` and an unnormalised output
   ``acc``; no gathered copy, no score matrix;
3. **split-K**: cut the context into partitions, run step 2 on each
   independently (on a GPU: in parallel), and merge the partial results by
   log-sum-exp;
4. **the Triton kernel** ``minivllm.fast.attention_decode``, which is step 3
   with one program per (sequence, KV head, partition).

Without a GPU the kernel runs in Triton's interpreter, so sizes stay tiny.
"""

# %%
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before Triton is imported

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm.fast import attention as fast_attention
from minivllm.fast.attention_decode import paged_decode_attention
from minivllm.metadata import AttentionMetadata
from minivllm.ref import attention as ref_attention

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print("device:", device, "(Triton interpreter)" if device == "cpu" else "")

# %% [markdown]
# A paged KV cache with three decoding sequences
# ----------------------------------------------
#
# GQA with 4 query heads over 2 KV heads, head_dim 24 (not a power of two, on
# purpose), blocks of 16 tokens handed out in a random order, as a real block
# allocator would after some churn.

# %%
num_heads, num_kv_heads, head_dim, block_size = 4, 2, 24, 16
seq_lens = [37, 300, 523]
blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
num_blocks = sum(blocks_per_seq)
perm = torch.randperm(num_blocks)
block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
first = 0
for i, n in enumerate(blocks_per_seq):
    block_tables[i, :n] = perm[first : first + n]
    first += n
k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
query = torch.randn(len(seq_lens), num_heads, head_dim)  # one row per sequence
scale = head_dim**-0.5
metadata = AttentionMetadata.build(
    query_lens=[1] * len(seq_lens),  # one row per sequence: a decode batch
    seq_lens=seq_lens,
    block_tables=block_tables,
    slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
)
print("block table of sequence 0:", block_tables[0, : blocks_per_seq[0]].tolist())

# %% [markdown]
# Step 1 · naive: gather, then attend
# -----------------------------------
#
# The ref (``minivllm.ref.attention``) is the textbook page. For each sequence it
# gathers the sequence's blocks into a contiguous ``(seq_len, H_kv, D)`` copy,
# maps every query head to its KV head (``h // group``, GQA), computes the scores
# ``q k^T * scale``, masks the future (a decode row sees its whole context, so
# nothing here), takes the softmax in float32 and the weighted sum of the
# values. Here is that page for sequence 0, written out:

# %%
group = num_heads // num_kv_heads
kv_head = torch.arange(num_heads) // group  # query head h reads KV head h // group
n0 = seq_lens[0]
k0 = ref_attention.gather_kv(k_cache, block_tables[:1], n0)[0]  # (37, H_kv, D): a copy
v0 = ref_attention.gather_kv(v_cache, block_tables[:1], n0)[0]
scores = torch.einsum("hd,khd->hk", query[0], k0[:, kv_head]) * scale  # (H, 37)
probs = torch.softmax(scores, dim=-1)  # over the 37 keys
step1 = torch.einsum("hk,khd->hd", probs, v0[:, kv_head])  # (H, D)
ref_out = ref_attention.paged_attention(query, k_cache, v_cache, metadata, scale)
print("step 1 (sequence 0) vs ref, max abs error:", (step1 - ref_out[0]).abs().max().item())

# %% [markdown]
# Before a single score is computed, the ref has written a copy of every
# sequence's K and V (the gather), then ``group`` copies of it (one per query
# head), then, for 16-bit caches, a float32 copy of those; and it stores the
# scores and probabilities. All of that is memory traffic on top of the one
# read of the cache that the maths needs.

# %% [markdown]
# Step 2 · online softmax over the blocks, in place
# -------------------------------------------------
#
# Process keys one block at a time. Keep, per query head, the running max
# ``m`` of the scores seen so far, ``l = sum exp(s - m)`` and
# ``acc = sum exp(s - m) v``. When a new block raises the max to ``m'``, the old
# sums are rescaled by ``exp(m - m')``. At the end, ``out = acc / l``. This never
# materialises the scores and reads each block straight from the cache.

# %%
def online_softmax(q, seq, start, end):
    """(m, l, acc) of sequence ``seq``'s keys ``start:end`` for its query heads q: (H, D)."""
    group = num_heads // num_kv_heads
    kv_head = torch.arange(num_heads) // group
    m = torch.full((num_heads,), -math.inf)
    l = torch.zeros(num_heads)
    acc = torch.zeros(num_heads, head_dim)
    for pos in range(start - start % block_size, end, block_size):  # one block at a time
        block = block_tables[seq, pos // block_size]
        lo, hi = max(pos, start) - pos, min(pos + block_size, end) - pos
        k = k_cache[block, lo:hi][:, kv_head]  # (n, H, D): read in place
        v = v_cache[block, lo:hi][:, kv_head]
        s = torch.einsum("hd,nhd->hn", q, k) * scale
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)  # rescale what we had
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v)
        m = m_new
    return m, l, acc


step2 = torch.stack([(lambda m, l, acc: acc / l[:, None])(*online_softmax(query[i], i, 0, n))
                     for i, n in enumerate(seq_lens)])
print("step 2 vs ref, max abs error:", (step2 - ref_out).abs().max().item())

# %% [markdown]
# Step 3 · split-K: partitions in parallel, merged by log-sum-exp
# ---------------------------------------------------------------
#
# A batch of 3 sequences with 2 KV heads is only 6 independent walks: far too
# few to keep a GPU's 132 multiprocessors busy, and each walk is long. So we
# cut every context into partitions of ``P`` tokens, compute ``(m_p, l_p, acc_p)``
# for each independently, then merge:
#
# .. math::
#
#    M = \max_p m_p,\quad w_p = e^{m_p - M},\quad \text{out} = \frac{\sum_p w_p\,\text{acc}_p}{\sum_p w_p\,l_p}.
#
#
# (The kernel uses 512-token partitions; here 128, to get several.)

# %%
P = 128
step3, merge_weights = [], []
for i, n in enumerate(seq_lens):
    parts = [online_softmax(query[i], i, s, min(s + P, n)) for s in range(0, n, P)]
    m = torch.stack([p[0] for p in parts])  # (num_parts, H)
    l = torch.stack([p[1] for p in parts])
    acc = torch.stack([p[2] for p in parts])  # (num_parts, H, D)
    w = torch.exp(m - m.max(dim=0).values)
    step3.append((w[:, :, None] * acc).sum(0) / (w * l).sum(0)[:, None])
    merge_weights.append((w * l / (w * l).sum(0))[:, 0])  # share of each partition, head 0
step3 = torch.stack(step3)
print("step 3 vs ref, max abs error:", (step3 - ref_out).abs().max().item())

# %% [markdown]
# Step 4 · the Triton kernels
# ---------------------------
#
# ``_paged_decode_kernel`` runs on a grid `(num_seqs, num_kv_heads,
# num_partitions)``. Each program loads the ``GROUP` query heads that share its
# KV head as one ``[BLOCK_G, BLOCK_D]`` tile (padded to 16 rows and a power-of-2
# head dim for ``tl.dot``), then loops over its partition in tiles of ``TILE_N``
# tokens: it looks up each token's physical block in the block table, loads
# the K tile, computes scores with ``tl.dot``, updates ``(m, l, acc)`` exactly as
# in step 2 (with ``exp2`` and the scale folded into ``log2(e)``), and stores its
# partial result. ``_merge_partitions_kernel``, grid ``(num_seqs, num_heads)``,
# does step 3's merge. We call it with 128-token partitions, like step 3, and
# then through the public ``paged_attention`` (512-token partitions).

# %%
md_dev = metadata.to(device)
q_dev, k_dev, v_dev = query.to(device), k_cache.to(device), v_cache.to(device)
out = torch.full_like(q_dev, float("nan"))  # every row must be written
paged_decode_attention(q_dev, k_dev, v_dev, md_dev.block_tables, md_dev.seq_lens,
                       md_dev.query_start_loc, md_dev.max_seq_len, scale, out,
                       partition_size=P)
print("Triton, 128-token partitions vs ref:", (out.cpu() - ref_out).abs().max().item())
out2 = fast_attention.paged_attention_triton(q_dev, k_dev, v_dev, md_dev, scale)
print("Triton, public paged_attention vs ref:", (out2.cpu() - ref_out).abs().max().item())
torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(out2.cpu(), ref_out, rtol=1e-5, atol=1e-5)

# %% [markdown]
# Picture: who reads what, and how the pieces are merged
# ------------------------------------------------------
#
# Left: each sequence's context as a bar, coloured by the program (partition)
# that reads it; thin ticks are block boundaries (each block lives somewhere
# else in memory). Right: each partition's share ``w_p l_p / sum(w l)`` of the
# final softmax for query head 0: the merge is a weighted average.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
colors = plt.cm.tab10.colors
for i, n in enumerate(seq_lens):
    for j, s in enumerate(range(0, n, P)):
        ax1.barh(i, min(P, n - s), left=s, color=colors[j % 10], edgecolor="k")
        if n - s > 40:  # label the partitions wide enough to hold one
            ax1.text(s + min(P, n - s) / 2, i, f"prog {j}", ha="center", va="center", fontsize=8)
    for b in range(0, n, block_size):
        ax1.plot([b, b], [i - 0.4, i - 0.25], color="k", lw=0.5)
ax1.set_yticks(range(len(seq_lens)), [f"seq {i} ({n} tok)" for i, n in enumerate(seq_lens)])
ax1.set_xlabel("token position (partition = 128 tokens, block = 16)")
ax1.set_title("split-K: one program per partition")
width = 0.25
for i, w in enumerate(merge_weights):
    ax2.bar([j + i * width for j in range(len(w))], w.numpy(), width, label=f"seq {i}")
ax2.set_xlabel("partition")
ax2.set_ylabel("merge weight (head 0)")
ax2.set_title("log-sum-exp merge weights")
ax2.legend()
fig.tight_layout()
fig.savefig(figure_path("04_flash_decoding.png"), dpi=110)
print("saved 04_flash_decoding.png")

# %% [markdown]
# **Figure 04.1.** Left: how split-K cuts each sequence's context into 128-token
# partitions, one program each (ticks are the 16-token blocks); right: the weight each
# partition's partial result gets in the log-sum-exp merge, for head 0. Look at the long
# sequence, read by five programs in parallel, and at its weights: they sum to one, and
# the last, 11-token partition counts little.
#
# Memory traffic at serving scale
# -------------------------------
#
# Batch 64, context 4096, 32 query heads over 8 KV heads of dim 128, bf16 (2
# bytes). The kernel must read K and V once: ``2 * 64 * 4096 * 8 * 128 * 2``
# bytes = 1.07 GB (call it ``kv``), so on a 4.8 TB/s H200 the floor is about
# 0.22 ms. The ref, step by step, for K and again for V (each ``kv / 2``):
# the gather reads the blocks and writes a copy; the GQA mapping reads the copy
# and writes ``group = 4`` copies; the float32 upcast reads those and writes
# twice their bytes; the matmul reads the float32 copy. Then the
# ``(64, 32, 4096)`` float32 scores are written, scaled, masked, softmaxed (a
# read and a write each) and read by the weighted sum: 8 passes.
# ``python -m minivllm.bench kernels`` measures the kernel's GB/s against the
# GPU's copy bandwidth.

# %%
B, L, Hkv, D, H = 64, 4096, 8, 128, 32
G = H // Hkv
kv = 2 * B * L * Hkv * D * 2  # K and V, bf16: what the kernel reads
per_tensor = (1 + 1) + (1 + G) + (G + 2 * G) + 2 * G  # in units of one tensor's bf16 bytes
scores = B * H * L * 4  # one pass over the float32 scores
ref_bytes = 2 * per_tensor * (kv // 2) + 8 * scores
print(f"kernel: {kv / 1e9:.2f} GB; ref: about {ref_bytes / 1e9:.0f} GB "
      f"({ref_bytes / kv:.0f}x); floor on a 4.8 TB/s H200: {kv / 4.8e12 * 1e3:.2f} ms")

# %% [markdown]
# What you built
# --------------
#
# Paged decode attention four ways, each equal to the ref: gather then attend, an online
# softmax over the blocks, split-K partitions merged by log-sum-exp, and the Triton flash-
# decoding kernel.

# %% [markdown]
# The test command
# ----------------
#
# The kernels are tested against the ref and a per-sequence SDPA oracle on
# random paged batches (awkward head dims, GQA 1-8, block sizes 1-32, NaN in
# every unused cache slot):
#
# .. code-block:: text
#
#    pytest -q tests/test_attention.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Write the cache write (task 10) and paged attention (task 11) in your student package:
# query row ``j`` of a sequence sits at position ``seq_len - query_len + j``, and query head ``h``
# reads KV head ``h // (num_heads // num_kv_heads)``. The tests use GQA groups above 1,
# chunks that start mid-block over a cached prefix, and caches whose every slot outside the
# sequences is NaN (read a row too many and the output is NaN).
#
# Handouts (task 10 ``cache_write``: :doc:`/course/10_cache_write`, task 11 ``paged_attention``: :doc:`/course/11_paged_attention`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task cache_write --task paged_attention
