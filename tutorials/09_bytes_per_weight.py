"""
09 · Bytes per weight: quantization and the batch-1 roofline
============================================================

One person chatting with a model on a laptop runs at batch 1. Each decode step
then reads *every weight of the model once* and does two flops with it, far too
few to keep the arithmetic units busy: the step is bound by memory bandwidth, and

.. code-block:: text

   decode tok/s  <=  read bandwidth (bytes/s)  /  weight bytes read per token.

So the way to decode faster is to read fewer bytes per weight. This tutorial:

1. measures this machine's read bandwidth;
2. counts SmolLM2's weight bytes per token in float32, bf16, int8 and 4-bit, and
   turns them into a roofline;
3. measures the quantized matmul kernels and the real batch-1 decode speed
   beside it (``LLM(..., quantization="w8a16" | "w4a16" | "gguf-a16")``, and the
   W8A8 schemes, whose activations are int8 too: ``"w8a8" | "w4a8" | "gguf-a8"``);
4. measures what quantization costs in quality: perplexity on a fixed text and
   greedy agreement with bf16.

The formats are in ``minivllm/ref/quantization.py`` (read its docstring) and
:doc:`/quantization`. It runs in about a minute on a laptop CPU (the first run
also builds the C++ kernels).
"""

# %%
import time

import matplotlib

matplotlib.use("Agg")  # no window: the figure is saved as a PNG
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import LLM, SamplingParams, backend
from minivllm.bench.quality import TEXT, greedy_agreement, perplexity

torch.manual_seed(0)
print("threads:", torch.get_num_threads())


def best_of(fn, repeats=5):
    """The fastest of a few runs, in seconds (the least disturbed by other work)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# %% [markdown]
# 1 · Read bandwidth
# ------------------
#
# Summing a tensor much larger than the caches reads every byte once and does
# almost no arithmetic: its bytes / time is the read bandwidth the decode step can
# hope for.

# %%
big = torch.ones(64 * 2**20)  # 256 MB of float32
big.sum()  # warm up (page faults, thread pool)
read_gbs = big.numel() * 4 / best_of(big.sum) / 1e9
print(f"read bandwidth: {read_gbs:.1f} GB/s")
del big

# %% [markdown]
# 2 · Weight bytes per token, and the roofline
# --------------------------------------------
#
# SmolLM2-135M: 30 decoder layers, each with the projections ``qkv_proj``
# (576 -> 960), ``o_proj`` (576 -> 576), ``gate_up_proj`` (576 -> 3072) and ``down_proj``
# (1536 -> 576), plus the LM head (576 -> 49152, tied to the embedding). The
# quantized formats store the projections in 8 or 4 bits, and the LM head in int8
# (per output channel, as llama.cpp's files keep their output head 8-bit).
#
# - int8, one float32 scale per output channel: ~1 byte a weight;
# - 4-bit, groups of 32 with a float32 scale and minimum: 0.5 + 8/32 = 0.75 byte
#   (llama.cpp's Q4_1 keeps them in fp16: 0.625; so does ``quantization="gguf"``,
#   whose integer kernels read the file's fp16 scales as they are).

# %%
layers, hidden, inter, qkv, vocab = 30, 576, 1536, 960, 49152
proj = layers * (hidden * qkv + hidden * hidden + hidden * 2 * inter + inter * hidden)
head = vocab * hidden
bytes_per_token = {
    "float32": 4 * (proj + head),
    "bfloat16": 2 * (proj + head),
    "int8": 1 * proj + 4 * layers * (qkv + hidden + 2 * inter + hidden) + head + 4 * vocab,
    "int4": 0.75 * proj + head + 4 * vocab,
}
roofline = {k: read_gbs * 1e9 / b for k, b in bytes_per_token.items()}
print(f"projection weights {proj / 1e6:.1f} M, LM head {head / 1e6:.1f} M")
for k, b in bytes_per_token.items():
    print(f"{k:>9}: {b / 1e6:6.1f} MB per token -> roofline {roofline[k]:6.0f} tok/s")

# %% [markdown]
# **The KV cache joins the weights at a long context.** A decode step also reads the
# keys and values of every token its sequence has cached: for SmolLM2, 30 layers x K
# and V x 3 KV heads x 64 values, 46 KB a token in float32, 23 KB in bf16, and 12 KB
# with ``kv_cache_dtype="int8"`` or ``"fp8"`` (one byte a value plus a float32 scale
# per token and KV head, :doc:`/kv_cache`). At 4,096 tokens that is 189 MB a step in
# float32, more than the bf16 weights: the roofline then falls for every weight format,
# and an 8-bit cache lifts it back part of the way.

# %%
context = 4096
kv_bytes_per_token = {"float32 KV": 2 * layers * 3 * 64 * 4, "bfloat16 KV": 2 * layers * 3 * 64 * 2,
                      "int8 KV": 2 * layers * 3 * (64 + 4)}
for k, b in kv_bytes_per_token.items():
    with_kv = read_gbs * 1e9 / (bytes_per_token["bfloat16"] + context * b)
    print(f"{k:>11}: {context * b / 1e6:6.1f} MB per step at {context} tokens -> roofline "
          f"with bf16 weights {with_kv:5.0f} tok/s")
roofline_4k = {kv: {w: read_gbs * 1e9 / (b + context * kv_b) for w, b in bytes_per_token.items()}
               for kv, kv_b in kv_bytes_per_token.items() if kv != "bfloat16 KV"}

# %% [markdown]
# The LM head is a fifth of the model and stays 8-bit in both quantized formats,
# so 4-bit is not 2.7x faster than bf16 at the roofline: the head's bytes only halve.
# (Left in float32, the CPU default dtype on a machine without bf16 dot products,
# the head alone, 113 MB, would outweigh all the 4-bit projections, 80 MB.)

# %% [markdown]
# 3 · The kernels
# ---------------
#
# The fast twin (``minivllm/fast/csrc/quant.cpp``) never writes a float weight to
# memory: it reads each quantized row once and widens the integers in registers.
# Its *effective* bandwidth is the quantized bytes it reads per second. Here it
# runs at M = 1 on 48 different ``gate_up_proj``-sized weights (3072 x 576) in turn,
# so that, as in a real decode step, the weights come from memory and not from
# the caches (48 of them are 64 MB even in 4 bits), beside bf16's ``F.linear`` on
# the same weights (torch's own kernel: how close it comes to the read bandwidth
# depends on the CPU).

# %%
quant = backend.get("quantization", "fast")
x = torch.randn(1, 576)
x_bf16 = x.bfloat16()
stack = [torch.randn(3072, 576) for _ in range(48)]
formats = {"bfloat16": [w.bfloat16() for w in stack]}
formats.update({m: [quant.quantize(w, m) for w in stack] for m in ("int8", "int4")})
del stack


def sweep(ws):
    for w in ws:
        if isinstance(w, torch.Tensor):
            torch.nn.functional.linear(x_bf16, w)
        else:
            quant.quantized_linear(x, w)


kernel_gbs = {}
for name, ws in formats.items():
    nbytes = sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
                 for w in ws)
    kernel_gbs[name] = nbytes / best_of(lambda ws=ws: sweep(ws), 10) / 1e9
for k, v in kernel_gbs.items():
    print(f"{k:>9} GEMV at M=1: {v:5.1f} GB/s ({v / read_gbs:.0%} of the read bandwidth)")
del formats

# %% [markdown]
# 4 · Batch-1 decode, and quality
# -------------------------------
#
# One engine per format: ``quantization="w8a16"`` and ``"w4a16"`` quantize the bf16
# projections at load; ``"gguf-a16"`` loads the Q4_1 blocks shipped in SmolLM2's ``.gguf``
# file as they are (no dequantize-requantize round trip). Their ``a8`` twins
# (``"w8a8"``, ``"w4a8"``, ``"gguf-a8"``; a bare ``"int8"``, ``"int4"`` or ``"gguf"``
# means those) store the same weights and round each token's activations to int8
# too, then multiply with integer dot products. Decode speed is the
# difference between generating 33 tokens and 1 token (the prefill), greedy.
# Quality: perplexity on a fixed paragraph, and the fraction of positions where
# the argmax next token matches bf16's.

# %%
# (name, dtype, quantization=, the byte count of section 2 it reads)
runs = [("float32", "float32", None, "float32"), ("bfloat16", "bfloat16", None, "bfloat16"),
        ("int8 W8A16", "bfloat16", "w8a16", "int8"), ("int8 W8A8", "bfloat16", "w8a8", "int8"),
        ("int4 W4A16", "bfloat16", "w4a16", "int4"), ("int4 W4A8", "bfloat16", "w4a8", "int4"),
        ("Q4_1 A16", "bfloat16", "gguf-a16", "int4"), ("Q4_1 A8", "bfloat16", "gguf-a8", "int4")]
decode_tok_s, quality = {}, {}
prompt = {"prompt_token_ids": list(range(100, 164))}
for name, dtype, q, _ in runs:
    llm = LLM("smollm2", dtype=dtype, quantization=q, max_num_seqs=1, max_model_len=1024,
              kv_cache_memory=64 << 20)  # one short sequence: a small KV pool

    def gen(n, llm=llm):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(prompt, sp, use_tqdm=False)

    t1, t33 = best_of(gen(1), 2), best_of(gen(33), 2)
    decode_tok_s[name] = 32 / (t33 - t1)
    model = llm.llm_engine.executor.worker.model
    quality[name] = perplexity(model, llm.get_tokenizer().encode(TEXT))
    print(f"{name}: {decode_tok_s[name]:.1f} decode tok/s, perplexity {quality[name][0]:.3f}",
          flush=True)
    llm.shutdown()

base_ppl, base_argmax = quality["bfloat16"]
print(f"{'':>10} {'decode tok/s':>12} {'perplexity':>10} {'vs bf16':>8} {'greedy agree':>12}")
for name, _, _, _ in runs:
    ppl, argmax = quality[name]
    print(f"{name:>10} {decode_tok_s[name]:12.1f} {ppl:10.3f} {ppl / base_ppl - 1:+8.2%} "
          f"{greedy_agreement(argmax, base_argmax):12.1%}")

# %% [markdown]
# llama.cpp's own batch-1 decode, where its tools are built
# ----------------------------------------------------------
#
# The yardstick of :doc:`/benchmarks` is llama.cpp's own ``llama-bench`` on the same
# weights (F32, BF16, Q8_0 and the shipped Q4_1). Where its tools are built
# (``minivllm bench llamacpp --build DIR``, about 4 minutes, then
# ``MINIVLLM_LLAMACPP_DIR=DIR``), this cell runs ``tg32`` on each file with our
# thread count; elsewhere (the book's build machine) it says so and the figure
# shows minivllm's points alone.

# %%
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from minivllm.bench.llamacpp import find_gguf, find_tool, gguf_variants, llama_bench  # noqa: E402
from minivllm.model.loader import resolve_model_path  # noqa: E402

llamacpp_tok_s = {}  # our format's name -> llama.cpp's decode tok/s on the same weights
build_dir = os.environ.get("MINIVLLM_LLAMACPP_DIR")
try:
    find_tool("llama-bench", build_dir)
    find_tool("llama-quantize", build_dir)
except SystemExit:
    print("llama.cpp's tools are not built here: the figure shows minivllm alone")
else:
    files = gguf_variants(find_gguf("smollm2", resolve_model_path("smollm2")),
                          Path(build_dir or ".") / "gguf", build_dir)
    for name, fmt in {"float32": "F32", "bfloat16": "BF16", "int8 W8A8": "Q8_0",
                      "Q4_1 A8": "Q4_1"}.items():
        llamacpp_tok_s[name] = llama_bench(files[fmt], 0, 32, torch.get_num_threads(), 1,
                                           build_dir)["tg32"]
        print(f"llama.cpp {fmt}: {llamacpp_tok_s[name]:.1f} decode tok/s "
              f"(minivllm {name}: {decode_tok_s[name] / llamacpp_tok_s[name]:.2f}x)")

# %% [markdown]
# 5 · The figure
# --------------
#
# Bars: the measured batch-1 decode tok/s; dots: the roofline from section 2 (the
# Q4_1 rows share int4's byte count, and each A8 row its A16 twin's). The lines printed under the figure put
# numbers on it: each format's share of its roofline, and its speed and perplexity
# against bf16.

# %%
names = [r[0] for r in runs]
roof = [roofline[r[3]] for r in runs]
fig, ax = plt.subplots(figsize=(9, 4))
ax.bar(names, [decode_tok_s[n] for n in names], color="tab:blue", label="measured decode")
ax.plot(names, roof, "o", color="tab:red", label="roofline (bandwidth / bytes)")
for (kv, roofs), marker in zip(roofline_4k.items(), ("v", "^")):  # + a 4k-token KV cache
    ax.plot(names, [roofs[r[3]] for r in runs], marker,
            color="tab:gray", fillstyle="none", label=f"roofline at {context} tokens, {kv}")
if llamacpp_tok_s:  # llama.cpp's own decode on the same weights, where built
    ax.plot(list(llamacpp_tok_s), list(llamacpp_tok_s.values()), "kx", markersize=9,
            label="llama.cpp (llama-bench tg32)")
ax.set_ylabel("tokens / s at batch 1")
ax.set_yscale("log")
ax.set_title(f"SmolLM2-135M decode on a CPU ({read_gbs:.0f} GB/s read)")
ax.tick_params(axis="x", labelrotation=30)
ax.legend()
fig.tight_layout()
fig.savefig(figure_path("09_bytes_per_weight.png"), dpi=120)
print("wrote 09_bytes_per_weight.png")
for name, r in zip(names, roof):
    print(f"{name:>10}: {decode_tok_s[name] / r:4.0%} of its roofline, "
          f"{decode_tok_s[name] / decode_tok_s['bfloat16']:.2f}x bf16's decode speed, "
          f"perplexity {quality[name][0] / base_ppl - 1:+.2%} against bf16")
print("fastest at batch 1 here:", max(names, key=decode_tok_s.get))

# %% [markdown]
# **Figure 09.1.** SmolLM2-135M's batch-1 decode speed in each weight format
# (bars, log scale), beside the roofline that this machine's read bandwidth and
# the format's weight bytes per token allow (dots; the hollow triangles: the same
# roofline once each step also reads a 4,096-token KV cache, in float32 or in int8
# with its scales). Black crosses, where llama.cpp's tools are built: llama.cpp's own
# batch-1 decode on the same weights (the book's build machine has none, so its copy
# of the figure shows minivllm alone). Look at the gap between each
# bar and its dot, and at whether the bars grow as the bytes shrink. Where a bar
# sits far below its dot, the weight reads are not what the step waits on: at 135M
# parameters they take only milliseconds, and the rest (attention, norms, per-op
# dispatch, the Python engine loop) does not shrink with the weights; the closer
# the bars come to their dots, the more the smaller formats gain. On a busy machine
# the bars also move from run to run; the roofline is the part that does not.

# %% [markdown]
# **Why W8A8 helps at batch 64 but not at batch 1.** Each A8 bar shares its A16
# twin's dot: the two read the same weight bytes (the activations, a few KB a token,
# are not the traffic), and at batch 1 bytes are what the step waits on, so the pairs
# of bars are level up to noise. Integer dot products save *instructions*, not bytes:
# one ``vpmaddubsw`` multiplies 32 int8 pairs (``vpdpbusd`` with VNNI), where the
# W8A16 kernel first widens every 8 weights to float (load, sign-extend, convert) and
# then runs its FMAs. At batch 64 every weight byte read serves 64 rows of
# activations, 128 flops a byte, and the step is bound by arithmetic instead: there
# the A8 kernels run 1.2-1.5x (int8 weights) and 1.6-1.9x (4-bit) faster than the A16 ones on
# this kind of CPU (``python -m minivllm.bench quant_kernels --w8a8``; the maths and
# the kernels are in :doc:`/quantization`, "W8A8"). That is why llama.cpp quantizes the
# activations of every quantized matmul, and why minivllm makes int8 activations the
# default wherever they cost under 1% perplexity.
#
# **VNNI and AMX.** Which integer instructions a CPU has sets how far that goes, and
# the kernels choose at run time from ``/proc/cpuinfo`` (the cell below prints this
# machine's flags). Plain AVX2 multiplies int8 pairs with ``vpmaddubsw`` and
# ``vpmaddwd``, two instructions and an add into int32; AVX512-VNNI and AVX-VNNI fuse
# them into one ``vpdpbusd`` (64 multiply-adds per 512-bit instruction, four times
# an fp32 FMA's). Both read one operand as unsigned bytes and one as signed, so for
# int8 weights the kernels use llama.cpp's trick: ``|x|`` unsigned, ``w * sign(x)``
# signed, whose product is ``x * w`` (``minivllm/fast/csrc/quant_w8a8.cpp``). From 8
# rows on, a GEMM takes over (``quant_w8a8_gemm.h``): it repacks each panel of weight
# rows into the layout ``vpdpbusd`` reads (4 consecutive inputs of 16 outputs per 64-byte
# vector), so one broadcast of 4 activation bytes feeds 16 outputs at once and no
# horizontal sums are left; on VNNI ``x + 128`` is the unsigned operand and an exact
# per-group correction takes the ``128 * sum(w)`` back out. On a 2-core Xeon that made
# the batch-64 matmuls 2.5-2.8x faster per core than the tiles with AVX512-VNNI,
# 1.6-2.1x with AVX-VNNI and 1.2-1.3x with plain AVX2.
# AMX (Intel's Sapphire Rapids and later, flag ``amx_int8``) goes further: a ``tdpbssd``
# multiplies a 16x64 int8 tile by a 64x16 one into a 16x16 int32 tile, 16,384
# multiply-adds in one instruction, for batches large enough to fill its tiles. minivllm's
# GEMM uses it where the CPU has it (``quant_w8a8_amx.h``, one group of 32 inputs a tile,
# because every group has its own activation scale): the rescale of each group's sums in
# AVX-512 is then most of the work, and on that Xeon the batch-64 matmuls ran 1.1-1.3x
# faster than with AVX512-VNNI. At batch 1 the bytes matter most, but not alone: a
# group's dot products over 8 weight rows and the shuffles that sum them take about 50
# instructions, and with 4-bit weights (half the bytes for the same work) a core ran
# out of instructions before it ran out of bandwidth. With AVX-512 one register holds 64 bytes of a row (two int8
# groups, four 4-bit ones), so a ``vpdpbusd`` and one tree of shuffles serve two or four
# groups (``quant_w8a8_row512.h``): one core then read 4-bit weights from memory about a
# third faster on that Xeon, with the same bits. Better still, the layout the GEMM builds
# per call can be built once: on AVX512-VNNI each int8 / 4-bit weight keeps a copy in it,
# made at load (``prepack_w8a8`` / ``prepack_w4a8``), and a batch-1 step multiplies one
# row by that copy with no shuffle at all (``quant_w8a8_prepacked.h``): on a Zen 4 EPYC a
# gguf step went from 4.5-4.9 to 3.5-3.8 ms in C++, at the cost of the copy's memory.
# To see an AVX2 laptop's paths on a newer CPU, build the kernels for it:
# ``MINIVLLM_CPU_ARCH=x86-64-v3`` (then ``w8a8_isas()`` stops at ``avx2``). Measured
# that way on the Xeon, the plain-AVX2 GEMM at batch 64 ran 103-117% of torch's
# float32 GEMM at the same shapes (``docs/benchmarks.md``).
#
# Float32 at batch 64 sits between the two regimes: its 540 MB of weights still take
# about 20 ms a step to read, and its GEMM is bound by arithmetic once they are in
# cache. oneDNN's GEMM does the two one after the other; minivllm's own float32 GEMM
# (``csrc/gemm_panels.cpp``, with AVX-512) asks for the next panel of weights while it
# multiplies this one, and on that Xeon the batch-64 float32 step got 14% shorter.

# %%
from minivllm.bench._harness import cpu_flags  # noqa: E402

print("this CPU's kernel flags:", " ".join(cpu_flags()) or "none of them")

# %% [markdown]
# What you built
# --------------
#
# Nothing new in code: a measurement. This machine's read bandwidth, the weight
# bytes per token of SmolLM2 in four formats and the batch-1 roofline they set,
# the quantized GEMVs' effective bandwidth, and the real decode speed and quality
# of eight engines (``quantization=None``, and W8A16 / W8A8, W4A16 / W4A8 and GGUF with
# float or int8 activations). At
# batch 1 the weights are the traffic, so bytes per weight sets the speed limit;
# what quantization costs is in the perplexity column printed in section 4.

# %% [markdown]
# The roofline on a laptop that is not idle
# -----------------------------------------
#
# The roofline assumes the whole memory bandwidth is yours. When another program
# holds one of the two cores, our second thread runs only in slices, and a loop
# split in fixed halves (OpenMP's ``at::parallel_for``) waits for it every time:
# batch-1 decode kept about a third of its quiet speed. The C++ kernels run on a
# thread team instead (``minivllm/fast/csrc/thread_team.h``) that lets the running
# thread take a late helper's chunks. In the GEMV (the float32 and bf16 projections)
# the W8A8 / W4A8 tiles (int8, gguf) and decode attention the caller even reruns the
# chunk a stopped helper still holds, and the helper's copy is dropped when it wakes:
# no loop of a decode step waits for a helper. Other loops (prefill) run alone for a
# moment after helpers keep being late. With three threads wanting two cores, the
# scheduler gives ours about 4/3 of a core's time between them, so about two thirds
# of the quiet speed is the ceiling. On a CPU where one thread streams only half
# of what two do (the Xeon of docs/kernels.md), bf16 decode then kept 57-61% of its
# quiet speed with a core busy in ``minivllm bench throughput --busy-core`` (128-token
# prompts; 61-64% in every format once attention was revocable too), 65-75% with
# short prompts, where one thread alone kept 55-58%. To see it
# on this machine (a minute or two)::
#
#     minivllm bench latency --dtype float32 --quantization int8 --no-profile \
#         --busy-core --cpu-parallel adaptive openmp
#
# On the 2-core EPYC it kept 63% of the quiet int8 speed where OpenMP kept 36%
# (``docs/kernels.md``, "Threads").

# %% [markdown]
# The test command
# ----------------
#
# The formats and the matmul twins are tested against the formulas rewritten in
# float64, the GGUF blocks against the ``gguf`` package's own quantizer, and whole
# models by SmolLM2's perplexity against bf16:
#
# .. code-block:: bash
#
#    pytest -q tests/test_quantization.py tests/test_w8a8.py --backend=ref
#    pytest -q tests/test_quantization.py tests/test_w8a8.py --backend=fast
#    pytest -q tests/test_thread_team.py    # the threads under a busy core

# %% [markdown]
# The course task
# ---------------
#
# Task 17 ``int8_gemv`` (:doc:`/course/17_int8_gemv`) has you write the int8
# quantizer, dequantizer and GEMV of ``minivllm/ref/quantization.py`` in your
# student package's ``quantization`` module: one scale per group of input
# features, and a GEMV that never builds the float weight.
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task int8_gemv
