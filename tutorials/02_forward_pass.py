"""
02 · One forward pass over a paged KV cache
===========================================

In this tutorial you will:

1. build a tiny random Llama and load it with minivllm's loader;
2. lay out a **paged KV cache** and fill in the ``AttentionMetadata`` that tells
   the model where each token's keys and values go;
3. run a **prefill** of two prompts in one flat batch, then **decode** steps,
   and a **chunked prefill** that continues on top of cached tokens;
4. check every logit against transformers, which runs the same weights with
   no cache at all;
5. read keys back out of the scattered cache blocks to draw the attention
   pattern of a chunk that attends to a cached prefix.

It runs on a CPU in a few seconds.
"""

# %%
import math
import random
import tempfile

import matplotlib

matplotlib.use("Agg")  # no display needed: the figure is saved as a PNG
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git
from transformers import AutoModelForCausalLM, LlamaConfig

from minivllm.metadata import AttentionMetadata
from minivllm.model import load_model
from minivllm.ref.attention import gather_kv

torch.manual_seed(0)

# %% [markdown]
# 1. A tiny random Llama, saved like any HF checkpoint
# ----------------------------------------------------
#
# Two layers, 4 query heads sharing 2 KV heads (grouped-query attention),
# head_dim 16. We randomise every weight (HF's init would give almost flat
# logits) and save it with ``save_pretrained``: a ``config.json`` and a
# ``model.safetensors``, exactly the files a real model ships with.

# %%
config = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, architectures=["LlamaForCausalLM"])
hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
with torch.no_grad():
    for name, p in hf.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.3 * torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1] if "embed" not in name else 1))
hf.eval()
scratch = tempfile.TemporaryDirectory(prefix="tiny_llama_")  # deleted when the script ends
model_dir = scratch.name
hf.save_pretrained(model_dir)

# Our loader reads the safetensors lazily and fuses q/k/v and gate/up as it goes
# (`build_model(config)` then `model.load_weights(iterate_safetensors(model_dir))`).
# This directory has no tokenizer files, so `tokenizer` is None: we use token ids.
# The engine calls the same function; `load_model("smollm2")` loads the default model.
model, _, tokenizer = load_model(model_dir)
qkv = model.model.layers[0].self_attn.qkv_proj
print("fused qkv_proj weight:", tuple(qkv.weight.shape))  # q, k and v in ONE matmul

# %% [markdown]
# 2. The paged KV cache
# ---------------------
#
# Each layer owns two tensors ``(num_blocks, block_size, num_kv_heads, head_dim)``.
# A sequence does not get one contiguous region: it gets a *list* of blocks,
# its **block table**, taken from a shuffled free list, so its tokens are
# scattered over the pool. Token at position ``p`` of a sequence lives in block
# ``block_table[p // block_size]``, at offset ``p % block_size``; its **slot** is
# ``block * block_size + offset``.

# %%
block_size, num_blocks = 4, 32
attn = model.model.layers[0].self_attn
kv_caches = [
    (torch.zeros(num_blocks, block_size, attn.num_kv_heads, attn.head_dim),
     torch.zeros(num_blocks, block_size, attn.num_kv_heads, attn.head_dim))
    for _ in model.model.layers
]
free_blocks = list(range(num_blocks))
random.Random(0).shuffle(free_blocks)
block_tables: dict[str, list[int]] = {}
num_computed: dict[str, int] = {}


def step(chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
    """One forward pass over the new tokens of several sequences, in ONE flat batch."""
    ids, positions, slots, query_start_loc, seq_lens, tables = [], [], [], [0], [], []
    for seq, tokens in chunks:
        start = num_computed.get(seq, 0)  # tokens already in the cache
        end = start + len(tokens)
        table = block_tables.setdefault(seq, [])
        while len(table) * block_size < end:  # allocate blocks on demand
            table.append(free_blocks.pop())
        ids += tokens
        positions += range(start, end)  # each token's position in ITS sequence
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_start_loc.append(query_start_loc[-1] + len(tokens))
        seq_lens.append(end)
        tables.append(table)
        num_computed[seq] = end
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata.build(
        query_lens=[len(t) for _, t in chunks],
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, metadata)
        logits = model.compute_logits(hidden)  # (num_tokens, vocab) float32
    return list(logits.split([len(t) for _, t in chunks]))


# %% [markdown]
# 3. Prefill two prompts together, then decode
# --------------------------------------------
#
# The batch is the two prompts concatenated: no padding. ``query_start_loc``
# tells attention where each sequence's rows start; everything else in the
# model (norms, MLPs, projections) is per token and never needs to know.
#
# The oracle is transformers run on each *whole* sequence at once, without any
# cache. Every row of our logits must match the row at the same position.

# %%
prompts = {"a": torch.randint(0, 200, (9,)).tolist(), "b": torch.randint(0, 200, (5,)).tolist()}
outputs = step(list(prompts.items()))
tokens = {seq: list(p) for seq, p in prompts.items()}
diffs = []


def check(seq: str, ours: torch.Tensor) -> float:
    """Max |ours - transformers| over the rows we just computed for ``seq``."""
    with torch.no_grad():
        ref = hf(torch.tensor([tokens[seq]])).logits[0]  # the whole sequence, no cache
    n = ours.shape[0]
    return (ours - ref[len(tokens[seq]) - n:]).abs().max().item()


diffs.append(max(check(s, o) for s, o in zip(prompts, outputs)))
for _ in range(6):  # greedy decode: one new token per sequence per step
    new = {seq: int(out[-1].argmax()) for seq, out in zip(tokens, outputs)}
    for seq, t in new.items():
        tokens[seq].append(t)
    outputs = step([(seq, [t]) for seq, t in new.items()])
    diffs.append(max(check(s, o) for s, o in zip(tokens, outputs)))
print("max |logit diff| per step:", [f"{d:.1e}" for d in diffs])
print("block tables:", block_tables)

# %% [markdown]
# 4. Chunked prefill: a prompt in pieces, on top of its own cache
# ---------------------------------------------------------------
#
# A long prompt may be split across steps. The second chunk's queries sit at
# positions 8..13 and must see the 8 cached tokens of the first chunk plus,
# causally, each other. Here it shares the batch with a decode of "a".

# %%
tokens["c"] = torch.randint(0, 200, (14,)).tolist()
out_c1 = step([("c", tokens["c"][:8])])[0]
with torch.no_grad():
    ref_c = hf(torch.tensor([tokens["c"]])).logits[0]  # all 14 tokens at once
diffs.append((out_c1 - ref_c[:8]).abs().max().item())
next_a = int(outputs[0][-1].argmax())
tokens["a"].append(next_a)
out_a, out_c2 = step([("a", [next_a]), ("c", tokens["c"][8:])])
diffs += [check("a", out_a), check("c", out_c2)]
print(f"chunk 1: {diffs[-3]:.1e}, decode a: {diffs[-2]:.1e}, chunk 2: {diffs[-1]:.1e}")
assert max(diffs) < 1e-4, "our paged forward disagrees with transformers"

# %% [markdown]
# 5. Reading the cache back: the attention of chunk 2
# ---------------------------------------------------
#
# ``gather_kv`` copies a sequence's keys out of its scattered blocks, in order.
# With layer 0's keys and the queries of chunk 2 we can recompute its attention
# probabilities: rows are the 6 new tokens, columns all 14 positions. The first
# 8 columns (the cached prefix) are fully visible; the rest is causal.

# %%
layer = model.model.layers[0]
with torch.no_grad():
    x = layer.input_layernorm(model.model.embed_tokens(torch.tensor(tokens["c"][8:])))
    q, k, _ = layer.self_attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
    q = q.reshape(6, attn.num_heads, attn.head_dim)
    q, _ = layer.self_attn.rotary_emb(torch.arange(8, 14), q, k.reshape(6, -1, attn.head_dim))
    table = torch.tensor([block_tables["c"]], dtype=torch.int32)
    keys = gather_kv(kv_caches[0][0], table, 14)[0]  # (14, H_kv, D) read from the pages
    group = attn.num_heads // attn.num_kv_heads
    scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(group, dim=1)) * attn.scale
    causal = torch.arange(14)[None, :] <= torch.arange(8, 14)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(0)  # mean over heads

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.imshow(probs, cmap="viridis", aspect="auto")
ax1.axvline(7.5, color="white", linestyle="--")
ax1.set_xlabel("key position (left of the line: cached by chunk 1)")
ax1.set_ylabel("query (chunk 2, positions 8..13)")
ax1.set_yticks(range(6), labels=range(8, 14))
ax1.set_title("layer 0 attention, read back from paged blocks")
ax2.semilogy(range(len(diffs)), [max(d, 1e-9) for d in diffs], "o-")
ax2.axhline(1e-4, color="red", linestyle=":", label="test tolerance")
ax2.set_xlabel("forward call (prefill, 6 decodes, chunk 1, decode, chunk 2)")
ax2.set_ylabel("max |logits - transformers|")
ax2.set_title("agreement with transformers (fp32)")
ax2.legend()
fig.tight_layout()
fig.savefig(figure_path("02_forward_pass.png"), dpi=110)
print("saved 02_forward_pass.png")

# %% [markdown]
# **Figure 02.1.** Left: layer 0's attention weights, computed from K/V read back out of
# the paged blocks; right: the largest logit difference from transformers at each step.
# Look at the causal triangle on the left and at the right-hand scale: every step agrees
# to about 1e-6 in float32.
#
# What you built
# --------------
#
# A tiny random Llama saved as a Hugging Face checkpoint, loaded by minivllm's loader (q/k/v
# and gate/up fused), and one prefill plus decode steps over a paged KV cache whose logits
# match transformers' to about 1e-6.

# %% [markdown]
# The test command
# ----------------
#
# The same checks, on Llama / Qwen2 / Qwen3 / Mistral variants (GQA, q/k/v bias,
# q/k norm, head dims 16-40, tied embeddings), block sizes 1, 3, 16, 32 and
# mixed prefill/decode batches:
#
# .. code-block:: bash
#
#    pytest -q tests/test_model.py tests/test_rope.py tests/test_loader.py --backend=ref
#    pytest -q tests/test_model.py tests/test_rope.py tests/test_loader.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Write RMSNorm (task 6) and RoPE (task 8) in your student package. Put epsilon inside the
# square root (the tests include rows small enough for it to matter) and pair feature ``i``
# with ``i + rotary_dim / 2`` in NeoX style. Then run the whole model on your kernels:
# ``PYTHONPATH=hw minivllm generate --backend minivllm_student "The capital of France is"``.
#
# Handouts (task 6 ``rms_norm``: :doc:`/course/06_rms_norm`, task 8 ``rope``: :doc:`/course/08_rope`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task rms_norm --task rope
