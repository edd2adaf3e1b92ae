// Weight-only quantized matmuls on a CPU: y = x W^T with W stored in 8 or 4 bits.
//
// The formats are minivllm/ref/quantization.py's (read its docstring first):
//   int8: W[n, k] = s[n, g] * q[n, k]             q int8, one scale per group
//   int4: W[n, k] = d[n, g] * q[n, k] + m[n, g]   q in [0, 15], groups of 32,
//         byte j of a group holds q[j] (low nibble) and q[j + 16] (high nibble).
//
// Decode-shaped inputs (a few rows of x) are bound by reading W: a batch-1 step
// of SmolLM2-135M reads 135 MB of int8 (75 MB of 4-bit) weights and does two
// flops with each byte, so the kernel's job is to keep the memory system busy
// and to spend few instructions per weight. These kernels read each quantized
// row once, widen its integers to float in registers, and never write a float W
// to memory: 1 byte (int8) or 0.75 byte (int4) a weight, against bf16's 2. Per
// group the scale factors out of the sum:
//   y[m, n] = sum_g s[n, g] * (x[m, g-th group] . q[n, g-th group])           int8
//   y[m, n] = sum_g d[n, g] * (x . q)_g + m[n, g] * (sum of x over the group)  int4
//
// How the AVX2 path (x86 with AVX2 + FMA; the build uses -march=native) is blocked:
// - Tiles. A tile is NB weight rows x MR rows of x, with NB x MR accumulators of 8
//   floats in registers. Each 8-weight step loads the MR activation vectors once
//   and uses each for NB weight rows; each weight vector is widened once and used
//   for MR rows of x. M = 1 (a decode step) has its own tiles: 8 int8 rows (4 for
//   the grouped formats, which need a partial sum a row besides the total: AVX2
//   has 16 vector registers).
// - Applying the scale. With one scale a row (int8 per channel) it multiplies the
//   finished sum. With a scale per group, M = 1 keeps a partial sum per group and
//   adds it times s (one FMA a group); for 4 bits the minimum's share is the dot
//   product of m's row with the group sums of x (computed once per call). With
//   MR = 2 rows of x, each 8-weight vector is instead dequantized in registers
//   (s q, or d q + m: one FMA) and the result serves both rows.
// - Widening 4 bits: the group's 16 bytes go into both 128-bit halves of a
//   register; one in-lane byte shuffle per 8 weights puts byte i into 32-bit lane
//   i, then `& 15` gives weight i and `>> 4` weight i + 16, in order.
// - Prefetching. A row of SmolLM2 is only 288-768 quantized bytes, and a tile's
//   rows are adjacent in memory. The hardware prefetcher follows each row as a
//   stream and has barely ramped up when the row ends; the tiles therefore
//   prefetch the next tile's bytes, a cache line per step, which took the int8
//   kernel from a third of the read bandwidth to most of it.
// - Threads take whole tiles of weight rows (parallel_for), so each weight
//   byte is read from memory once, by one thread.
// A plain loop (one weight row at a time, LANES partial sums, the scale once per
// group) runs elsewhere, for int8 groups that are not a multiple of 8, and with
// portable=true (the tests run both).
//
// For many rows of x (prefill) the bytes of W no longer matter: the Python side
// dequantizes W (dequantize_int8 / dequantize_int4 below) and calls a GEMM.
#include "ops.h"

#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINIVLLM_QUANT_AVX2 1
#else
#define MINIVLLM_QUANT_AVX2 0
#endif

namespace minivllm {

namespace {

constexpr int64_t GROUP4 = 32;  // weights per group of the 4-bit format
constexpr int NB1 = 8;       // int8 weight rows per tile for one row of x (M = 1)
constexpr int NB1_GROUPED = 4;  // int8 with a scale per group, M = 1
constexpr int NB1_INT4 = 4;  // 4-bit weight rows per tile for M = 1
constexpr int NB = 4;        // weight rows per tile for MR rows of x (M > 1)
constexpr int MR = 2;        // rows of x per tile for M > 1

// x as float32 rows, so the inner loops read one type.
at::Tensor float_rows(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

void check_common(const at::Tensor& out, const at::Tensor& x, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x: (M, K) with K = ", k);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out: (M, N) float32, contiguous");
}

// The AVX2 tiles: AVX2 + FMA builds only (MINIVLLM_QUANT_AVX2).
#include "quant_tiles.h"

}  // namespace

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& scales, bool portable) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kChar,
              "qweight: (N, K) int8, contiguous");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && k % scales.size(1) == 0,
              "scales: (N, G) float32, contiguous, G dividing K");
  check_common(out, x, n, k);
  const at::Tensor xf = float_rows(x);
  const int64_t m_rows = x.size(0), groups = scales.size(1), gs = k / groups;
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (m_rows == 0 || n == 0) return;
#if MINIVLLM_QUANT_AVX2
  if (!portable && gs % 8 == 0) {
    const Tiles t{xp, m_rows, n, k, reinterpret_cast<const uint8_t*>(qp), k, sp, nullptr,
                  groups, nullptr, op};
    if (m_rows == 1 && groups == 1) {
      run_tiles<NB1>(t, nullptr, int8_tile<1, NB1, true>);
    } else if (m_rows == 1) {
      run_tiles<NB1_GROUPED>(t, nullptr, int8_tile_m1_grouped<NB1_GROUPED>);
    } else if (groups == 1) {
      run_tiles<NB>(t, int8_tile<MR, NB, true>, int8_tile<1, NB, true>);
    } else {
      run_tiles<NB>(t, int8_tile<MR, NB, false>, int8_tile<1, NB, false>);
    }
    return;
  }
#endif
  (void)portable;
  // The portable loop (and where gs is not a multiple of 8): one weight row at a
  // time, LANES partial sums a group, the scale applied once per group.
  parallel_for(0, n, grain_for(k * m_rows), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int8_t* q = qp + row * k;
      const float* s = sp + row * groups;
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* xm = xp + m * k;
        float acc[LANES] = {0.f};  // sum_g s_g * partial_g, lane by lane
        for (int64_t g = 0; g < groups; ++g) {
          const float* xg = xm + g * gs;
          const int8_t* qg = q + g * gs;
          float part[LANES] = {0.f};
          int64_t i = 0;
          for (; i + LANES <= gs; i += LANES) {
            for (int l = 0; l < LANES; ++l) part[l] += xg[i + l] * static_cast<float>(qg[i + l]);
          }
          for (int l = 0; i + l < gs; ++l) part[l] += xg[i + l] * static_cast<float>(qg[i + l]);
          for (int l = 0; l < LANES; ++l) acc[l] += s[g] * part[l];
        }
        op[m * n + row] = reduce_lanes(acc);
      }
    }
  });
}

void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& scales, const at::Tensor& mins, bool portable) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte,
              "qweight: (N, K / 2) uint8, contiguous");
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, groups = k / GROUP4;
  TORCH_CHECK(k % GROUP4 == 0, "K must be a multiple of 32, got ", k);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == groups &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat,
                "scales and mins: (N, K / 32) float32, contiguous");
  }
  check_common(out, x, n, k);
  const at::Tensor xf = float_rows(x);
  const int64_t m_rows = x.size(0);
  const float* xp = xf.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* dp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (m_rows == 0 || n == 0) return;
  // The sum of x over each group, once per row of x: the minimum's share.
  std::vector<float> xsum(m_rows * groups);
  for (int64_t i = 0; i < m_rows * groups; ++i) {
    float s = 0.f;
    for (int l = 0; l < GROUP4; ++l) s += xp[i * GROUP4 + l];
    xsum[i] = s;
  }
  const float* xs = xsum.data();
#if MINIVLLM_QUANT_AVX2
  if (!portable) {
    const Tiles t{xp, m_rows, n, k, qp, k / 2, dp, mp, groups, xs, op};
    if (m_rows == 1) {
      run_tiles<NB1_INT4>(t, nullptr, int4_tile_m1<NB1_INT4>);
    } else {
      run_tiles<NB>(t, int4_tile<MR, NB>, int4_tile<1, NB>);
    }
    return;
  }
#endif
  (void)portable;
  // The portable loop: one weight row at a time.
  constexpr int HALF = GROUP4 / 2;  // 16 bytes a group, 16 lanes
  static_assert(HALF == LANES, "one group's bytes fill the lanes exactly");
  parallel_for(0, n, grain_for(k * m_rows), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* q = qp + row * (k / 2);
      const float* d = dp + row * groups;
      const float* mn = mp + row * groups;
      for (int64_t m = 0; m < m_rows; ++m) {
        const float* xm = xp + m * k;
        const float* xsm = xs + m * groups;
        float acc[LANES] = {0.f};
        float offset = 0.f;  // sum_g m_g * (sum of x over group g)
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* b = q + g * HALF;
          const float* xg = xm + g * GROUP4;
          for (int l = 0; l < LANES; ++l) {
            const float lo = static_cast<float>(b[l] & 0xF);  // weight l of the group
            const float hi = static_cast<float>(b[l] >> 4);   // weight l + 16
            acc[l] += d[g] * (xg[l] * lo + xg[l + HALF] * hi);
          }
          offset += mn[g] * xsm[g];
        }
        op[m * n + row] = reduce_lanes(acc) + offset;
      }
    }
  });
}

void dequantize_int8(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kChar && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.size(0) == qweight.size(0) &&
                  qweight.size(1) % scales.size(1) == 0,
              "qweight (N, K) int8 and scales (N, G) float32, contiguous");
  TORCH_CHECK(out.sizes() == qweight.sizes() && out.is_contiguous(), "out: (N, K), contiguous");
  const int64_t n = qweight.size(0), k = qweight.size(1), groups = scales.size(1);
  const int64_t gs = k / groups;
  MINIVLLM_DISPATCH(out.scalar_type(), "dequantize_int8", [&] {
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const float* sp = scales.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, n, grain_for(k), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t i = 0; i < k; ++i) {
          op[row * k + i] = static_cast<scalar_t>(sp[row * groups + i / gs] *
                                                  static_cast<float>(qp[row * k + i]));
        }
      }
    });
  });
}

void dequantize_int4(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& mins) {
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, groups = k / GROUP4;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte && k % GROUP4 == 0,
              "qweight: (N, K / 2) uint8, contiguous, K a multiple of 32");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == groups &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat,
                "scales and mins: (N, K / 32) float32, contiguous");
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == k && out.is_contiguous(),
              "out: (N, K), contiguous");
  MINIVLLM_DISPATCH(out.scalar_type(), "dequantize_int4", [&] {
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const float* dp = scales.data_ptr<float>();
    const float* mp = mins.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    parallel_for(0, n, grain_for(k), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* b = qp + row * (k / 2) + g * (GROUP4 / 2);
          const float d = dp[row * groups + g], mn = mp[row * groups + g];
          scalar_t* dst = op + row * k + g * GROUP4;
          for (int l = 0; l < GROUP4 / 2; ++l) {
            dst[l] = static_cast<scalar_t>(d * static_cast<float>(b[l] & 0xF) + mn);
            dst[l + GROUP4 / 2] = static_cast<scalar_t>(d * static_cast<float>(b[l] >> 4) + mn);
          }
        }
      }
    });
  });
}

}  // namespace minivllm
