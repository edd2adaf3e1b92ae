"""
10 · Pipeline parallelism: layers on different devices
======================================================

Tensor parallelism (chapter 06) splits every layer and pays two all-reduces
per layer for it. Pipeline parallelism splits the *stack* instead: stage 0
holds the first layers, stage 1 the next, and a batch flows from stage to
stage. Between two stages travel only the activations of the batch, once per
step: ``hidden_states`` and ``residual``. This is vLLM's
``pipeline_parallel_size``.

You will learn:

1. how the layers are split (``get_pp_indices``) and what each stage holds;
2. what one stage hands the next (``IntermediateTensors``), in the ref
   simulation, where every stage runs in this process one after another;
3. why one batch at a time leaves every stage but one idle (the *bubble*),
   and how micro-batches in flight fill it: a Gantt chart drawn from the
   real ranks' own timestamps;
4. when to choose PP over TP: the bytes each sends per step, and what the
   interconnect does to each.

It runs in about a minute on a laptop CPU: two stages are two processes
(gloo over loopback), each with its share of the cores.
"""

# %%
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no window: the figure is saved as a PNG
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import backend
from minivllm.bench.pp import measured_bubble, run_micro_batches, textbook_bubble
from minivllm.bench.tp import num_blocks_needed, repeat_step, save_random_llama, synthetic_input
from minivllm.pp_stages import get_pp_indices

torch.manual_seed(0)

# %% [markdown]
# 1. The split
# ------------
#
# ``get_pp_indices(num_layers, pp_rank, pp_size)`` gives stage ``pp_rank`` its
# ``[start, end)`` layers: ``L // P`` each, and the ``L % P`` left over one each
# to the stages *before the last*, because the last stage also runs the final
# norm and the LM head (a ``vocab x hidden`` matmul per sampled token; for
# SmolLM2 that is 28 M multiply-adds, a quarter of what its 30 layers do together).
# Stage 0 also holds the embedding. The model's ``layers`` list keeps all its
# entries, with parameter-free placeholders for the layers other stages hold,
# so ``model.layers.17`` is layer 17 on every stage and checkpoint names need no
# renumbering; each stage reads only its own layers' bytes from the checkpoint.

# %%
for L, P in [(30, 2), (30, 4), (5, 3), (12, 5)]:
    split = [get_pp_indices(L, r, P) for r in range(P)]
    print(f"{L:>2} layers on {P} stages:", "  ".join(f"[{a},{b})" for a, b in split),
          "sizes", [b - a for a, b in split])

# %% [markdown]
# 2. What a stage sends: the ref simulation
# -----------------------------------------
#
# The ref runs every stage in this process, one after the other, each with its
# own layers and its own KV cache, and hands the ``IntermediateTensors`` from
# one to the next by hand: exactly what the real ranks send. We build a small
# random Llama (8 layers, hidden 256), load it as two stages, and run one
# prefill of three prompts through both.

# %%
from minivllm.engine.config import WorkerConfig  # noqa: E402
from minivllm.executor.uniproc_executor import UniProcExecutor  # noqa: E402

scratch = tempfile.TemporaryDirectory(prefix="tiny_llama_")  # deleted when the script ends
model_dir = save_random_llama(Path(scratch.name), hidden=256, heads=8, kv_heads=4,
                              intermediate=512, layers=8, vocab=500)
prefill = synthetic_input(num_seqs=3, query_len=7, context_len=0, vocab=500)
ref = {name: "ref" for name in backend.COMPONENTS}
with UniProcExecutor(WorkerConfig(str(model_dir)), ref) as one:
    one.init_kv_cache(8, 16)
    logits_pp1 = one.execute_model(prefill).result().logits  # a step without a sampling plan
with UniProcExecutor(WorkerConfig(str(model_dir), pipeline_parallel_size=2), ref) as two:
    two.init_kv_cache(8, 16)
    for w in two.workers:
        inner = w.model.model
        held = [i for i, layer in enumerate(inner.layers) if any(True for _ in layer.parameters())]
        print(f"stage {w.pp_rank}: layers {held}, embedding: {w.is_first_rank}, "
              f"norm + LM head: {w.is_last_rank}, {w.memory_bytes()['weights'] / 2**20:.2f} MiB")
    # One stage at a time, by hand (what each stage's Worker.execute_model does when
    # UniProcExecutor calls it, handing the output on through a SimulatedStageLink):
    stage0, stage1 = two.workers
    sent = stage0.run_model(stage0.prepare_model_input(prefill))
    for key in sent.keys():
        t = sent[key]
        print(f"stage 0 sends {key}: {tuple(t.shape)} {t.dtype}, {t.numel() * t.element_size()} bytes")
    logits_pp2 = stage1.run_model(stage1.prepare_model_input(prefill), sent)
print("max |pp=2 - pp=1| logits:", (logits_pp2 - logits_pp1).abs().max().item())
assert torch.equal(logits_pp2, logits_pp1)  # the same layers in the same order: bit for bit

# %% [markdown]
# The activations are ``2 x tokens x hidden`` numbers (here 2 x 21 x 256 floats,
# 43 KB) per stage boundary per step, whatever the number of layers. Tensor
# parallelism would all-reduce ``tokens x hidden`` numbers twice in *every* layer.
#
# 3. The bubble, and micro-batches that fill it
# ---------------------------------------------
#
# Now for real: two processes, each holding one stage
# (``MultiprocExecutor`` with ``pipeline_parallel_size=2``). Stage 0 runs its layers on a batch and
# sends the activations on with ``torch.distributed`` point-to-point ``send``;
# stage 1 receives them, runs its layers, samples, and sends the token ids back. With ONE
# batch in flight, stage 1 waits while stage 0 works and then stage 0 waits for
# the tokens: each stage is idle half the time. vLLM's answer is its *batch
# queue*: the engine keeps up to ``P`` scheduled batches (of different requests)
# in flight, ``max_concurrent_batches = pipeline_parallel_size``, so stage 0
# works on micro-batch 2 while stage 1 works on micro-batch 1.
#
# Every rank records when it had each micro-batch's inputs and when its output
# was ready (``executor.stage_timeline()``, ``time.time()``: one clock for the
# processes of one machine). We send ``m`` prefill micro-batches back to back
# (at most ``P`` in flight) and draw what the ranks recorded.

# %%
from minivllm.executor.multiproc_executor import MultiprocExecutor  # noqa: E402

PP, MS = 2, [1, 2, 4, 8]
timelines, bubbles, gaps = {}, {}, []
# Real ranks: the fast linear twin holds one rank's layers per process.
ex = MultiprocExecutor(WorkerConfig(str(model_dir), pipeline_parallel_size=PP),
                       {"linear": "fast"})
try:
    batches, first = [], 0
    for i in range(max(MS)):
        b = synthetic_input(2, 48, 0, 500, seed=i, name=f"mb{i}-", first_block=first)
        batches.append(b)
        first = num_blocks_needed(b)
    ex.init_kv_cache(first, 16, max_num_reqs=2 * len(batches))
    run_micro_batches(ex, batches)  # registers every request on both ranks (a warm-up)
    again = [repeat_step(b) for b in batches]
    for m in MS:
        ex.stage_timeline(clear=True)
        start = time.perf_counter()
        run_micro_batches(ex, again[:m])
        records = ex.stage_timeline(clear=True)
        timelines[m] = records
        bubbles[m] = measured_bubble(records, PP)
        # stage 1's start minus stage 0's end: the send of the activations (and its wake-up)
        ends0 = {r.batch: r.end for r in records if r.pp_rank == 0}
        gaps += [r.start - ends0[r.batch] for r in records if r.pp_rank == 1]
        print(f"m={m}: {time.perf_counter() - start:.3f} s, measured bubble "
              f"{bubbles[m]:.0%}, textbook (p-1)/(m+p-1) = {textbook_bubble(PP, m):.0%}")
    memory = ex.memory_per_rank()
finally:
    ex.shutdown()
for rank, mem in enumerate(memory):
    print(f"rank {rank}: weights {mem['weights'] / 2**20:.2f} MiB, "
          f"KV cache {mem['kv_cache'] / 2**20:.2f} MiB")
send_ms = 1e3 * statistics.median(gaps)
print(f"median stage-0-end to stage-1-start gap (the activations' send): {send_ms:.2f} ms")

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw=dict(width_ratios=[1, 1.6, 1]))
cmap = plt.get_cmap("tab10")
for ax, m in zip(axes[:2], (1, max(MS))):
    records = timelines[m]
    t0, b0 = min(r.start for r in records), min(r.batch for r in records)
    for r in records:  # the executor numbers every step; here micro-batch 0 is the first
        ax.barh(r.pp_rank, 1e3 * (r.end - r.start), left=1e3 * (r.start - t0), height=0.6,
                color=cmap((r.batch - b0) % 10), edgecolor="k")
        ax.text(1e3 * ((r.start + r.end) / 2 - t0), r.pp_rank, str(r.batch - b0),
                ha="center", va="center", fontsize=8)
    ax.set_yticks(range(PP), [f"stage {s}" for s in range(PP)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first micro-batch started")
    ax.set_title(f"m = {m} micro-batch{'es' if m > 1 else ''}: bubble {bubbles[m]:.0%} "
                 f"(textbook {textbook_bubble(PP, m):.0%})")
ax = axes[2]
ax.plot(MS, [bubbles[m] for m in MS], "o-", label="measured (ranks' timestamps)")
ms_fine = range(1, max(MS) + 1)
ax.plot(ms_fine, [textbook_bubble(PP, m) for m in ms_fine], "k--", label="(p-1)/(m+p-1)")
ax.set_xlabel("micro-batches m")
ax.set_ylabel("idle share of the stages")
ax.set_ylim(0, 1)
ax.legend()
ax.set_title(f"the bubble at p = {PP}")
fig.tight_layout()
fig.savefig(figure_path("10_pipeline_bubble.png"), dpi=110)
print("saved 10_pipeline_bubble.png")

# %% [markdown]
# **Figure 10.1.** Left: one micro-batch. Each bar is one stage working on one
# micro-batch (its number inside), placed at the times the rank itself recorded.
# Look at the white space: stage 1 waits for stage 0, then stage 0 has nothing
# to do. Middle: ``m`` micro-batches sent back to back; look at how stage 0 starts
# the next micro-batch while stage 1 still works on the previous one, so the only
# idle time left is the start (stage 1 waiting for its first input) and the end
# (stage 0 done). Right: the measured idle share against GPipe's textbook
# ``(p - 1) / (m + p - 1)``, which assumes equal stages and free sends.
#
# On this CPU, read the measured curve with care. Each stage is a process with
# its share of the cores, so stages overlap only if the machine has cores free
# for both: on a machine busy with other work, a stage's bar stretches while the
# other runs, and the measured bubble stays above the textbook. The last stage
# also runs the LM head, and stage 0 waits for the oldest micro-batch's logits
# before it may send one more than ``P``, so the stages are not equal either.
# On the 2-core machine this chapter was written on, shared with other work
# (load average about 7), one run measured 53%, 45%, 38% and 26% for m = 1, 2, 4
# and 8 (the textbook: 50%, 33%, 20%, 11%), and a median of 14 ms between stage
# 0's end and stage 1's start: the activations' trip through gloo over loopback
# plus the time the receiving process waits for a core. ``minivllm bench pp``, on
# a 30-layer model whose stages run longer, measured 50%, 28%, 17% and 12%.
#
# The textbook formula is about a *fixed* batch cut into ``m`` micro-batches,
# filled and drained once. An inference engine never drains: new requests keep
# arriving, so with ``P`` batches in flight the steady state has no bubble at
# all, as long as there are enough requests to make ``P`` batches of them. With
# one request (batch 1, a chat on a laptop) there is only one batch to send and
# pipeline parallelism cannot be faster than one device: it only makes the
# model fit.
#
# 4. When to choose PP over TP
# ----------------------------
#
# Per decode step of ``B`` tokens on a model of ``L`` layers, hidden size ``H``,
# ``b`` bytes per activation, on 2 devices:
#
# - **TP=2** all-reduces ``B x H x b`` bytes twice per layer: ``2L`` all-reduces,
#   each moving about ``B H b`` bytes per rank (a ring all-reduce on ``t`` ranks
#   moves ``2 (t-1)/t`` of the buffer) and paying the link's latency twice;
# - **PP=2** sends ``2 x B x H x b`` bytes (hidden states and residual) ONCE,
#   from stage 0 to stage 1, and the sampled token ids back (a few bytes a request).
#
# So per step TP moves ``L`` times more bytes and makes ``4L`` times more
# latency-bound trips. The communication time is ``trips x latency + bytes /
# bandwidth``. The link figures below are stated, typical numbers, not measured
# here (one direction, per device): NVLink 4 about 450 GB/s and 3 µs, PCIe 4
# x16 about 25 GB/s and 5 µs, 100 Gb/s InfiniBand about 12 GB/s and 5 µs, 10 Gb/s
# Ethernet (TCP) about 1.2 GB/s and 50 µs. The last row is the send measured
# above on this machine's loopback (gloo), applied to both.

# %%
LINKS = {"NVLink 4": (450e9, 3e-6), "PCIe 4 x16": (25e9, 5e-6),
         "100 Gb/s IB": (12e9, 5e-6), "10 GbE (TCP)": (1.2e9, 50e-6)}
MODELS = {"SmolLM2-135M": (30, 576), "Llama-3-8B": (32, 4096)}
B, BYTES = 64, 2  # a decode step of 64 sequences, bf16 activations


def step_comm_s(kind: str, layers: int, hidden: int, bandwidth: float, latency: float) -> float:
    """Seconds of communication per decode step on 2 devices (see the text above)."""
    if kind == "TP=2":  # 2 all-reduces per layer, each 2 trips of half the buffer
        trips, nbytes = 4 * layers, 2 * layers * B * hidden * BYTES
    else:  # PP=2: one send of hidden states + residual
        trips, nbytes = 1, 2 * B * hidden * BYTES
    return trips * latency + nbytes / bandwidth


print(f"per decode step of {B} tokens (bf16), on 2 devices:")
for name, (layers, hidden) in MODELS.items():
    tp_bytes, pp_bytes = 2 * layers * B * hidden * BYTES, 2 * B * hidden * BYTES
    print(f"  {name}: TP=2 all-reduces {tp_bytes / 2**20:.1f} MiB in {2 * layers} calls, "
          f"PP=2 sends {pp_bytes / 2**20:.2f} MiB once")
    for link, (bw, lat) in LINKS.items():
        tp_ms = 1e3 * step_comm_s("TP=2", layers, hidden, bw, lat)
        pp_ms = 1e3 * step_comm_s("PP=2", layers, hidden, bw, lat)
        print(f"    {link:<13} TP=2 {tp_ms:8.3f} ms   PP=2 {pp_ms:7.3f} ms")

fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
for ax, (name, (layers, hidden)) in zip(axes, MODELS.items()):
    xs = range(len(LINKS))
    for k, (kind, color) in enumerate([("TP=2", "tab:red"), ("PP=2", "tab:blue")]):
        ys = [1e3 * step_comm_s(kind, layers, hidden, bw, lat) for bw, lat in LINKS.values()]
        ax.bar([x + 0.4 * k for x in xs], ys, width=0.4, color=color, label=kind)
    ax.axhline(send_ms, color="gray", ls=":", label=f"PP send measured here ({send_ms:.2f} ms)")
    ax.set_xticks([x + 0.2 for x in xs], list(LINKS), fontsize=8)
    ax.set_yscale("log")
    ax.set_title(f"{name}: communication per decode step (B={B})")
    ax.legend(fontsize=8)
axes[0].set_ylabel("ms per step (log scale)")
fig.tight_layout()
fig.savefig(figure_path("10_pp_vs_tp.png"), dpi=110)
print("saved 10_pp_vs_tp.png")

# %% [markdown]
# **Figure 10.2.** Communication per decode step of 64 sequences for TP=2 (red)
# and PP=2 (blue), from the stated link numbers above (the dotted line is the
# activations' send measured on this machine, where waiting for a core dominates
# it). Look at the red bars grow as the link gets slower: over NVLink, TP's 64
# all-reduces of Llama-3-8B cost about half a millisecond, little beside a decode
# step's compute, but over 10 Gb/s Ethernet they cost about 34 ms, as much as or
# more than a GPU's whole decode step. PP's single send stays under a millisecond
# on every link.
#
# The verdict, as vLLM's docs give it: **tensor parallelism inside a machine**
# (fast links; it also cuts each token's latency, since every device works on
# every layer), **pipeline parallelism across machines** (slow links; it adds
# throughput only with enough requests in flight, and the memory per device
# falls with the stages either way). Both together, ``tensor_parallel_size`` =
# GPUs per node and ``pipeline_parallel_size`` = nodes, is the usual multi-node
# layout; ``torchrun`` starts such a job (docs/tensor_parallel.md, "Across
# machines").

# %% [markdown]
# What you built
# --------------
#
# The layer split with its placeholders, one stage's forward and what it sends,
# the same engine on real stage processes, and a measurement of the bubble from
# the ranks' own clocks against the textbook.

# %% [markdown]
# The test command
# ----------------
#
# Test what this chapter taught (the split and the stage forward against
# transformers, the real pipeline against the ref, the benchmark's bubble
# arithmetic):
#
# .. code-block:: text
#
#    pytest -q --backend=ref tests/test_pp_stages.py tests/test_bench_pp.py
#    pytest -q --backend=fast tests/test_pp_stages.py tests/test_bench_pp.py
