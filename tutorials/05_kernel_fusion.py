"""
05 · Kernel fusion: residual add + RMSNorm in one pass
======================================================

Every decoder layer of a Llama does, twice:

.. code-block:: python

   residual = x + residual        # the residual stream
   y = rms_norm(residual) * w     # input of attention / of the MLP

Both are *memory-bound*: a handful of flops per element, so their time is
the time to move their bytes through memory. Eager PyTorch runs each op as
its own kernel, and each kernel reads its inputs from memory and writes its
output back. A fused kernel reads ``x`` and ``residual`` once, keeps the row in
registers, and writes the two results once.

We (1) *count* the bytes each version moves, (2) check the Triton kernel
``minivllm.fast.layernorm.fused_add_rms_norm`` against the ref, and (3) time
both on whatever device runs this script, saying which numbers are measured
and which are a model.
"""

# %%
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before Triton is imported

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from _figures import figure_path  # tutorials/figures/, ignored by git
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.fast import layernorm as fast_layernorm
from minivllm.ref import layernorm as ref_layernorm

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print("device:", device, "(Triton interpreter for the kernel)" if device == "cpu" else "")

# %% [markdown]
# 1 · Count the bytes eager PyTorch moves
# ---------------------------------------
#
# A ``TorchDispatchMode`` sees every ATen op the ref calls. We charge each op the
# bytes of the tensors it reads plus the bytes of the tensors it writes: that
# is what an unfused kernel costs when its operands do not stay in a cache.

# %%
class ByteCounter(TorchDispatchMode):
    """Record (op, bytes read + bytes written) for every ATen op."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = list(args) + list((kwargs or {}).values())
        read = sum(a.nbytes for a in flat if isinstance(a, torch.Tensor))
        outs = out if isinstance(out, (tuple, list)) else [out]
        written = sum(o.nbytes for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((func.__name__, read + written))
        return out


T, hidden, dtype = 4096, 4096, torch.bfloat16
x = torch.randn(T, hidden, dtype=dtype)
residual = torch.randn(T, hidden, dtype=dtype)
weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype)
with ByteCounter() as counter:
    ref_layernorm.fused_add_rms_norm(x, residual, weight, 1e-6)
N = T * hidden * dtype.itemsize  # bytes of one (T, hidden) bf16 tensor
eager_bytes = sum(b for _, b in counter.ops)
fused_bytes = 4 * N + weight.nbytes  # read x, residual; write out, new residual
for name, b in counter.ops:
    print(f"  {name:<22}{b / N:5.1f} x N")
print(f"eager: {len(counter.ops)} kernels, {eager_bytes / N:.1f} x N bytes; "
      f"fused: 1 kernel, {fused_bytes / N:.1f} x N bytes (N = {N / 2**20:.0f} MiB)")

# %% [markdown]
# The float32 upcast is what hurts most: the row is written to memory at twice
# its size and read back by every later op. The fused kernel upcasts in
# registers. (Its launch grid is one program per row; the row, up to a few
# thousand elements, is one block, so the mean of squares is one in-register
# reduction.)
#
# 2 · Same values as the ref
# --------------------------
#
# An awkward shape (37 rows of 1000), in bf16. Rounding follows the ref: the
# sum is rounded to bf16, the norm computed in float32 and rounded before the
# weight multiply. Compiled on a GPU the results agree to the last bit or
# nearly; Triton's CPU interpreter rounds float32 -> bf16 towards zero instead
# of to nearest, so there they may differ by one bf16 step (about 0.4% of the
# value).

# %%
xs = torch.randn(37, 1000, dtype=dtype)
rs = torch.randn(37, 1000, dtype=dtype)
ws = 1 + 0.1 * torch.randn(1000, dtype=dtype)
ref_out, ref_res = ref_layernorm.fused_add_rms_norm(xs, rs, ws, 1e-6)
out, res = fast_layernorm.fused_add_rms_norm_triton(xs.clone().to(device), rs.clone().to(device),
                                                    ws.to(device), 1e-6)
print("normed: max abs diff", (out.cpu().float() - ref_out.float()).abs().max().item())
print("residual: max abs diff", (res.cpu().float() - ref_res.float()).abs().max().item())
torch.testing.assert_close(out.cpu(), ref_out, rtol=1.6e-2, atol=1.6e-2)
torch.testing.assert_close(res.cpu(), ref_res)

# %% [markdown]
# 3 · Time
# --------
#
# On a GPU both versions are timed (``triton.testing.do_bench`` medians). On a
# CPU the Triton kernel only runs in the interpreter, which says nothing about
# speed, so we time the eager ref and set it against a **model** of the fused
# kernel: its bytes divided by the copy bandwidth measured on the same machine.
# The plot says which curve is which.

# %%
if device == "cpu":
    torch.set_num_threads(1)  # steadier timings on a shared laptop/CI core
def median_ms(fn, reps):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


src = torch.empty(2**28 if device == "cuda" else 2**26, dtype=torch.uint8, device=device)
dst = torch.empty_like(src)
copy_bw = 2 * src.numel() / (median_ms(lambda: dst.copy_(src), 5) * 1e-3)  # read + write
print(f"measured copy bandwidth on {device}: {copy_bw / 1e9:.1f} GB/s")

tokens = 2048 if device == "cuda" else 256
hiddens = [1024, 2048, 4096, 8192]
eager_ms, fused_ms = [], []
for h in hiddens:
    xh = torch.randn(tokens, h, dtype=dtype, device=device)
    rh = torch.randn(tokens, h, dtype=dtype, device=device)
    wh = torch.randn(h, dtype=dtype, device=device)
    args = (xh, rh, wh, 1e-6)
    eager_ms.append(median_ms(lambda a=args: ref_layernorm.fused_add_rms_norm(*a), 5))
    nbytes = 4 * tokens * h * dtype.itemsize
    if device == "cuda":
        fused_ms.append(median_ms(lambda a=args: fast_layernorm.fused_add_rms_norm(*a), 5))
    else:
        fused_ms.append(nbytes / copy_bw * 1e3)  # model, not a measurement
    # Eager's bytes (counted in part 1, scaled to this shape) over its time: its bandwidth.
    eager_bw = eager_bytes / N * tokens * h * dtype.itemsize / (eager_ms[-1] * 1e-3)
    print(f"hidden {h:5d}: eager {eager_ms[-1]:.3f} ms, fused "
          f"{'(measured)' if device == 'cuda' else '(model)'} {fused_ms[-1]:.3f} ms, "
          f"ratio {eager_ms[-1] / fused_ms[-1]:.1f}x = bytes {eager_bytes / fused_bytes:.1f}x "
          f"/ eager at {eager_bw / copy_bw:.0%} of the copy bandwidth")

# %% [markdown]
# The time ratio is the byte ratio of part 1 (about 5x) times how far below the
# copy bandwidth the eager ops run, and the printout splits it that way. On a
# GPU each eager op streams at nearly full bandwidth, so the time ratio stays
# close to the byte ratio. On a CPU it comes out several times larger (20x or
# more on one core): there the eager ops are not limited by memory at
# all. Converting bf16 to and from float32, ``rsqrt`` and the reduction cost
# more CPU cycles per byte than one core can stream, so eager moves its bytes
# at a fraction of the copy rate, while the model assumes the fused kernel
# streams at the full rate. A native fused CPU kernel would convert in
# registers too, but its real speed-up depends on that arithmetic as well:
# the model is an upper bound.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
names = [n for n, _ in counter.ops]
ax1.barh(["fused (1 kernel)"], [fused_bytes / N], color="tab:green")
left = 0.0
for i, (name, b) in enumerate(counter.ops):
    # matplotlib hides legend labels that start with "_", such as "_to_copy" (the
    # float32 upcast, the point of this figure), so name them as "aten._to_copy".
    ax1.barh(["eager (ref)"], [b / N], left=left, color=plt.cm.tab20(i % 20), edgecolor="k",
             label=f"aten.{name.split('.')[0]}")
    left += b / N
ax1.legend(fontsize=7, loc="lower right", ncol=2)
ax1.set_xlabel("bytes moved / bytes of one (T, hidden) bf16 tensor")
ax1.set_title(f"memory traffic: {len(names)} eager ops vs 1 fused kernel")
fused_label = "fused Triton kernel (measured)" if device == "cuda" else \
    "fused kernel: MODEL = bytes / measured copy bandwidth"
ax2.plot(hiddens, eager_ms, "o-", label="eager ref (measured)")
ax2.plot(hiddens, fused_ms, "s--" if device == "cpu" else "s-", label=fused_label)
ax2.set_xscale("log", base=2)
ax2.set_yscale("log")
ax2.set_xlabel("hidden size")
ax2.set_ylabel("ms")
ax2.set_title(f"{tokens} tokens, bf16, on {device}")
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(figure_path("05_kernel_fusion.png"), dpi=110)
print("saved 05_kernel_fusion.png")

# %% [markdown]
# **Figure 05.1.** Left: the bytes that the nine eager ops of residual add + RMSNorm
# move, in units of one tensor, against the fused kernel's four; right: the eager ref's
# measured time against the fused kernel's floor (its bytes over this machine's measured
# copy bandwidth). Look at the ratio of the two bars: it is the speed-up fusion can give
# a memory-bound op. On a CPU the measured eager line also jumps where its intermediate
# tensors outgrow the caches (chapter 07 explains that knee).
#
# On a GPU the fused kernel should run close to ``4 N / bandwidth``; the ratio
# to eager is roughly the ratio of bytes moved. ``python -m minivllm.bench
# kernels`` reports it on production shapes, with the other fused kernels
# (SiLU-and-mul, RoPE, the cache write).

# %% [markdown]
# What you built
# --------------
#
# Residual add and RMSNorm fused into one pass, checked against the unfused ops, with the
# bytes each version moves and what that costs.

# %% [markdown]
# The test command
# ----------------
#
# .. code-block:: text
#
#    pytest -q tests/test_small_kernels.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Write the fused residual add + RMSNorm (task 7) and SiLU-and-mul (task 9). Then see where
# your versions stand against the ref and the Triton twins:
# ``PYTHONPATH=hw minivllm bench kernels --backend minivllm_student`` (on a GPU).
#
# Handouts (task 7 ``fused_add_rms_norm``: :doc:`/course/07_fused_add_rms_norm`, task 9 ``silu_and_mul``: :doc:`/course/09_silu_and_mul`). Test your package:
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task fused_add_rms_norm --task silu_and_mul
