"""
12 · Sharing blocks: fork and copy-on-write
===========================================

*Draft (issue 26): sections 1 to 3 run on the KV cache manager itself; section 4,
the same with the engine (``LLM.generate`` with ``n=4``, beam search), is still
to be written.*

Parallel sampling (``n`` completions of one prompt) and beam search grow
several sequences from one prefix. PagedAttention lets them share that
prefix's KV blocks, as processes share pages after a ``fork()``: each block
counts its holders, and a block is copied only when a holder is about to
write into it while others still hold it (**copy-on-write**). In this
tutorial you will:

1. fork a prompt's blocks into three completions with the real KV cache
   manager, watch the reference counts, and see the one block that has to be
   copied, and why only that one;
2. draw the block tables of a parallel-sampling group and of a beam-search
   group over time, copy-on-write events marked;
3. measure the KV memory both use against ``n`` and the beam width, with and
   without sharing.

Everything here is host-side Python and the block copy kernel: no model. It
runs in seconds on a CPU. The rules are in :doc:`/sharing`.
"""

# %%
import matplotlib

matplotlib.use("Agg")  # no display needed: figures are saved as PNGs
import matplotlib.pyplot as plt
import numpy as np
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import SamplingParams
from minivllm.bench import sharing
from minivllm.ref.block_allocator import BlockAllocator
from minivllm.ref.cache_write import copy_blocks
from minivllm.ref.kv_cache_manager import KVCacheManager
from minivllm.request import Request

# %% [markdown]
# 1. Fork, reference counts, one copy
# -----------------------------------
#
# A 6-token prompt in blocks of 4 fills one block and half of a second. The
# parent is prefilled once; its last logits give three first tokens, one per
# completion. ``fork(parent, child)`` hands each child the parent's block list
# and takes one more reference on every block: nothing is copied yet.

# %%
block_size = 4
alloc = BlockAllocator(num_blocks=12, block_size=block_size, enable_prefix_caching=False)
kv = KVCacheManager(alloc)

prompt = [11, 12, 13, 14, 15, 16]
parent = Request("p", prompt, SamplingParams(max_tokens=8))
kv.allocate_slots(parent, len(prompt))  # the prefill's blocks
parent.num_computed_tokens = len(prompt)
snapshots = [("prefill", {"p": kv.get_block_ids("p")}, [])]

children = []
for i, first_token in enumerate([31, 41]):  # the parent keeps the third first token, 21
    child = Request(f"c{i + 1}", prompt, SamplingParams(max_tokens=8))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    child.append_output_token_ids(first_token)
    children.append(child)
parent.append_output_token_ids(21)
group = [parent, *children]
snapshots.append(("fork", {r.request_id: kv.get_block_ids(r.request_id) for r in group}, []))
print("after fork:", {r.request_id: kv.get_block_ids(r.request_id) for r in group})
print("reference counts:", {b: alloc.ref_count(b) for b in kv.get_block_ids("p")})

# %% [markdown]
# Now each sequence writes its first generated token at position 6, inside the
# second block, which three sequences hold. ``allocate_slots`` sees that the
# block it is about to write is shared, gives the writer a fresh block in its
# place and records the copy ``(src, dst)``. The last writer, ``c2`` here,
# finds itself the block's only holder and writes in place: three holders,
# two copies. The first block is full: nobody writes it again, so it stays
# shared for good.

# %%
for step in range(1, 4):
    for r in group:
        kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
        r.num_computed_tokens = r.num_tokens
    copies = kv.take_blocks_to_copy()
    refresh = kv.take_req_ids_to_refresh()
    snapshots.append((f"step {step}", {r.request_id: kv.get_block_ids(r.request_id)
                                       for r in group}, copies))
    print(f"step {step}: copies {copies}, rows to rebuild {refresh}")
    for k, r in enumerate(group):  # each samples its own next token
        r.append_output_token_ids(100 * step + k)
print("reference counts:", {b: alloc.ref_count(b) for b in range(12) if alloc.ref_count(b)})

# %% [markdown]
# The copies are a kernel: every layer's K and V block ``src`` is copied to
# ``dst`` before the step's forward writes the new tokens (``copy_blocks``, in
# the ``cache_write`` component; the fast twin does all layers in one op).
# Here on a toy two-layer cache:

# %%
kv_caches = [(torch.randn(12, block_size, 2, 8), torch.randn(12, block_size, 2, 8))
             for _ in range(2)]
step1_copies = snapshots[2][2]
copy_blocks(kv_caches, torch.tensor(step1_copies, dtype=torch.int64))
src, dst = step1_copies[0]
print(f"block {dst} now equals block {src} in every layer:",
      all(torch.equal(k[dst], k[src]) and torch.equal(v[dst], v[src]) for k, v in kv_caches))

# %% [markdown]
# 2. Block tables over time
# -------------------------
#
# The figure draws the snapshots above, then a beam-search group driven by
# ``minivllm/bench/sharing.py`` (the same KV cache manager; beams propose
# tokens with random log-probabilities, the best ``width`` candidates survive,
# a beam with two survivors forks, a beam with none is freed).


# %%
def draw(ax, tables: dict, copies, title: str, rows: int = 4) -> None:
    """One snapshot: a row per sequence, a box per logical block with its physical id.

    Purple: held by more than one sequence. Red edge: the copy made this step.
    """
    holders = {}
    for blocks in tables.values():
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1
    fresh = {dst: src for src, dst in copies}
    for row, (req_id, blocks) in enumerate(tables.items()):
        y = -row
        ax.text(-0.2, y + 0.35, req_id, ha="right", va="center", fontsize=8)
        for i, b in enumerate(blocks):
            face = "tab:purple" if holders[b] > 1 else "white"
            edge, width = ("tab:red", 2.5) if b in fresh else ("black", 0.8)
            ax.add_patch(plt.Rectangle((i, y), 0.9, 0.7, facecolor=face, alpha=0.6,
                                       edgecolor=edge, linewidth=width))
            label = f"{b}" if b not in fresh else f"{b}\n<{fresh[b]}"
            ax.text(i + 0.45, y + 0.35, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(-1, max(len(b) for b in tables.values()) + 0.2)
    ax.set_ylim(-rows + 0.5, 1)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


beam = sharing.beam_search(prompt_len=6, width=4, output_len=12, block_size=block_size, seed=3)
beam_steps = [1, 2, 4, 8, 12]
fig, axes = plt.subplots(2, 5, figsize=(14, 5.5))
for ax, (title, tables, copies) in zip(axes[0], snapshots):
    draw(ax, tables, copies, f"parallel sampling, {title}")
for ax, t in zip(axes[1], beam_steps):
    draw(ax, beam.tables[t], beam.copies[t], f"beam search (width 4), step {t}")
fig.tight_layout()
fig.savefig(figure_path("12_sharing_block_tables.png"), dpi=110)
print("saved 12_sharing_block_tables.png")
print("beam search copies per step:", [len(c) for c in beam.copies])

# %% [markdown]
# **Figure 12.1.** Block tables over time: a row per sequence, a box per logical
# block labelled with its physical block; purple boxes are held by several
# sequences, a red edge is a copy-on-write destination made in that step
# (``dst<src``). Top: after the prefill the parent holds two blocks; after the
# fork three sequences hold both (purple); at step 1 the first two to write,
# ``p`` and ``c1``, copy the partial block (red), ``c2`` writes the original in
# place, and from then on only the full first block is shared. Bottom: the beam group keeps sharing more
# than the prompt: the surviving beams descend from a few ancestors, so whole
# runs of generated blocks stay purple, and each step that a beam branches
# inside a partial block shows one copy.
#
# 3. Memory against the width
# ---------------------------
#
# With the means of the paper's Alpaca trace (19-token prompts, 58-token
# outputs, 16-token blocks), the same simulation counts the blocks the pool
# holds with sharing against the blocks the same sequences would hold with a
# copy of their history each, summed over the steps (the paper's measure),
# averaged over three seeds.

# %%
widths = [1, 2, 3, 4, 6, 8]
savings = {"parallel sampling": [], "beam search": []}
for width in widths:
    par, bms = [], []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        lens = [max(1, int(rng.uniform(0.5, 1.5) * 58)) for _ in range(width)]
        par.append(sharing.parallel_sampling(19, lens, 16).saving)
        bms.append(sharing.beam_search(19, width, 58, 16, seed).saving)
    savings["parallel sampling"].append(100 * float(np.mean(par)))
    savings["beam search"].append(100 * float(np.mean(bms)))
for name, values in savings.items():
    print(f"{name:18s}", "  ".join(f"n={w}: {v:4.1f}%" for w, v in zip(widths, values)))

fig, ax = plt.subplots(figsize=(6.5, 3.8))
for name, values in savings.items():
    ax.plot(widths, values, marker="o", label=name)
ax.axhspan(6.1, 9.8, color="tab:blue", alpha=0.12, label="paper, parallel (Alpaca)")
ax.axhspan(37.6, 55.2, color="tab:orange", alpha=0.12, label="paper, beam (Alpaca)")
ax.set_xlabel("n (parallel sampling) or beam width")
ax.set_ylabel("KV blocks saved by sharing (%)")
ax.set_title("memory saved by fork + copy-on-write")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(figure_path("12_sharing_saving.png"), dpi=110)
print("saved 12_sharing_saving.png")

# %% [markdown]
# **Figure 12.2.** The share of KV blocks saved by sharing, against ``n`` or the
# beam width, for one simulated group (lines) and the ranges the paper
# reports on Alpaca with OPT-13B (bands). Look at the gap between the lines:
# parallel sampling shares only the prompt, and Alpaca's prompts are short
# next to its outputs, so the saving stays modest and flattens as the
# completions' own blocks dominate; beam search shares most of its generated
# history too, so its saving grows with the width. The simulation is one group
# in isolation, with uniform random output lengths and random beam scores, not
# the paper's trace: beam search lands in the paper's range, parallel sampling
# above it (a longer tail of output lengths would shrink the shared prompt's
# share). The shape is the point.
#
# 4. With the engine
# ------------------
#
# The engine does the same with real requests: ``SamplingParams(n=4)`` prefills
# the prompt once and forks its three siblings from it when the first token is
# sampled (``minivllm/engine/sequence_groups.py``); ``LLM.beam_search`` ranks each
# step's ``2W`` candidates per beam, forks the beams chosen twice and frees the
# ones not chosen. Below, on SmolLM2 with a 96-token prompt, the peak of KV
# blocks held (read right after each ``schedule()``) for ``n = 4`` against four
# independent requests, with prefix caching off (nothing shared) and on (the
# prompt's full blocks found in the cache), and a beam search of width 4.

# %%
from minivllm import LLM  # noqa: E402
from minivllm.bench._sharing_e2e import beam_rows, parallel_rows, print_table  # noqa: E402

kw = dict(max_model_len=160, block_size=16)
llm_plain = LLM("smollm2", enable_prefix_caching=False, **kw)
llm_cached = LLM("smollm2", enable_prefix_caching=True, **kw)
tok = llm_plain.get_tokenizer()
prompt = tok.encode("Paged attention stores the KV cache in fixed-size blocks. " * 8)[:96]
rows = parallel_rows(llm_plain, llm_cached, prompt, n=4, output_len=16)
more, same = beam_rows(llm_plain, llm_cached, prompt, width=4, output_len=8)
print_table(rows + more)
print("beam search equals the one-token-requests search:", same)
for llm in (llm_plain, llm_cached):
    llm.shutdown()

# %% [markdown]
# On a CPU, what the rows show: the ``n = 4`` group holds the prompt's 6 blocks
# once plus one block per completion (10 at its peak), while four independent
# requests hold 4 x 7 = 28 without prefix caching; with prefix caching the
# copies find the prompt's full blocks and the peak drops too, but each copy
# recomputes and keeps its own partial block. The beam search's peak is the
# shared history plus the beams' own last blocks. Throughput (tok/s) is a
# measurement of this run on a busy laptop: the prompt is short, so the
# prefill that sharing saves is a small part of the work here;
# ``minivllm bench sharing`` runs the 512-token case.

# %% [markdown]
# What you built
# --------------
#
# Parallel sampling and beam search on a paged cache. The block level: ``fork``,
# copy-on-write inside ``allocate_slots``,
# ``take_blocks_to_copy`` and ``take_req_ids_to_refresh`` are in
# ``minivllm/ref/kv_cache_manager.py``; ``copy_blocks`` in
# ``minivllm/ref/cache_write.py`` (a C++ op and a Triton kernel in
# ``minivllm/fast/``); the simulation in ``minivllm/bench/sharing.py``. The
# engine level: ``minivllm/engine/sequence_groups.py`` (the groups, the beam
# ranking) and the scheduler's ``fork_request`` / ``requeue`` /
# ``take_block_changes``.

# %% [markdown]
# The test command
# ----------------
#
# .. code-block:: bash
#
#    pytest -q tests/test_fork_cow.py tests/test_fork_cow_rules.py tests/test_fork_cow_cache.py \
#        tests/test_copy_blocks.py tests/test_bench_sharing.py --backend=ref
#    pytest -q tests/test_fork_cow.py tests/test_fork_cow_rules.py tests/test_fork_cow_cache.py \
#        tests/test_copy_blocks.py tests/test_bench_sharing.py --backend=fast
#    pytest -q tests/test_sequence_groups.py --backend=fast   # n > 1 and beam search vs HF

# %% [markdown]
# The course task
# ---------------
#
# Task 19 ``fork_cow`` (:doc:`/course/19_fork_cow`) has you write ``fork``,
# ``_shared_blocks_written`` and ``_copy_on_write`` of
# ``minivllm/ref/kv_cache_manager.py`` in your student package.
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task fork_cow
