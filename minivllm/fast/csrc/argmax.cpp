// The greedy pick on a CPU: the index of each row's largest logit, as torch.argmax.
//
// torch's max(dim=-1) over one 49,152-wide row takes ~25 us on one core (an
// index-tracking reduction the compiler keeps scalar), and when it runs right after a
// thread-team op it waits again for OpenMP's thread, whose core the team's helper
// still spins on (~90 us in all, measured after the LM head's GEMV). Here each row
// takes two vectorised passes, on the thread team:
//   1. the largest value, and whether the row holds a NaN (max ignores NaN: x > m is
//      false for it); element-wise across lanes, so the compiler vectorises it;
//   2. the first index whose value equals it (or the first NaN: argmax counts NaN as
//      the largest), 16 elements a step with an early exit.
// Equal maxima give the first one's index, as torch.argmax documents; +0 and -0 are
// equal under ==, so a row whose largest value is a zero gets its first zero, also as
// torch does. A row of -inf gives 0.
#include "ops.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace minivllm {
namespace {

constexpr int64_t LANES = 16;
// LANES floats as one value (GCC/Clang vector extension: zmm with AVX-512, two ymm with
// AVX2, NEON quads on ARM); a comparison gives a lane mask of int32 -1 / 0.
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vmask __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

int64_t argmax_row(const float* __restrict x, int64_t n) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  vfloat lanes = vfloat{} + NEG_INF;
  vmask nan_lanes = vmask{};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const vfloat v = load(x + i);
    lanes = v > lanes ? v : lanes;
    nan_lanes |= v != v;
  }
  float best = NEG_INF;
  bool nan = false;
  for (int64_t l = 0; l < LANES; ++l) {
    best = lanes[l] > best ? lanes[l] : best;
    nan |= nan_lanes[l] != 0;
  }
  for (int64_t t = i; t < n; ++t) {
    best = x[t] > best ? x[t] : best;
    nan |= x[t] != x[t];
  }
  // The first block holding it, then the element within.
  for (i = 0; i + LANES <= n; i += LANES) {
    const vfloat v = load(x + i);
    const vmask hit = nan ? v != v : v == best;
    bool any = false;
    for (int64_t l = 0; l < LANES; ++l) any |= hit[l] != 0;
    if (any) break;
  }
  for (; i < n; ++i) {
    if (nan ? x[i] != x[i] : x[i] == best) return i;
  }
  return 0;  // not reached for n > 0: the maximum is in the row
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: logits must be (N, V) float32 with unit column stride");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: a row of no logits has no argmax");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) idx[r] = argmax_row(x + r * stride, n);
  });
  return out;
}

}  // namespace minivllm
