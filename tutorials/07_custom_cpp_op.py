# %% [markdown]
# # 07 · A custom C++ op: RMSNorm for the CPU
#
# On a GPU, minivllm's fast kernels are Triton. On a CPU they are C++ functions
# over `torch::Tensor`, compiled just in time and registered as real torch
# operators, the way vLLM builds its CPU kernels. This tutorial walks the whole
# flow on one small kernel:
#
# 1. the ref RMSNorm, the maths we must reproduce;
# 2. the same maths as a C++ loop, compiled with `torch.utils.cpp_extension.load_inline`;
# 3. registration with `TORCH_LIBRARY`, so Python calls it as `torch.ops.tutorial07.rms_norm`;
# 4. a check against the ref and a float64 oracle;
# 5. timing against the ref, and a figure.
#
# The project's own ops live in `minivllm/fast/csrc/` and are built the same way by
# `minivllm/fast/cpu_ops.py` (see docs/kernels.md). The first run compiles for
# 20-60 s; later runs reuse torch's extension cache.

# %%
import time

import matplotlib

matplotlib.use("Agg")  # no window: the figure is saved as a PNG
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git
from torch.utils.cpp_extension import load_inline

from minivllm.fast.cpu_ops import compile_flags
from minivllm.ref import layernorm as ref_layernorm

torch.manual_seed(0)
print("threads:", torch.get_num_threads())

# %% [markdown]
# ## 1 · The ref RMSNorm
#
# `rms_norm(x) = x / sqrt(mean(x²) + eps) * weight`, in float32, rounded back to the
# input dtype before the weight multiply (as transformers' `LlamaRMSNorm` does).
# Eager torch runs it as about six ops, each a full pass over the rows: square,
# mean, add eps, rsqrt, multiply, cast, multiply by the weight.

# %%
x = torch.randn(5, 576)
w = 1 + 0.1 * torch.randn(576)
y_ref = ref_layernorm.rms_norm(x, w, 1e-6)
print(y_ref.shape, y_ref.dtype)

# %% [markdown]
# ## 2 · The same maths in C++
#
# One function per op, plain loops over raw pointers. Three things make it fast:
#
# - **one pass per row**: the sum of squares, then the scaled write, while the row
#   is in L1 cache; no temporaries;
# - **vectorisable loops**: the sum keeps 16 partial sums side by side (one
#   512-bit register of floats); a single running sum is a dependency chain the
#   compiler may not reorder, so it would stay scalar. `-O3 -march=native` does
#   the rest, with no intrinsics in the source;
# - **threads**: `at::parallel_for` splits the rows over torch's thread pool
#   (OpenMP), with a grain size so small batches stay on one thread.
#
# `AT_DISPATCH_FLOATING_TYPES_AND2` instantiates the loop for float32, float16
# and bfloat16 (`scalar_t`); arithmetic is float32 throughout.

# %%
SOURCE = r"""
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x: (rows, hidden)");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: (hidden,) of x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * hidden;
        float acc[16] = {0.f};                       // 16 partial sums: vectorisable
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
          for (int l = 0; l < 16; ++l) acc[l] += float(row[i + l]) * float(row[i + l]);
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += acc[l];
        for (; i < hidden; ++i) sum += float(row[i]) * float(row[i]);
        const float inv = 1.f / std::sqrt(sum / hidden + float(eps));
        for (int64_t j = 0; j < hidden; ++j) {       // round to the dtype, then weight
          const scalar_t normed = scalar_t(float(row[j]) * inv);
          op[r * hidden + j] = scalar_t(float(normed) * float(wp[j]));
        }
      }
    });
  });
}

// 3 · Registration: a schema, then the CPU implementation.
TORCH_LIBRARY(tutorial07, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
}
TORCH_LIBRARY_IMPL(tutorial07, CPU, m) { m.impl("rms_norm", &rms_norm); }
"""

# %% [markdown]
# ## 3 · Compile and register
#
# `load_inline` writes the source into torch's extension cache
# (`~/.cache/torch_extensions`), compiles it with ninja and loads the library.
# `is_python_module=False`: there are no Python bindings to generate; loading the
# library runs `TORCH_LIBRARY`, which registers the op with the dispatcher. The
# schema's `Tensor(a!)` says the op writes `out` in place: `torch.compile` and
# the profiler rely on that.

# %%
start = time.perf_counter()
load_inline(name="tutorial07_rms_norm", cpp_sources=[SOURCE], is_python_module=False,
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"] if "-fopenmp" in compile_flags() else [])
print(f"compiled and loaded in {time.perf_counter() - start:.1f} s")
print(torch.ops.tutorial07.rms_norm.default._schema)


def rms_norm_cpp(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Python wrapper: allocate the output, call the op."""
    out = torch.empty_like(x)
    torch.ops.tutorial07.rms_norm(out, x, weight, eps)
    return out


# %% [markdown]
# ## 4 · Check it against the ref and an oracle
#
# Awkward sizes (odd row counts, hidden sizes that are not multiples of 16),
# float32 and bfloat16, and rows so small that `eps` matters. The oracle is the
# formula in float64.

# %%
def oracle(x, w, eps):
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
for rows, hidden, dtype, scale in [(1, 8, torch.float32, 1.0), (7, 130, torch.float32, 1e-3),
                                   (33, 576, torch.bfloat16, 30.0), (5, 1000, torch.bfloat16, 1e-4)]:
    x = (torch.randn(rows, hidden) * scale).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    y = rms_norm_cpp(x, w, 1e-6)
    torch.testing.assert_close(y, ref_layernorm.rms_norm(x, w, 1e-6), rtol=tol[dtype],
                               atol=tol[dtype])
    torch.testing.assert_close(y.double(), oracle(x, w, 1e-6), rtol=2 * tol[dtype],
                               atol=2 * tol[dtype])
    print(f"rows {rows:3d} hidden {hidden:5d} {str(dtype):15s} |x|~{scale:g}: matches")

# %% [markdown]
# ## 5 · Time it
#
# Rows of SmolLM2's hidden size (576), float32, from one decode token to a
# prefill chunk. Medians of repeated runs; the machine may be busy, so read the
# ratio, not the absolute times. The profiler shows the op under its registered
# name, like any ATen op.

# %%
def median_ms(fn, repeat=30):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


row_counts = [1, 8, 64, 256, 1024, 4096]
t_ref, t_cpp = [], []
w = torch.randn(576)
for rows in row_counts:
    x = torch.randn(rows, 576)
    t_ref.append(median_ms(lambda x=x: ref_layernorm.rms_norm(x, w, 1e-6)))
    t_cpp.append(median_ms(lambda x=x: rms_norm_cpp(x, w, 1e-6)))
    print(f"{rows:5d} rows: ref {t_ref[-1]:7.3f} ms  C++ {t_cpp[-1]:7.3f} ms  "
          f"speed-up {t_ref[-1] / t_cpp[-1]:4.1f}x")

with torch.profiler.profile() as prof:
    rms_norm_cpp(torch.randn(64, 576), w, 1e-6)
print([e.key for e in prof.key_averages() if "tutorial07" in e.key])

# %%
fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(row_counts, t_ref, "o-", label="ref (eager torch ops)")
ax.loglog(row_counts, t_cpp, "s-", label="C++ op (one pass, threads)")
ax.set_xlabel("rows (tokens), hidden 576, float32")
ax.set_ylabel("median time (ms)")
ax.set_title("RMSNorm on a CPU: ref vs a custom C++ op")
ax.legend()
fig.tight_layout()
fig.savefig(figure_path("07_custom_cpp_op.png"), dpi=110)
print("wrote 07_custom_cpp_op.png")

# %% [markdown]
# ## What you learned, and the test command
#
# The flow is the same for every CPU kernel in minivllm: write the loop in
# `minivllm/fast/csrc/`, register it in `csrc/torch_bindings.cpp`, add the source to
# `SOURCES` in `minivllm/fast/cpu_ops.py`, wrap it in the fast component module
# (e.g. `rms_norm_cpu` in `minivllm/fast/layernorm.py`) and test it against the ref
# and a float64 oracle:
#
# ```bash
# pytest -q tests/test_cpu_ops.py                      # the C++ ops, awkward shapes
# pytest -q --backend=fast tests/test_small_kernels.py # C++ and Triton (interpreter) vs ref
# ```
