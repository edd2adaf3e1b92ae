"""
03 · Continuous batching, chunked prefill and preemption
========================================================

A static batch waits for its slowest request. vLLM's scheduler instead decides
**every step** which requests run and how many tokens each computes:

1. running requests first (a decode needs 1 token; an unfinished prompt continues its chunk),
2. then waiting requests in arrival order (FCFS), while the step's token budget
   (``max_num_batched_tokens``) and the cap on running requests (``max_num_seqs``) allow,
3. a prompt longer than what is left of the budget is **chunked** across steps,
   and its chunks share a step with other requests' decodes,
4. when the KV pool runs out, the most recently admitted request is **preempted**:
   its blocks are freed, it goes back to the front of the queue, and it is recomputed later.

We run the real engine on the real default model (SmolLM2-135M) with a deliberately
tiny KV pool and token budget, record each step's decisions, and draw them.
"""

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import LLM, SamplingParams

llm = LLM("smollm2", dtype="float32", device="cpu", block_size=8,
          max_num_batched_tokens=48,     # small budget: long prompts are chunked
          num_gpu_blocks_override=40,    # 40 blocks x 8 tokens = 320 tokens of KV cache
          max_model_len=320)             # one request may fill the pool, no more
engine = llm.llm_engine
tok = llm.get_tokenizer()

# %% [markdown]
# Eight requests with prompts of different lengths, all asking for 40 tokens. Together they
# need far more than 320 cached tokens, so the scheduler will have to preempt.

# %%
prompts = [
    "Write a haiku about the sea.",
    "Explain in detail how a CPU cache works, with examples of cache lines, "
    "associativity and eviction policies, and why it matters for performance.",
    "List three colours.",
    "What is the capital of Italy?",
    "Describe the water cycle for a ten year old, step by step.",
    "Name a prime number.",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue?",
]
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ids = []
for p in prompts:
    text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                   add_generation_prompt=True)
    ids.append(engine.add_request(p, tok.encode(text), params))
order = {rid: i for i, rid in enumerate(ids)}

steps = []  # per step: {request index: (tokens computed, was it a decode?)}, preempted, free blocks
while engine.has_unfinished_requests():
    _, stats = engine.step_with_stats()  # the outputs, and a record of what the step did
    row = {order[rid]: (n, rid in stats.decode_req_ids)
           for rid, n in stats.num_scheduled_tokens.items()}
    steps.append((row, [order[i] for i in stats.preempted_req_ids], stats.num_free_blocks))

print(f"{len(steps)} steps")
print("preemptions:", [(s, p) for s, (_, p, _) in enumerate(steps) if p])

# %% [markdown]
# The timeline
# ------------
#
# Each row is a request, each column an engine step. Wide orange cells are prefill chunks
# (their width in the colour scale is the number of prompt tokens computed in that step);
# blue cells are decodes. A red cross marks a preemption: the request disappears, and when it
# comes back it recomputes its prompt **and** the tokens it had generated (orange again).
# Underneath, the KV pool: how many of the 40 blocks are in use.

# %%
n_req, n_steps = len(prompts), len(steps)
grid = np.zeros((n_req, n_steps))
kind = np.zeros((n_req, n_steps))
for s, (row, _, _) in enumerate(steps):
    for i, (n, is_decode) in row.items():
        grid[i, s] = n
        kind[i, s] = 1 if is_decode else 2

fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                              gridspec_kw={"height_ratios": [3, 1]})
colors = np.zeros((n_req, n_steps, 3)) + 1.0
colors[kind == 1] = (0.35, 0.55, 0.85)
prefill = kind == 2
shade = np.clip(grid / grid.max(), 0.25, 1.0)
colors[prefill] = np.stack([np.ones_like(shade[prefill]), 1 - 0.6 * shade[prefill],
                            0.2 * np.ones_like(shade[prefill])], -1)
ax.imshow(colors, aspect="auto", interpolation="nearest")
for s, (_, pre, _) in enumerate(steps):
    for i in pre:
        ax.plot(s, i, "rx", ms=9, mew=2)
ax.set_yticks(range(n_req), [f"req {i}" for i in range(n_req)])
ax.set_ylabel("request")
ax.set_title("which request ran in each step (orange: prefill chunk, blue: decode, x: preempted)")
used = [40 - free for _, _, free in steps]
ax2.fill_between(range(n_steps), used, step="mid", alpha=0.6)
ax2.axhline(40, color="k", ls="--", lw=1)
ax2.set_ylabel("KV blocks used")
ax2.set_xlabel("engine step")
fig.tight_layout()
fig.savefig(figure_path("03_continuous_batching.png"), dpi=110)
print("saved 03_continuous_batching.png")

# %% [markdown]
# **Figure 03.1.** Which request ran in each engine step: orange for a prefill chunk,
# blue for a decode, a red x for a preemption. Look at the first steps, where one
# prompt's chunk shares a step with other requests' decodes, and at the red marks, after
# which the preempted request's prefill reappears.
#
# Things to notice:
#
# - In the first steps the budget of 48 tokens is shared: long prompts are split into chunks,
#   and the chunk of one request runs in the same step as the decodes of others.
# - The number of requests per step changes every step: finished requests leave at once and
#   waiting ones take their place (that is *continuous* batching).
# - When the pool is full the newest request is preempted (red x); it is recomputed later,
#   and the prefix cache may give some of its blocks back for free.

# %% [markdown]
# What you built
# --------------
#
# The real engine on SmolLM2 with a deliberately tiny KV pool and token budget, and its
# schedule drawn as a timeline: chunked prefill, decodes sharing steps with prefills,
# preemption and recompute.

# %% [markdown]
# The test command
# ----------------
#
# The scheduler's rules are tested against the reference implementation with random
# interleavings of add / step / finish / abort and tiny pools:
#
# .. code-block:: bash
#
#    pytest tests/test_scheduler.py tests/test_engine.py --backend=ref
#    pytest tests/test_scheduler.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Write ``Scheduler.schedule`` (task 5) and the KV cache manager it calls (task 4). The tests
# check the rules without the ref: the token budget, first come first served, chunked
# prefill, preemption of the newest running request, no admission in a step that
# preempted, and prefix hits that only reuse K/V computed for the very same tokens.
#
# Handouts (task 4 ``kv_cache_manager``: :doc:`/course/04_kv_cache_manager`, task 5 ``scheduler``: :doc:`/course/05_scheduler`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task kv_cache_manager --task scheduler
