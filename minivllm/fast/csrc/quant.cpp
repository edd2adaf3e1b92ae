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
// - Threads take whole tiles of weight rows (at::parallel_for), so each weight
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

// ------------------------------------------------------------------ the AVX2 tiles
#if MINIVLLM_QUANT_AVX2
// The loops over the rows of a tile have constant bounds; unrolled, their
// accumulators are named registers (GCC left a loop over 8 rows rolled, with the
// accumulators in memory: half the speed).
#define MINIVLLM_UNROLL _Pragma("GCC unroll 8")

// One quantized (N, K) weight and the rows of x it multiplies: what every tile reads.
struct Tiles {
  const float* x;         // (m, k) float32 activations
  int64_t m, n, k;
  const uint8_t* q;       // the integers: row r at q + r * row_bytes
  int64_t row_bytes;      // k (int8) or k / 2 (int4)
  const float* s;         // (n, groups) scales s (int8) or d (int4)
  const float* mn;        // (n, groups) minimums m (int4)
  int64_t groups;
  const float* xsum;      // (m, groups) sums of x over each group (int4)
  float* y;               // (m, n) float32 output
};

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] b[i]: 8 lanes, then a scalar tail (n is small: the groups of a row).
inline float dot8(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return hsum(acc) + tail;
}

// 8 int8 weights as 8 floats: one sign-extending load (vpmovsxbd) and a convert.
inline __m256 widen_int8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// One 4-bit group (16 bytes at p) as 4 vectors of 8 floats, weights 0..31 in order.
// The 16 bytes are loaded into both 128-bit halves; an in-lane byte shuffle puts byte
// i of a half into 32-bit lane i, zero-extended (half 0 takes bytes 0-3, half 1 bytes
// 4-7, or 8-11 and 12-15), so `& 15` is weight i and `>> 4` weight i + 16. That is
// 6 integer operations a group, where widening with vpmovzxbd (which crosses halves)
// costs 4 shuffles more.
inline void widen_group4(const uint8_t* p, __m256 w[4]) {
  const __m256i bytes_0_7 = _mm256_setr_epi8(
      0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
      4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i bytes_8_15 = _mm256_setr_epi8(
      8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
      12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i t0 = _mm256_shuffle_epi8(b, bytes_0_7), t1 = _mm256_shuffle_epi8(b, bytes_8_15);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(t0, low4));   // weights 0..7
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(t1, low4));   // 8..15
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(t0, 4));     // 16..23
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(t1, 4));     // 24..31
}

// The weight rows of a tile: rows n0 .. n0 + nb - 1, padded to NB_ by repeating the last
// (read again from L1; those results are dropped).
template <int NB_>
inline int64_t tile_row(int64_t n0, int64_t nb, int j) {
  return n0 + std::min<int64_t>(j, nb - 1);
}

// The next tile's first byte: the NB_ rows after this tile's are contiguous, and the
// tiles prefetch them a little at a time (the rows are short, 288-768 bytes: the
// hardware prefetcher, which follows each row as a stream, has barely started when
// a row ends; without this the kernels ran at a third of the read bandwidth).
template <int NB_>
inline const char* next_tile(const Tiles& t, int64_t n0) {
  return reinterpret_cast<const char*>(t.q + std::min(n0 + NB_, t.n - 1) * t.row_bytes);
}

// y[m0 + i, n0 + j] = x_{m0+i} . W_{n0+j} for MR_ rows of x and NB_ int8 weight rows.
// Every 8-weight step loads MR_ activation vectors once and uses each for NB_ rows.
// PER_ROW (one scale a row): the scale multiplies the finished sum. Otherwise each
// 8-weight vector is dequantized in registers (times s, broadcast once a group) before
// the FMAs, so one multiply serves all MR_ rows of x.
template <int MR_, int NB_, bool PER_ROW>
void int8_tile(const Tiles& t, int64_t n0, int64_t nb, int64_t m0) {
  const int8_t* q[NB_];
  const float* s[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) {
    const int64_t r = tile_row<NB_>(n0, nb, j);
    q[j] = reinterpret_cast<const int8_t*>(t.q + r * t.row_bytes);
    s[j] = t.s + r * t.groups;
  }
  const float* xr[MR_];
  for (int i = 0; i < MR_; ++i) xr[i] = t.x + (m0 + i) * t.k;
  const char* next = next_tile<NB_>(t, n0);
  const int64_t gs = t.k / t.groups;
  __m256 acc[MR_][NB_];
  MINIVLLM_UNROLL
  for (int i = 0; i < MR_; ++i)
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    __m256 sv[NB_];
    if constexpr (!PER_ROW) {
      MINIVLLM_UNROLL
      for (int j = 0; j < NB_; ++j) sv[j] = _mm256_broadcast_ss(s[j] + g);
    }
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
      _mm_prefetch(next + k * NB_, _MM_HINT_T0);  // NB_ * 8 bytes of the next tile a step
      __m256 xv[MR_];
      MINIVLLM_UNROLL
      for (int i = 0; i < MR_; ++i) xv[i] = _mm256_loadu_ps(xr[i] + k);
      MINIVLLM_UNROLL
      for (int j = 0; j < NB_; ++j) {
        __m256 w = widen_int8(q[j] + k);
        if constexpr (!PER_ROW) w = _mm256_mul_ps(w, sv[j]);
        MINIVLLM_UNROLL
        for (int i = 0; i < MR_; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], w, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR_; ++i)
    for (int64_t j = 0; j < nb; ++j)
      t.y[(m0 + i) * t.n + n0 + j] = hsum(acc[i][j]) * (PER_ROW ? s[j][0] : 1.f);
}

// One row of x, NB_ int8 weight rows with a scale per group (llama.cpp's Q8_0): the
// scale factors out of each group's sum, y = sum_g s_g (x . q)_g, so a group's FMAs
// go to a partial sum that one FMA by s_g adds to the total (2 NB_ registers; the
// multiply-the-weight form of int8_tile costs one more instruction per 8 weights).
template <int NB_>
void int8_tile_m1_grouped(const Tiles& t, int64_t n0, int64_t nb, int64_t m0) {
  const int8_t* q[NB_];
  const float* s[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) {
    const int64_t r = tile_row<NB_>(n0, nb, j);
    q[j] = reinterpret_cast<const int8_t*>(t.q + r * t.row_bytes);
    s[j] = t.s + r * t.groups;
  }
  const float* x = t.x + m0 * t.k;
  const char* next = next_tile<NB_>(t, n0);
  const int64_t gs = t.k / t.groups;
  __m256 acc[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    __m256 part[NB_];
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j) part[j] = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8) {
      _mm_prefetch(next + k * NB_, _MM_HINT_T0);
      const __m256 xv = _mm256_loadu_ps(x + k);
      MINIVLLM_UNROLL
      for (int j = 0; j < NB_; ++j) part[j] = _mm256_fmadd_ps(xv, widen_int8(q[j] + k), part[j]);
    }
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(s[j] + g), part[j], acc[j]);
  }
  for (int64_t j = 0; j < nb; ++j) t.y[m0 * t.n + n0 + j] = hsum(acc[j]);
}

// One row of x, NB_ 4-bit weight rows. Per group the scale and the minimum factor out:
//   y = sum_g d_g (x . q)_g + sum_g m_g (sum of x over group g)
// so a group costs 4 FMAs of x with the integers (as floats) and one by d; the
// minimums' share is a dot product of m's row with the group sums of x, at the end.
template <int NB_>
void int4_tile_m1(const Tiles& t, int64_t n0, int64_t nb, int64_t m0) {
  const uint8_t* q[NB_];
  const float* d[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) {
    const int64_t r = tile_row<NB_>(n0, nb, j);
    q[j] = t.q + r * t.row_bytes;
    d[j] = t.s + r * t.groups;
  }
  const float* x = t.x + m0 * t.k;
  const char* next = next_tile<NB_>(t, n0);
  __m256 acc[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t p = 0; p < 16 * NB_; p += 64) _mm_prefetch(next + g * 16 * NB_ + p, _MM_HINT_T0);
    const float* xg = x + g * GROUP4;
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j) {
      __m256 w[4];
      widen_group4(q[j] + g * 16, w);
      // two short chains rather than one of four: more groups in flight at once
      __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(xg), w[0]);
      __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(xg + 8), w[1]);
      p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w[2], p0);
      p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w[3], p1);
      acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(d[j] + g), _mm256_add_ps(p0, p1), acc[j]);
    }
  }
  const float* xs = t.xsum + m0 * t.groups;
  for (int64_t j = 0; j < nb; ++j) {
    const float* mn = t.mn + (n0 + j) * t.groups;
    t.y[m0 * t.n + n0 + j] = hsum(acc[j]) + dot8(mn, xs, t.groups);
  }
}

// MR_ rows of x, NB_ 4-bit weight rows: each group's 32 weights are dequantized in
// registers (d q + m, one FMA a vector of 8) once, then used for all MR_ rows of x.
template <int MR_, int NB_>
void int4_tile(const Tiles& t, int64_t n0, int64_t nb, int64_t m0) {
  const uint8_t* q[NB_];
  const float* d[NB_];
  const float* mn[NB_];
  MINIVLLM_UNROLL
  for (int j = 0; j < NB_; ++j) {
    const int64_t r = tile_row<NB_>(n0, nb, j);
    q[j] = t.q + r * t.row_bytes;
    d[j] = t.s + r * t.groups;
    mn[j] = t.mn + r * t.groups;
  }
  const float* xr[MR_];
  for (int i = 0; i < MR_; ++i) xr[i] = t.x + (m0 + i) * t.k;
  const char* next = next_tile<NB_>(t, n0);
  __m256 acc[MR_][NB_];
  MINIVLLM_UNROLL
  for (int i = 0; i < MR_; ++i)
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    for (int64_t p = 0; p < 16 * NB_; p += 64) _mm_prefetch(next + g * 16 * NB_ + p, _MM_HINT_T0);
    MINIVLLM_UNROLL
    for (int j = 0; j < NB_; ++j) {
      __m256 w[4];
      widen_group4(q[j] + g * 16, w);
      const __m256 dv = _mm256_broadcast_ss(d[j] + g), mv = _mm256_broadcast_ss(mn[j] + g);
      MINIVLLM_UNROLL
      for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(w[c], dv, mv);
      MINIVLLM_UNROLL
      for (int i = 0; i < MR_; ++i) {
        const float* xg = xr[i] + g * GROUP4;
        MINIVLLM_UNROLL
        for (int c = 0; c < 4; ++c)
          acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * c), w[c], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR_; ++i)
    for (int64_t j = 0; j < nb; ++j) t.y[(m0 + i) * t.n + n0 + j] = hsum(acc[i][j]);
}

using TileFn = void (*)(const Tiles&, int64_t, int64_t, int64_t);

// y = x W^T, tile by tile. Threads take whole blocks of NB_ weight rows (each read from
// memory once, by one thread). Within a block, `tile_mr` covers MR rows of x at a time
// and `tile_1` the last row when M is odd (M = 1: tile_1 only); after the first pass
// the block's weights are in L1.
template <int NB_>
void run_tiles(const Tiles& t, TileFn tile_mr, TileFn tile_1) {
  const int64_t blocks = (t.n + NB_ - 1) / NB_;
  at::parallel_for(0, blocks, grain_for(NB_ * t.k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB_, nb = std::min<int64_t>(NB_, t.n - n0);
      int64_t m0 = 0;
      for (; m0 + MR <= t.m; m0 += MR) tile_mr(t, n0, nb, m0);
      if (m0 < t.m) tile_1(t, n0, nb, m0);
    }
  });
}
#endif

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
  at::parallel_for(0, n, grain_for(k * m_rows), [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, n, grain_for(k * m_rows), [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, n, grain_for(k), [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, n, grain_for(k), [&](int64_t begin, int64_t end) {
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
