"""
06 · Tensor parallelism: one model, several devices
===================================================

A model too big (or too slow) for one GPU can be split *inside* each layer:
every GPU ("rank") holds a slice of every weight matrix, computes with its
slice, and the ranks exchange partial results twice per transformer layer.
This is Megatron-LM's tensor parallelism, the ``tensor_parallel_size`` of vLLM.

You will learn:

1. how a **column-parallel** layer (split the output features) and a
   **row-parallel** layer (split the input features) chain together so that
   an MLP needs only ONE all-reduce;
2. how attention heads are split, and why KV heads are *replicated* when
   there are more ranks than KV heads (GQA);
3. how the same layers run for real, one process per rank, with
   ``torch.distributed`` (gloo on a CPU, NCCL on GPUs).

Step 1 and 2 use ``minivllm.ref.linear``, which *simulates* all ranks in one
process: ``weight[r]`` is what rank ``r`` holds, and the collectives are plain
torch sums and concatenations, so you can print everything.
"""

# %%
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no window: the figure is saved as a PNG
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm.ref import linear as ref_linear

torch.manual_seed(0)

# %% [markdown]
# 1. An MLP on 4 ranks
# --------------------
#
# Llama's MLP is ``down(silu(gate(x)) * up(x))``. vLLM fuses gate and up into
# one ``MergedColumnParallelLinear``: rank ``r`` holds rows ``r*I/tp : (r+1)*I/tp``
# of **both** ``W_gate`` and ``W_up`` (shape ``(I, H)`` each), so it can apply the
# activation to its own slice with no communication. ``down_proj`` is a
# ``RowParallelLinear``: rank ``r`` holds the matching *columns* of ``W_down``
# (shape ``(H, I)``), multiplies them with its slice of the activation and gets
# a partial sum of the full output. One all-reduce (sum over ranks) finishes it.

# %%
H, I, tp = 12, 32, 4  # hidden size, intermediate size, ranks
W_gate, W_up, W_down = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I) / I**0.5

gate_up = ref_linear.MergedColumnParallelLinear(H, [I, I], tp_size=tp)
gate_up.weight.weight_loader(gate_up.weight, W_gate, 0)  # the FULL checkpoint tensor...
gate_up.weight.weight_loader(gate_up.weight, W_up, 1)  # ...each rank keeps its slice
down = ref_linear.RowParallelLinear(I, H, tp_size=tp)
down.weight.weight_loader(down.weight, W_down)

print("gate_up.weight", tuple(gate_up.weight.shape), "= (tp, 2*I/tp, H)")
print("down.weight   ", tuple(down.weight.shape), "= (tp, H, I/tp)")

x = torch.randn(5, H)  # 5 tokens


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


dense = F.linear(silu_and_mul(torch.cat([x @ W_gate.T, x @ W_up.T], -1)), W_down)

# What each rank does, written out:
partial_sums = []
for r in range(tp):
    gu_r = F.linear(x, gate_up.weight[r])  # (5, 2*I/tp): [gate_r | up_r], no communication
    h_r = silu_and_mul(gu_r)  # (5, I/tp): the activation, local
    partial_sums.append(F.linear(h_r, down.weight[r]))  # (5, H): a partial sum
y = torch.stack(partial_sums).sum(0)  # the all-reduce
print("max |per-rank + all-reduce - dense| =", (y - dense).abs().max().item())
assert torch.allclose(y, dense, atol=1e-5)

# %% [markdown]
# The layers' own ``forward`` does exactly that loop and returns the output in
# the dense layout, so the model code does not change with ``tp_size``:

# %%
# The ref MergedColumnParallelLinear returns [gate | up] in dense order (its gather
# interleaves the ranks' slices back), so silu_and_mul applies directly.
y_layers = down(silu_and_mul(gate_up(x)))
assert torch.allclose(y_layers, dense, atol=1e-5)
print("layers == dense:", torch.allclose(y_layers, dense, atol=1e-5))

# %% [markdown]
# 2. Attention heads, and replicated KV heads
# -------------------------------------------
#
# Heads are independent, so ``QKVParallelLinear`` gives each rank
# ``num_heads / tp`` query heads plus the KV heads they read. With grouped-query
# attention there may be fewer KV heads than ranks: 8 query heads and 2 KV
# heads on 4 ranks. Then each KV head is **replicated** on ``tp / num_kv_heads``
# ranks, so every query head still finds its KV head locally (the KV cache
# grows accordingly). A split that does not work raises a ``ValueError`` that
# lists the sizes that do.

# %%
D, n_q, n_kv = 4, 8, 2
qkv = ref_linear.QKVParallelLinear(H, D, n_q, n_kv, tp_size=tp)
W_q, W_k, W_v = torch.randn(n_q * D, H), torch.randn(n_kv * D, H), torch.randn(n_kv * D, H)
for shard_id, w in zip("qkv", (W_q, W_k, W_v)):
    qkv.weight.weight_loader(qkv.weight, w, shard_id)
for r in range(tp):
    q_heads = list(range(r * n_q // tp, (r + 1) * n_q // tp))
    k_head = [h for h in range(n_kv) if torch.equal(qkv.weight[r, -2 * D : -D], W_k[h * D : (h + 1) * D])]
    print(f"rank {r}: query heads {q_heads}, KV head {k_head}")
assert torch.allclose(qkv(x), x @ torch.cat([W_q, W_k, W_v]).T, atol=1e-5)
try:
    ref_linear.QKVParallelLinear(72, 8, 9, 3, tp_size=2)  # SmolLM2's 9 query / 3 KV heads
except ValueError as e:
    print("tp=2 on SmolLM2 ->", e)
# The attention layer alone would take tp=9 (one query head each, KV heads replicated),
# but SmolLM2's MLP (intermediate_size 1536) does not split 9 ways. The executors check
# the whole model before loading anything:
from types import SimpleNamespace  # noqa: E402

from minivllm.tp_shards import valid_tp_sizes  # noqa: E402

smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
print("tp sizes that work for SmolLM2-135M:", valid_tp_sizes(smollm2))

# %% [markdown]
# The picture
# -----------
#
# We let the layers draw their own split: load a weight whose every row (or
# column) holds its own index, then read back which rank received which.

# %%
owner_gu = np.zeros((2 * I, H))  # which rank holds each element of [W_gate; W_up]
probe = ref_linear.MergedColumnParallelLinear(H, [I, I], tp_size=tp)
rows = torch.arange(2 * I, dtype=torch.float32)[:, None].expand(2 * I, H)
probe.weight.weight_loader(probe.weight, rows)  # shard_id=None: the fused tensor
for r in range(tp):
    owner_gu[probe.weight[r, :, 0].long().numpy()] = r
owner_down = np.zeros((H, I))
probe = ref_linear.RowParallelLinear(I, H, tp_size=tp)
probe.weight.weight_loader(probe.weight, torch.arange(I, dtype=torch.float32).expand(H, I))
for r in range(tp):
    owner_down[:, probe.weight[r, 0].long().numpy()] = r

fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), gridspec_kw=dict(width_ratios=[1, 2.2, 2.4]))
cmap = plt.get_cmap("tab10", tp)
axes[0].imshow(owner_gu, cmap=cmap, vmin=-0.5, vmax=tp - 0.5, aspect="auto")
axes[0].axhline(I - 0.5, color="k", lw=2)
axes[0].set_title("gate_up_proj: column-parallel\n(rows split; gate above, up below)")
axes[0].set_xlabel("input feature (H)")
axes[0].set_ylabel("output feature (2I)")
im = axes[1].imshow(owner_down, cmap=cmap, vmin=-0.5, vmax=tp - 0.5, aspect="auto")
axes[1].set_title("down_proj: row-parallel\n(columns split to match)")
axes[1].set_xlabel("input feature (I)")
axes[1].set_ylabel("output feature (H)")
fig.colorbar(im, ax=axes[1], ticks=range(tp), label="rank")
ax = axes[2]  # the data flow of one decoder layer
ax.set_axis_off()
ax.set_xlim(0, 10)
ax.set_ylim(0, 10)
steps = [("x (every rank)", 9.2, "white"), ("qkv_proj  [column]", 7.9, "#dde"),
         ("attention on own heads", 6.6, "#dde"), ("o_proj  [row]", 5.3, "#dde"),
         ("ALL-REDUCE", 4.0, "#f99"), ("gate_up  [column] + act", 2.7, "#ded"),
         ("down_proj  [row]", 1.6, "#ded"), ("ALL-REDUCE", 0.5, "#f99")]
for text, yy, color in steps:
    ax.text(5, yy, text, ha="center", va="center", fontsize=9,
            bbox=dict(boxstyle="round", fc=color, ec="k"))
for (_, y0, _), (_, y1, _) in zip(steps, steps[1:]):
    ax.annotate("", xy=(5, y1 + 0.4), xytext=(5, y0 - 0.4), arrowprops=dict(arrowstyle="->"))
ax.set_title("one decoder layer: 2 all-reduces, nothing else")
fig.tight_layout()
fig.savefig(figure_path("06_tensor_parallel.png"), dpi=110)
print("saved 06_tensor_parallel.png")

# %% [markdown]
# **Figure 06.1.** Left: which rank holds each row of the column-parallel
# ``gate_up_proj`` (gate above the black line, up below) and each column of the row-
# parallel ``down_proj``; right: one decoder layer's data flow. Look at how the colours
# of the two matrices line up, so each rank's MLP needs no communication, and at the
# right: the only two collectives of a layer are the all-reduces after ``o_proj`` and
# ``down_proj``.
#
# 3. For real: one process per rank
# ---------------------------------
#
# ``minivllm.fast.linear`` has the same classes, but each process holds only its
# own shard and the collectives are real ``torch.distributed`` calls through
# ``minivllm.distributed`` (``tensor_model_parallel_all_reduce``, ``..._gather``).
# ``MultiprocExecutor`` runs rank 0 in this process and starts ``tp - 1`` worker
# processes; every step it broadcasts the batch and the block-table changes
# (one packed int64 tensor: each rank keeps its own block table, so the whole
# tables never travel), and all ranks run the forward pass together. On this CPU each rank is a process
# with its own thread; on a GPU machine each would be a GPU.
#
# We build a small random Llama (8 query heads, 4 KV heads), run the same
# batch with tp=1 and tp=2, and compare the logits.

# %%
from minivllm import distributed  # noqa: E402
from minivllm.bench.tp import save_random_llama, synthetic_input  # noqa: E402
from minivllm.engine.config import WorkerConfig  # noqa: E402
from minivllm.executor.multiproc_executor import MultiprocExecutor  # noqa: E402
from minivllm.executor.uniproc_executor import UniProcExecutor  # noqa: E402

scratch = tempfile.TemporaryDirectory(prefix="tiny_llama_")  # deleted when the script ends
model_dir = save_random_llama(Path(scratch.name), hidden=128, heads=8, kv_heads=4,
                              intermediate=256, layers=2, vocab=500)
batch = synthetic_input(num_seqs=3, query_len=7, context_len=0, vocab=500)
real_layers = {"linear": "fast"}  # real one-process-per-rank layers; the kernels stay ref
with UniProcExecutor(WorkerConfig(str(model_dir)), real_layers) as ex1:
    ex1.init_kv_cache(8, 16)
    logits_tp1 = ex1.execute_model(batch).result().logits  # a step without a sampling plan
stats = distributed.CollectiveStats()  # rank 0's collectives add their calls and time here
with MultiprocExecutor(WorkerConfig(str(model_dir), tensor_parallel_size=2), real_layers,
                       collective_stats=stats) as ex2:
    ex2.init_kv_cache(8, 16)
    mlp = ex2.worker.model.model.layers[0].mlp
    attn = ex2.worker.model.model.layers[0].self_attn
    print("rank 0 holds gate_up", tuple(mlp.gate_up_proj.weight.shape),
          "down", tuple(mlp.down_proj.weight.shape),
          f"and {attn.num_heads} of 8 query heads, {attn.num_kv_heads} of 4 KV heads")
    stats.reset()  # only the step below
    logits_tp2 = ex2.execute_model(batch).result().logits
print(f"rank 0 made {stats.calls} collective calls "
      f"(2 layers x 2 all-reduces + embedding all-reduce + logits all-gather)")
print("max |tp=2 - tp=1| logits:", (logits_tp2 - logits_tp1).abs().max().item())
assert torch.allclose(logits_tp2, logits_tp1, atol=1e-4)

# %% [markdown]
# What to take away:
#
# - the only communication is two all-reduces per layer (plus one for the
#   embedding and a gather of the logits); ``python -m minivllm.bench tp``
#   measures their share of the step time;
# - the KV cache is split too: each rank stores only its own KV heads;
# - ``tp_size`` must split the heads and the MLP evenly (the vocabulary is padded).

# %% [markdown]
# What you built
# --------------
#
# Column- and row-parallel layers, query heads sharded over ranks with KV heads replicated
# where there are fewer of them, all checked against the dense layers, and the engine running
# on real worker processes.

# %% [markdown]
# The test command
# ----------------
#
# Test what this chapter taught (the layers against the dense layer for tp in
# 1, 2, 4, and the executor against tp=1, including a killed worker):
#
# .. code-block:: text
#
#    pytest -q --backend=ref tests/test_linear.py tests/test_tp_engine.py
#    pytest -q --backend=fast tests/test_linear.py tests/test_tp_engine.py

# %% [markdown]
# The course task
# ---------------
#
# Write the tensor-parallel layers (task 14): the shards each rank holds, the gather and the
# all-reduce. The tests include more ranks than KV heads (each KV head replicated), token
# ids on rank boundaries and a row-parallel bias that must be added once.
#
# Handouts (task 14 ``tp_linear``: :doc:`/course/14_tp_linear`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task tp_linear
