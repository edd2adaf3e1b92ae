"""
14 · Many fine-tunes, one batch: multi-LoRA serving
===================================================

A LoRA fine-tune leaves the base model's weights alone and adds, beside each
projection ``y = x W^T``, a low-rank correction ``scaling * (x A^T) B^T`` with
``A`` of shape ``(r, in)`` and ``B`` of shape ``(out, r)``, ``r`` about 8 to 64.
A fine-tune is then a few megabytes, and one engine holding the base weights
once can serve many of them, even inside one batch: that is vLLM's
``enable_lora`` (``LoRARequest`` per request), after Punica and S-LoRA.

You will learn:

1. what an adapter is on disk (PEFT's two files) and how big it is next to the
   model;
2. how the engine keeps adapters in numbered *slots* and tells each token of a
   mixed batch which slot is its own;
3. why one batch can serve many adapters: the base matmul is shared, and the
   per-token delta is small; and how a *segmented* kernel (tokens grouped by
   adapter) computes it against the textbook loop over tokens, with a figure
   of throughput against the number of adapters in the batch.

It runs in about a minute on a laptop CPU (the first run also builds the C++
kernels). See :doc:`/lora` for the reference.
"""

# %%
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no window: the figure is saved as a PNG
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git
from safetensors.torch import save_file
from transformers import AutoConfig

from minivllm.bench.lora import PROJECTIONS, delta_flops, make_layer, time_layer
from minivllm.fast import lora as fast_lora
from minivllm.lora.manager import LoRAConfig, LoRAManager
from minivllm.lora.mapping import LoRAMapping
from minivllm.lora.models import module_name, module_shapes
from minivllm.lora.peft_format import load_adapter
from minivllm.lora.request import LoRARequest
from minivllm.model import registry
from minivllm.ref import lora as ref_lora

torch.manual_seed(0)
config = AutoConfig.from_pretrained(registry.ensure_model("smollm2"), local_files_only=True)
print("threads:", torch.get_num_threads())

# %% [markdown]
# 1 · An adapter on disk
# ----------------------
#
# PEFT (``peft.get_peft_model(...).save_pretrained(dir)``) writes two files:
# ``adapter_config.json`` (the rank ``r``, ``lora_alpha``, which modules it
# adapts) and ``adapter_model.safetensors`` with, per adapted module, the tensors
# ``base_model.model.<module path>.lora_A.weight`` ``(r, in)`` and
# ``...lora_B.weight`` ``(out, r)``. We write two such adapters for SmolLM2 by
# hand (random weights: what they say is not the point here): ``sql`` at rank 16
# on all seven projections, and ``french`` at rank 8 on ``q_proj`` and ``v_proj``
# only. (The tests make theirs with ``peft`` itself: ``tests/lora_utils.py``.)

# %%
shapes = module_shapes(config)  # module -> (in, out), e.g. q_proj: (576, 576), k_proj: (576, 192)
scratch = tempfile.TemporaryDirectory(prefix="adapters_")  # deleted when the script ends
root = Path(scratch.name)


def write_adapter(name, r, alpha, modules):
    """A PEFT LoRA directory: the config and random A, B for ``modules`` of every layer."""
    path = root / name
    path.mkdir()
    config_json = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=modules,
                       bias="none", use_rslora=False, lora_dropout=0.0)
    (path / "adapter_config.json").write_text(json.dumps(config_json, indent=1))
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in modules:
            k, n = shapes[m]
            key = f"base_model.model.{module_name(layer, m)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, k) / k**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, r) / r**0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


sql = write_adapter("sql", 16, 32, list(shapes))
french = write_adapter("french", 8, 8, ["q_proj", "v_proj"])
print(json.loads((sql / "adapter_config.json").read_text()))
base_params = 134_515_008  # SmolLM2-135M
for path in (sql, french):
    adapter = load_adapter(LoRARequest(path.name, 1, str(path)), config, max_lora_rank=16)
    numbers = sum(w.lora_a.numel() + w.lora_b.numel() for w in adapter.loras.values())
    print(f"{path.name:>6}: rank {adapter.rank}, {len(adapter.loras)} modules, scaling "
          f"{next(iter(adapter.loras.values())).scaling}, {numbers / 1e6:.2f} M numbers "
          f"= {100 * numbers / base_params:.1f}% of the base model")

# %% [markdown]
# ``load_adapter`` checks everything at load time, never during a step: a
# missing path, a rank above ``max_lora_rank``, a shape that does not fit the
# model, a target it cannot adapt (embeddings, the LM head) and every PEFT
# option that changes the maths without being implemented (DoRA, biases ...),
# each refused by name. Here, a rank above the limit:

# %%
try:
    load_adapter(LoRARequest("sql", 1, str(sql)), config, max_lora_rank=8)
except ValueError as e:
    print("ValueError:", e)

# %% [markdown]
# 2 · Slots, and each token's slot
# --------------------------------
#
# The adapters a step needs sit in ``max_loras`` numbered *slots* on the device:
# per layer and projection one stacked tensor of every slot's ``A`` and one of
# every slot's ``B`` (transposed), zero-padded to ``max_lora_rank``. A manager
# fills them from a cache of loaded adapters (least recently used out) and, each
# step, turns "request ``i`` uses adapter ``X``" into "token ``t`` uses slot
# ``s``" (``-1``: the base model alone), grouped by slot for the kernel. Five
# requests, some on ``sql``, some on ``french``, one on none:

# %%
manager = LoRAManager(config, LoRAConfig(max_loras=2, max_lora_rank=16))
req_sql, req_fr = LoRARequest("sql", 1, str(sql)), LoRARequest("french", 2, str(french))
requests = [req_sql, None, req_fr, req_sql, req_fr]
num_tokens = [3, 2, 1, 1, 1]  # a prefill chunk of 3, a chunk of 2, three decodes
batch = manager.prepare_step(requests, num_tokens)
m = batch.mapping
print("slots          :", manager.resident())
print("token_slots    :", m.token_slots.tolist())
print("sorted_tokens  :", m.sorted_tokens.tolist(), " segments", m.seg_starts.tolist(),
      "of slots", list(m.slots))
stack = batch.stack(0, "qkv_proj")
print("qkv_proj stack : lora_a", [tuple(a.shape) for a in stack.lora_a],
      "\n                 scalings of slot 1 (french) per slice q, k, v:",
      [s[1].item() for s in stack.scalings])

# %% [markdown]
# ``french`` adapts ``q`` and ``v`` only, so its ``k`` slice has scaling 0 and the
# kernels skip it. The model's projections are *fused* (``qkv_proj`` is one
# matmul for q, k and v), so the delta is added per output slice of the fused
# output, each slice with its own ``A`` and ``B``.
#
# 3 · Why one batch can serve many adapters
# -----------------------------------------
#
# The base projection ``x W^T`` is one matmul for every token of the batch,
# whichever adapter it uses: that is where almost all the work is. The delta
# costs ``2 r (in + out)`` flops per token and projection against the base's
# ``2 in out``:

# %%
base = sum(k * n for k, slices in PROJECTIONS.values() for n in slices)
delta = delta_flops(1, 16) / 2
print(f"one SmolLM2 layer, per token: base {2 * base / 1e6:.2f} MFLOP, "
      f"rank-16 delta {2 * delta / 1e6:.3f} MFLOP ({100 * delta / base:.1f}% of the base)")

# %% [markdown]
# So the question is only how well the delta is computed. The textbook version
# (``minivllm/ref/lora.py``) takes one token at a time, re-reading its adapter's
# ``A`` and ``B`` for every token. The segmented version
# (``minivllm/fast/lora.py``: a C++ op here, Triton kernels on a GPU) takes the
# tokens *grouped by adapter*, as the mapping above hands them over, reads each
# adapter's weights once per group, and turns the per-token products into small
# matrix products (Punica's SGMV). First, they agree:

# %%
layer = make_layer(16, torch.float32, "cpu", max_loras=8)
x = torch.randn(64, 576)
mapping = LoRAMapping.build(torch.randint(-1, 8, (64,)).tolist())
p = layer["qkv_proj"]
outs = []
for impl in (ref_lora, fast_lora):
    y = torch.zeros(64, 960)
    impl.add_lora(y, x, p["lora_a"], p["lora_b"], p["scalings"], mapping, p["output_slices"])
    outs.append(y)
print("max |loop - segmented| on a mixed batch of 64 tokens:",
      f"{(outs[0] - outs[1]).abs().max().item():.1e}")

# %% [markdown]
# Now the throughput of one layer's delta (all four projections, seven slices)
# for a batch of 64 tokens spread over 1 to 64 distinct adapters, beside the
# layer's base projections themselves (the work the delta rides on):

#
# One thread: the benchmark then times the thread's own CPU time, which other
# programs on the machine do not inflate (with several threads a busy machine
# makes them wait for each other, and wall-clock times mean little).

# %%
torch.set_num_threads(1)
counts = [1, 2, 4, 8, 16, 32, 64]
layer = make_layer(16, torch.float32, "cpu", max_loras=max(counts))
rows = [time_layer(layer, 64, n, torch.float32, "cpu") for n in counts]
for n, r in zip(counts, rows):
    print(f"{n:>2} adapters: loop {r['ref_ms']:7.2f} ms  segmented {r['fast_ms']:6.3f} ms "
          f"({r['ref_ms'] / r['fast_ms']:5.1f}x)  base projections {r['base_ms']:6.2f} ms")

fig, ax = plt.subplots(figsize=(6.4, 4))
tok_s = lambda ms: 64 / (ms * 1e-3)  # noqa: E731  tokens of the batch per second, one layer
ax.plot(counts, [tok_s(r["ref_ms"]) for r in rows], "o-", label="delta: loop over tokens (ref)")
ax.plot(counts, [tok_s(r["fast_ms"]) for r in rows], "s-", label="delta: segmented (fast)")
ax.plot(counts, [tok_s(r["base_ms"]) for r in rows], "k--", label="base projections alone")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("distinct adapters in a batch of 64 tokens")
ax.set_ylabel("tokens / s through one layer")
ax.set_title("SmolLM2 layer, rank 16, float32, this CPU")
ax.legend()
fig.tight_layout()
fig.savefig(figure_path("14_lora_throughput.png"), dpi=120)

# %% [markdown]
# What the figure shows, as measured on the 2-core development machine (one
# thread, one run, other jobs running; the rows printed above are this run's).
# The loop over tokens cost 18 to 44 ms per layer whatever the mix, since it
# reads an adapter for every token either way: two to three times the base
# projections it rides on (about 13 to 17 ms). The segmented kernel was 35x
# faster than the loop with one adapter, where the 64 tokens form one segment,
# and the delta then cost 7% of the base projections. Each added adapter
# shrinks the segments and brings its own weights (0.65 MB per layer at rank
# 16 in float32) from memory instead of cache, so its line falls: at 8 adapters
# the delta cost about a fifth of the base, at 64 adapters for 64 tokens (every
# token its own adapter: Punica's gathered BGMV case) about half, still 5x
# faster than the loop. A mixed batch is cheap as long as each adapter serves
# several of its tokens.
#
# 4 · Two adapters in one engine
# ------------------------------
#
# ``LLM(..., enable_lora=True)`` loads each adapter the first time a request
# names it (on every rank), keeps up to ``max_loras`` of them in slots, and
# hooks every fused projection of the model so that a step's tokens each get
# their own adapter's delta (``minivllm/lora/layers.py``). One ``generate``
# call mixes the two adapters above and the base model in one batch; each
# output must equal the same prompt run alone under its adapter.

# %%
from minivllm import LLM, SamplingParams  # noqa: E402

llm = LLM("smollm2", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
params = SamplingParams(max_tokens=8, temperature=0)
prompts = ["SELECT", "Bonjour", "Hello"]
loras = [req_sql, req_fr, None]
batched = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
for prompt, lora, out in zip(prompts, loras, batched):
    alone = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    print(f"{lora.lora_name if lora else 'base':>7}: {prompt!r} -> {out.outputs[0].text!r}")
llm.shutdown()

# %% [markdown]
# The adapters here have random weights, so their texts are nonsense, but
# different nonsense: each row is its own model's greedy continuation, computed
# in one batch. Engine behaviour worth knowing (docs/lora.md): at most
# ``max_loras`` distinct adapters are held by the scheduler at once (a request
# for another waits), the prefix cache keys each block by its adapter, and a
# step with adapters runs the model's own forward (the C++ layer stack does not
# add them).

# %% [markdown]
# What you built
# --------------
#
# Nothing new in code: a look at an adapter's files and size, the slots and the
# token -> slot map a step hands the model, a measurement of why a segmented
# kernel makes mixed batches cheap, and one batch serving three models. The code
# is in ``minivllm/lora/`` (reader, manager, mapping, tensor-parallel shards, the
# projection hooks), ``minivllm/engine/lora_requests.py`` (the engine's side),
# ``minivllm/ref/lora.py``
# (the loop) and ``minivllm/fast/lora.py`` + ``minivllm/fast/csrc/lora.cpp``
# (the segmented kernels).

# %% [markdown]
# The test command
# ----------------
#
# The kernels against a float64 oracle (and each other), the reader and the
# whole delta against ``peft`` itself on tiny Llama and Qwen2 models, the
# manager as a state machine, tensor parallelism with every rank simulated:
#
# .. code-block:: bash
#
#    pytest -q tests/test_lora_kernels.py tests/test_lora_peft.py tests/test_lora_loader.py \
#        tests/test_lora_manager.py tests/test_lora_tp.py --backend=ref
#    pytest -q tests/test_lora_kernels.py tests/test_lora_peft.py --backend=fast
#    pytest -q tests/test_lora_engine.py --backend=fast   # the engine against peft

# %% [markdown]
# The course task
# ---------------
#
# Task 21 ``lora_delta`` (:doc:`/course/21_lora_delta`) has you write
# ``add_lora`` of ``minivllm/ref/lora.py`` in your student package: the delta for
# a batch of tokens with mixed adapters, slice by slice of a fused projection.
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task lora_delta
