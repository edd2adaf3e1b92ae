"""
01 · The paged KV cache, prefix caching and the scheduler
=========================================================

In this tutorial you will:

1. measure how much KV-cache memory is wasted when every request reserves a
   contiguous ``max_model_len`` region, and how little is wasted with **paging**;
2. hand out blocks with the **block allocator**, write a **block table** and
   compute the **slot mapping** that tells the model where each token's K/V go;
3. watch two requests **share prefix blocks** (automatic prefix caching) and
   draw their block tables with the blocks' reference counts;
4. run the real continuous-batching **scheduler** with a fake model and read
   its step log: chunked prefill, decodes in the same step, and a preemption.

Everything here is host-side Python: no model, no GPU. It runs in seconds.
"""

# %%
import math
import random

import matplotlib

matplotlib.use("Agg")  # no display needed: figures are saved as PNGs
import matplotlib.pyplot as plt
import numpy as np
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import SamplingParams
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.prefix_hash import hash_request_tokens
from minivllm.ref.block_allocator import BlockAllocator
from minivllm.ref.block_table import BlockTables
from minivllm.ref.scheduler import Scheduler
from minivllm.request import Request

rng = random.Random(0)

# %% [markdown]
# 1. Why page the KV cache?
# -------------------------
#
# Every token of every running request keeps a key and a value vector per layer
# in GPU memory. A server does not know in advance how long an answer will be,
# so the naive layout reserves ``max_model_len`` contiguous slots per request.
# Most of that reservation is never used: a 300-token chat in a 4096-token
# slot wastes 93% of it.
#
# Paging (vLLM's PagedAttention) cuts the cache into small blocks of
# ``block_size`` token slots and gives a request one more block only when its
# last one is full. The only waste left is the unfilled tail of each
# request's last block: less than ``block_size`` slots per request.
#
# Let's measure it on a random workload: 256 requests with prompts of 20 to
# 1000 tokens and outputs of 10 to 500 tokens, ``max_model_len = 4096``.

# %%
max_model_len = 4096
prompt_lens = np.array([rng.randint(20, 1000) for _ in range(256)])
output_lens = np.array([rng.randint(10, 500) for _ in range(256)])
final_lens = prompt_lens + output_lens  # tokens each request ends up holding


def wasted_fraction(reserved: np.ndarray, used: np.ndarray) -> float:
    """Share of the reserved KV slots that hold no token."""
    return float(1 - used.sum() / reserved.sum())


schemes = {"contiguous\n(max len)": np.full_like(final_lens, max_model_len)}
for bs in (1, 16, 64, 256):
    schemes[f"paged\nbs={bs}"] = np.ceil(final_lens / bs).astype(int) * bs
waste = {name: wasted_fraction(reserved, final_lens) for name, reserved in schemes.items()}
for name, w in waste.items():
    print(f"{name.replace(chr(10), ' '):32s} wastes {100 * w:5.1f}% of the reserved slots")

# How many of these requests fit at once in a cache of 64k token slots?
budget = 65536
fit_contiguous = budget // max_model_len
fit_paged = int(np.searchsorted(np.cumsum(schemes["paged\nbs=16"]), budget, "right"))
print(f"\nin {budget} slots: {fit_contiguous} requests contiguous, {fit_paged} paged (block 16)")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
ax1.bar(list(waste), [100 * w for w in waste.values()],
        color=["tab:red"] + ["tab:blue"] * (len(waste) - 1))
ax1.set_ylabel("KV slots reserved but empty (%)")
ax1.set_title("memory wasted at the end of each request")
for i, w in enumerate(waste.values()):
    ax1.text(i, 100 * w + 1, f"{100 * w:.1f}%", ha="center")
ax2.bar(["contiguous", "paged (16)"], [fit_contiguous, fit_paged], color=["tab:red", "tab:blue"])
ax2.set_ylabel("requests running at once")
ax2.set_title(f"batch size that fits in {budget // 1024}k slots")
fig.tight_layout()
fig.savefig(figure_path("01_paged_kv_cache_waste.png"), dpi=110)
print("saved 01_paged_kv_cache_waste.png")

# %% [markdown]
# **Figure 01.1.** Left: the share of reserved KV memory left unused when each request
# finishes; right: how many requests fit in the same slots. Look at the contiguous bar
# against the 16-token blocks: the waste drops to about 1% and the batch grows several
# times; at 256-token blocks the waste climbs again.
#
# Paging with 16-token blocks wastes about 1% and fits several times
# more requests in the same memory, which is where vLLM's throughput comes
# from: bigger batches. Very large blocks (256) start to waste again; vLLM's
# default is 16.
#
# 2. Block allocator, block table, slot mapping
# ---------------------------------------------
#
# ``BlockAllocator`` (``minivllm/ref/block_allocator.py``) only does bookkeeping:
# which of the ``num_blocks`` block ids are free and how many requests hold each
# one. A request's **block table** lists its blocks in order. A token at
# position ``pos`` lives in logical block ``pos // block_size``, so its K/V slot
# in the cache, seen as one flat array of ``num_blocks * block_size`` slots, is
#
# ``slot = block_table[pos // block_size] * block_size + pos % block_size``
#
# Each step the worker builds two tensors from its block tables: the padded
# block tables (the attention kernel reads the context through them) and the
# **slot mapping** of the tokens computed this step (the cache write puts
# their new K/V there).
#
# Who keeps which record (as in vLLM v1): the scheduler's KV cache manager
# keeps each request's block ids as a plain list and decides with it; the
# ``BlockTables`` live in the worker, on the model's device (one per rank under
# tensor parallelism). Each step the scheduler sends only the changes, the
# block ids each request gained (``SchedulerOutput.new_block_ids``) and the
# finished or preempted requests, and the worker applies them to its table.
# Here we play the worker's part by hand.

# %%
block_size = 4
allocator = BlockAllocator(num_blocks=12, block_size=block_size)
tables = BlockTables(max_num_reqs=2, max_num_blocks_per_req=6, block_size=block_size)

allocator.allocate(2)  # someone else holds blocks 0 and 1: ours won't start at 0
tables.add_request("A")
tables.append_blocks("A", allocator.allocate(3))  # 10 prompt tokens -> 3 blocks
print("A's blocks:", tables.get_block_ids("A"), "| free blocks left:", allocator.num_free_blocks)
print("block table tensor:\n", tables.block_table_tensor(["A"]))
# Prefill: positions 0..9 of A.
print("prefill slot mapping:", tables.slot_mapping(["A"], [0], [10]).tolist())
# Two decode steps later A has 12 tokens and needs a 4th block for position 12.
tables.append_blocks("A", allocator.allocate(1))
print("decode of position 12 ->", tables.slot_mapping(["A"], [12], [1]).tolist())

# %% [markdown]
# Position 12 is the first token of A's 4th logical block, which the allocator
# placed in physical block 5: slot ``5 * 4 + 0 = 20``. Physical blocks need not
# be adjacent, or in order; only the block table knows.
#
# 3. Prefix caching: sharing blocks between requests
# --------------------------------------------------
#
# Chat requests often start with the same system prompt. A full block is named
# by a **chained hash**: ``hash(parent block's hash, its own token ids)``, so a
# block's name covers every token before it too (``minivllm/prefix_hash.py``).
# When a request's blocks fill up they are entered in a hash table; a new
# request looks up its own block hashes and reuses the longest hit, taking one
# more reference on each block instead of recomputing it. It always leaves at
# least its last prompt token to compute, because the model has to run on that
# token to produce the first output's logits.
#
# Freed blocks keep their hash and go to the *tail* of the free queue, and new
# blocks come from the *head*, so cached blocks are evicted least recently used
# first.
#
# Here the real scheduler admits two requests that share an 8-token system
# prompt (two blocks of 4).

# %%
system_prompt = [101, 102, 103, 104, 105, 106, 107, 108]
print("chained hashes of the system prompt's blocks:", hash_request_tokens(4, system_prompt))

sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32),
                  CacheConfig(block_size=4, num_blocks=10))
greedy = SamplingParams(max_tokens=4)
sched.add_request(Request("A", system_prompt + [11, 12, 13, 14, 15], greedy, eos_token_id=None))
out = sched.schedule()
sched.update_from_output(out, {"A": 7})
sched.add_request(Request("B", system_prompt + [21, 22, 23], greedy, eos_token_id=None))
out = sched.schedule()
print("step 2 computes", out.num_scheduled_tokens, "tokens")
print("block ids sent to the worker:", out.new_block_ids, "(B is new:", out.new_req_ids, ")")
a, b = sched.requests["A"], sched.requests["B"]
print(f"B found {b.num_cached_tokens} of its {b.num_prompt_tokens} prompt tokens in the cache")
ref_counts = {blk: sched.block_allocator.ref_count(blk) for blk in range(10)}
print("A:", sched.get_block_ids("A"), " B:", sched.get_block_ids("B"), " ref counts:", ref_counts)


def draw_block_tables(ax, sched, req_ids, num_blocks):
    """Draw each request's block table as arrows into the pool, with ref counts."""
    colors = {"A": "tab:orange", "B": "tab:green"}
    alloc = sched.block_allocator
    for blk in range(num_blocks):
        count = alloc.ref_count(blk)
        face = "lightgray" if count == 0 else ("tab:purple" if count > 1 else "white")
        ax.add_patch(plt.Rectangle((blk, 0), 0.9, 0.9, facecolor=face, edgecolor="black"))
        ax.text(blk + 0.45, 0.45, f"#{blk}\nref {count}", ha="center", va="center", fontsize=8)
    for row, req_id in enumerate(req_ids):
        y = 2 + 1.3 * row
        ax.text(-0.3, y + 0.35, req_id, ha="right", va="center", fontsize=12,
                color=colors[req_id])
        for i, blk in enumerate(sched.get_block_ids(req_id)):
            ax.add_patch(plt.Rectangle((i, y), 0.9, 0.7, facecolor=colors[req_id], alpha=0.3,
                                       edgecolor=colors[req_id]))
            ax.text(i + 0.45, y + 0.35, f"{blk}", ha="center", va="center", fontsize=9)
            ax.annotate("", xy=(blk + 0.45, 0.92), xytext=(i + 0.45, y),
                        arrowprops=dict(arrowstyle="->", color=colors[req_id], alpha=0.7))
    ax.set_xlim(-1.2, num_blocks + 0.2)
    ax.set_ylim(-0.3, 2 + 1.3 * len(req_ids))
    ax.axis("off")


fig, ax = plt.subplots(figsize=(9, 3.8))
draw_block_tables(ax, sched, ["A", "B"], 10)
ax.set_title("block tables (top) pointing into the block pool (bottom); "
             "purple = shared prefix block")
fig.tight_layout()
fig.savefig(figure_path("01_paged_kv_cache_prefix.png"), dpi=110)
print("saved 01_paged_kv_cache_prefix.png")

# %% [markdown]
# **Figure 01.2.** Two block tables (top) pointing into the block pool (bottom), with
# each block's reference count. Look at the first two entries of A and B: they point to
# the same physical blocks, the shared system prompt, held twice.
#
# B's table starts with the same two physical blocks as A's: the system
# prompt's K/V are stored once, with reference count 2. Only B's own 3 tokens
# are computed. When both finish, the blocks go back to the free queue but keep
# their hashes, so a third request with the same system prompt would hit them
# again, until memory pressure recycles them.
#
# 4. The scheduler, step by step
# ------------------------------
#
# Each step the scheduler (``minivllm/ref/scheduler.py``) fills a **token budget**
# (``max_num_batched_tokens``) with, in order:
#
# 1. the **running** requests: 1 token for a decode, the next chunk for a long
#    prompt. If the pool has no block left for one, the most recently admitted
#    request is **preempted**: its blocks are freed and it goes back to the
#    *front* of the waiting queue, to be recomputed later;
# 2. then, if nothing was preempted, **waiting** requests first-come-first-served;
#    a prompt longer than the budget left is split (**chunked prefill**).
#
# A fake model samples a random token for every request whose tokens are all
# computed after the step. A tiny pool (14 blocks of 4) and budget (16 tokens)
# make everything happen in a few steps.

# %%
sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
                  CacheConfig(block_size=4, num_blocks=14))
prompts = {"r0": 5, "r1": 30, "r2": 6, "r3": 9, "r4": 3}  # prompt lengths; r1 is long
for req_id, n in prompts.items():
    tokens = [rng.randrange(1, 1000) for _ in range(n)]
    sched.add_request(Request(req_id, tokens, SamplingParams(max_tokens=12), eos_token_id=None))

log = []
step = 0
while sched.has_unfinished_requests():
    out = sched.schedule()
    parts = []
    for r in out.scheduled_requests:
        n = out.num_scheduled_tokens[r.request_id]
        if n == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
            kind = "decode"
        else:  # a preempted request recomputes its prompt and its outputs so far
            kind = "recompute" if r.num_preemptions else "prefill"
        parts.append(f"{r.request_id}:{kind}({n})")
    sampled = {r.request_id: rng.randrange(1, 1000) for r in out.scheduled_requests
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    finished = sched.update_from_output(out, sampled)
    line = f"step {step:2d} | {out.total_num_scheduled_tokens:2d} tok | " + " ".join(parts)
    if out.preempted_req_ids:
        line += f" | PREEMPTED {out.preempted_req_ids}"
    if finished:
        line += f" | finished {[r.request_id for r in finished]}"
    print(line + f" | free blocks {sched.num_free_blocks}")
    log.append((out.total_num_scheduled_tokens, sched.num_free_blocks, bool(out.preempted_req_ids)))
    step += 1

# %% [markdown]
# Read the log: in step 0 the budget of 16 tokens admits r0 whole and the first
# chunk of r1's 30-token prompt; r1 goes on in later steps *in the same batches*
# as the decodes of the others (chunked prefill keeps decodes flowing instead
# of stalling them behind a long prompt). Once the 14 blocks run out, the
# youngest running request is preempted (r3, then r2) and later re-admitted
# to recompute its prompt and the tokens it had generated (``recompute``). Note
# that nothing is admitted in a step that preempted, and that the waiting queue
# stays in order: r2 (preempted last) goes back in front of r3.

# %%
tokens, free, preempted = zip(*log)
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.bar(range(len(tokens)), tokens, color="tab:blue", label="tokens scheduled")
ax.plot(range(len(free)), free, "o-", color="tab:green", label="free blocks after the step")
for i, p in enumerate(preempted):
    if p:
        ax.axvline(i, color="tab:red", linestyle=":", label="preemption" if i else None)
ax.axhline(16, color="gray", linestyle="--", label="token budget")
ax.set_xlabel("step")
ax.legend(fontsize=8, loc="upper right")
ax.set_title("continuous batching: budget use and pool pressure")
fig.tight_layout()
fig.savefig(figure_path("01_paged_kv_cache_steps.png"), dpi=110)
print("saved 01_paged_kv_cache_steps.png")
assert any(preempted), "the demo is meant to show a preemption"
assert math.isclose(sched.num_free_blocks, 14)  # everything returned to the pool

# %% [markdown]
# **Figure 01.3.** Each scheduler step: the tokens it scheduled (bars) against the token
# budget (dashed), and the free blocks left after it (green). Look at the first steps,
# where prompts fill the whole budget, at the dotted red lines, where the pool ran dry
# and a request was preempted, and at the later bars, where the preempted requests are
# prefilled again.
#
# What you built
# --------------
#
# A paged KV cache on paper: the memory a contiguous reservation wastes against paging, the
# block allocator with reference counts, block tables and slot mappings, two requests sharing
# prefix blocks, and the real scheduler's step log with chunked prefill and a preemption.

# %% [markdown]
# The test command
# ----------------
#
# Hypothesis state machines drive the allocator, the block tables and the
# scheduler with random traffic (shared prefixes, tiny pools that force
# preemption, small budgets that force chunked prefill, aborts, impossible
# requests) and check the implementation under test against the ref twin, step
# by step; run them against the readable twins and the fast ones:
#
# .. code-block:: bash
#
#    pytest tests/test_block_allocator.py tests/test_block_table.py tests/test_scheduler.py \
#           tests/test_kv_cache_manager.py tests/test_prefix_hash.py --backend=ref
#    pytest tests/test_block_allocator.py tests/test_block_table.py tests/test_scheduler.py \
#           tests/test_kv_cache_manager.py tests/test_prefix_hash.py --backend=fast
#
# and time the two twins against each other with ``python -m minivllm.bench host``.

# %% [markdown]
# The course task
# ---------------
#
# Write the block pool yourself. ``minivllm course make-student hw`` copies every ref module into
# ``hw/minivllm_student/`` with the bodies of ``BlockAllocator.allocate``, ``free`` and ``touch``
# (task 1) and the prefix-cache methods (task 2) replaced by ``NotImplementedError``. Fill them in
# from the rules above: a shared block returns to the free queue only when its last owner frees
# it, and a freed block keeps its hash until it is recycled.
#
# Handouts (task 1 ``allocator``: :doc:`/course/01_allocator`, task 2 ``prefix_caching``: :doc:`/course/02_prefix_caching`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task allocator --task prefix_caching
