// A linear layer for decode-shaped inputs: y = x W^T + b with few rows (M <= ~16).
//
// At decode time a linear layer multiplies a handful of token rows by a weight
// matrix that is far larger than every cache, so its cost is the time to read
// the weights once: N * K * 2 bytes in bf16, 4 in float32. A GEMM library tiles for reuse
// that a 1-row input does not have, and reaches about half the read bandwidth;
// this kernel streams each weight row exactly once, front to back, and spends
// its arithmetic on all M input rows while that weight row sits in L1.
//
// - Work item: NB = 4 output features (4 weight rows, read from memory once).
//   For each block of up to MB = 4 input rows, NB x MB float32 accumulators
//   live in registers; the weight rows are re-read from L1 for the next block.
// - Where the CPU has AVX-512 BF16 (compile time: the build uses the native
//   instruction set), _mm512_dpbf16_ps multiplies 32 bf16 pairs and adds them
//   into 16 float32 lanes in one instruction. Activations are rounded to bf16
//   once per call; float32 activations are split into two bf16 halves
//   (x = hi + lo, hi = bf16(x), lo = bf16(x - hi)) and both are multiplied,
//   which keeps ~16 significant bits of x, for twice the (cheap) arithmetic.
// - Float32 weights, and bf16 ones elsewhere (or with portable=true), take a
//   plain loop: bf16 weights are widened to float32 in registers (a 16-bit
//   shift), and a 2 x 4 (or, for one row, 1 x 8) block of 8-lane partial sums
//   is accumulated with fused multiply-adds the compiler vectorises (AVX2/FMA,
//   NEON); activations stay float32. For float32 weights this beats MKL, whose
//   sgemm packs the whole weight matrix first (2 rows and up) and whose sgemv
//   (1 row) does not keep two cores streaming (docs/kernels.md has the numbers).
// - K tails (K % 32 on the BF16 path) are masked loads, never reads past a row;
//   the portable path's K % 8 tail is a scalar loop.
// - Output features are split over threads with parallel_for_revocable (thread_team.h):
//   a chunk computes into its own buffer and writes `out` only if the caller has not
//   taken it over, so a helper whose core another process holds never holds up a step.
#include "ops.h"

#include <c10/util/BFloat16.h>

#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MINIVLLM_HAVE_AVX512BF16 1
#else
#define MINIVLLM_HAVE_AVX512BF16 0
#endif

namespace minivllm {
namespace {

constexpr int64_t NB = 4;  // output features (weight rows) per register block
constexpr int64_t MB = 4;  // input rows per register block

// float32 from bf16 bits: the bf16 is the float's top half.
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// --------------------------------------------------------------------------- portable path
// Two register blocks, both of 8 vectors of 8-lane partial sums:
// - 2 input rows x 4 weight rows (2 rows or more): each k step loads 2 + 4
//   vectors for 8 FMAs.
// - 1 input row x 8 weight rows (a single row, and the last row of an odd M):
//   each k step loads 1 + 8 vectors for 8 FMAs. Padding one row to two would
//   do the same loads for twice the FMAs; measured on a 2-core EPYC, that cost
//   about a third of the bandwidth at M = 1.
// AVX2 has 16 vector registers: 8 accumulators plus the loaded vectors fit,
// and 8 independent accumulators hide the FMA latency.
constexpr int VL = 8;
constexpr int64_t MR = 2;   // input rows of the 2 x 4 block
constexpr int64_t NB1 = 8;  // weight rows of the 1 x 8 block

// VL floats as one value: GCC/Clang's vector extension, portable C++ to every
// target they support (AVX2 ymm here, NEON pairs on ARM). Written as a plain
// float acc[MR][NB][VL] array, GCC kept the accumulators in memory, not registers.
typedef float vecf __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vecu16 __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vecu32 __attribute__((vector_size(VL * sizeof(uint32_t))));

inline vecf load_vecf(const float* p) {  // an unaligned load
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// VL bf16 weights widened to float32 in registers: zero-extend, shift into the top half.
// With AVX2 that is one vpmovzxwd from memory and one shift; GCC's generic code for
// the same vector-extension line zero-extends in two halves and re-joins them.
inline vecf load_vecf(const uint16_t* p) {
#if defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vecf>(_mm256_castsi256_ps(u));
#else
  vecu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vecu32 u = __builtin_convertvector(h, vecu32) << 16;
  vecf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}
// out[i][j] = x_i . w_j for R activation rows and C weight rows, all float32, with
// R x C vectors of partial sums. `next` (or nullptr): the next block's C weight rows,
// prefetched into L2 a cache line of each per 16 floats, at the same k (8 rows of
// 2304 bytes are read side by side, and the hardware prefetcher alone kept a core's
// reads 7-9% below that on SmolLM2's K = 576 layers; docs/kernels.md).
// noinline: inlined into the thread lambda, GCC stored every accumulator to the
// stack on each k step (and left one FMA uncontracted); as its own function the
// loop is loads and FMAs only. One call per block of rows costs nothing.
template <int64_t R, int64_t C>
__attribute__((noinline)) void dot_block(const float* const* xr, const float* const* wr,
                                         int64_t K, float out[R][C],
                                         const float* const* next = nullptr) {
  vecf acc[R][C] = {};
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    if (next != nullptr && k % 16 == 0) {
      for (int64_t j = 0; j < C; ++j) __builtin_prefetch(next[j] + k, 0, 2);  // into L2
    }
    vecf xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = load_vecf(xr[i] + k);
    for (int64_t j = 0; j < C; ++j) {
      const vecf wv = load_vecf(wr[j] + k);
      for (int64_t i = 0; i < R; ++i) acc[i][j] += xv[i] * wv;  // contracted to FMAs
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      float tail = 0.f;  // the K % VL last elements
      for (int64_t t = k; t < K; ++t) tail += xr[i][t] * wr[j][t];
      const vecf a = acc[i][j];
      out[i][j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) + tail;
    }
  }
}

// Weight rows [n, n + nb) as float32 row pointers, a short block repeating its last
// row: float32 weights in place; bf16 ones widened into `buf` (C x K floats, in L1)
// one row after another. Widening in the dot product's loop instead reads C rows
// side by side: with bf16's 1152-byte rows that measured 25% slower than this
// front-to-back read, which the hardware prefetcher follows best.
template <int64_t C>
inline void weight_rows(const float* w, int64_t n, int64_t nb, int64_t K, float*,
                        const float* wr[C]) {
  for (int64_t j = 0; j < C; ++j) wr[j] = w + (n + std::min(j, nb - 1)) * K;
}
template <int64_t C>
inline void weight_rows(const uint16_t* w, int64_t n, int64_t nb, int64_t K, float* buf,
                        const float* wr[C]) {
  for (int64_t j = 0; j < nb; ++j) {
    const uint16_t* src = w + (n + j) * K;
    float* dst = buf + j * K;
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
      const vecf v = load_vecf(src + k);
      std::memcpy(dst + k, &v, sizeof(v));
    }
    for (; k < K; ++k) dst[k] = bf16_bits_to_float(src[k]);
    wr[j] = dst;
  }
  for (int64_t j = nb; j < C; ++j) wr[j] = wr[nb - 1];
}

// out[m][n] = sum_k x[m][k] * w[n][k] for n in [n0, n1) (out is M x (n1 - n0)), with
// weight blocks of C rows: each block is read from memory once, then from L1 by
// every block of input rows (R x C register blocks, R = 2, and R = 1 for the last
// row of an odd M).
template <int64_t C, typename W>
void gemv_rows(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t n0,
               int64_t n1) {
  std::vector<float> buf(std::is_same_v<W, float> ? 0 : C * K);  // bf16 rows, widened
  const int64_t width = n1 - n0;
  for (int64_t n = n0; n < n1; n += C) {
    if (chunk_cancelled()) return;  // the caller took this chunk over: its copy counts
    const int64_t nb = std::min(C, n1 - n);
    const float* wr[C];
    weight_rows<C>(w, n, nb, K, buf.data(), wr);
    const float* next[C];  // float32 weights are read in place: prefetch the next block
    const bool pf = std::is_same_v<W, float> && n + C < n1;
    if (pf) for (int64_t j = 0; j < C; ++j) next[j] = wr[j] + C * K;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const float* xr[MR] = {x + m0 * K, x + std::min(m0 + 1, M - 1) * K};
      float r[MR][C];
      if (m0 + 1 < M) {
        dot_block<MR, C>(xr, wr, K, r, m0 == 0 && pf ? next : nullptr);
      } else {
        dot_block<1, C>(xr, wr, K, r, m0 == 0 && pf ? next : nullptr);
      }
      for (int64_t i = 0; i < std::min(MR, M - m0); ++i)
        for (int64_t j = 0; j < nb; ++j) out[(m0 + i) * width + (n - n0) + j] = r[i][j];
    }
  }
}

// The portable GEMV: one input row takes 1 x 8 blocks, more rows 2 x 4 blocks.
template <typename W>
void gemv_portable(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t n0,
                   int64_t n1) {
  if (M == 1) {
    gemv_rows<NB1>(x, M, K, w, out, n0, n1);
  } else {
    gemv_rows<NB>(x, M, K, w, out, n0, n1);
  }
}

#if MINIVLLM_HAVE_AVX512BF16
// ------------------------------------------------------------------------- AVX-512 BF16 path
// x: `parts` bf16 copies of the activations (hi, and lo for float32), each M rows
// of K elements. Accumulates NB weight rows x up to MB input rows in registers.
// While the first block of input rows runs, the next NB weight rows are prefetched
// into L2, 64 bytes of each a k step: with the hardware prefetcher alone a core read
// its 4 rows at 70% of its read bandwidth, with the prefetch at 100% (docs/kernels.md).
void gemv_avx512bf16(const uint16_t* x, int parts, int64_t M, int64_t K, const uint16_t* w,
                     float* out, int64_t n0, int64_t n1) {
  const int64_t k_full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k_full)) - 1);
  const int64_t width = n1 - n0;
  for (int64_t n = n0; n < n1; n += NB) {
    if (chunk_cancelled()) return;  // the caller took this chunk over: its copy counts
    const int64_t nb = std::min(NB, n1 - n);
    const uint16_t* wr[NB];
    for (int64_t j = 0; j < NB; ++j) wr[j] = w + (n + std::min(j, nb - 1)) * K;  // pad: repeat
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      const bool prefetch = m0 == 0 && n + NB < n1;  // once, and only this thread's rows
      __m512 acc[MB][NB];
      for (int64_t i = 0; i < MB; ++i)
        for (int64_t j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
      for (int64_t k = 0; k <= k_full; k += 32) {
        const bool last = k == k_full;
        if (last && tail == 0) break;
        __m512bh wv[NB];
        if (prefetch) {  // the next block's rows, at the same k, into L2
          for (int64_t j = 0; j < NB; ++j) {
            _mm_prefetch(reinterpret_cast<const char*>(wr[j] + NB * K + k), _MM_HINT_T1);
          }
        }
        for (int64_t j = 0; j < NB; ++j) {
          const __m512i v = last ? _mm512_maskz_loadu_epi16(tail, wr[j] + k)
                                 : _mm512_loadu_si512(wr[j] + k);
          wv[j] = reinterpret_cast<__m512bh>(v);
        }
        for (int p = 0; p < parts; ++p) {
          for (int64_t i = 0; i < MB; ++i) {
            if (i >= mb) break;
            const uint16_t* xr = x + (p * M + m0 + i) * K + k;
            const __m512i xi = last ? _mm512_maskz_loadu_epi16(tail, xr) : _mm512_loadu_si512(xr);
            const __m512bh xv = reinterpret_cast<__m512bh>(xi);
            for (int64_t j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
          }
        }
      }
      for (int64_t i = 0; i < mb; ++i)
        for (int64_t j = 0; j < nb; ++j)
          out[(m0 + i) * width + (n - n0) + j] = _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}
// gemv_avx512bf16 for one input row (a batch-1 decode step), the same bits: blocks of NB1
// weight rows, each row's accumulator and the activations' PARTS vectors in registers.
// The general loop's accumulators (an MB x NB array with run-time bounds) lived on the
// stack, a store and a load around every dot product: on the Zen 4 EPYC it read a bf16
// weight at about the same speed from L2 as from memory (docs/kernels.md).
template <int PARTS>
void gemv_avx512bf16_one_row(const uint16_t* x, int64_t K, const uint16_t* w, float* out,
                             int64_t n0, int64_t n1) {
  const int64_t k_full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k_full)) - 1);
  for (int64_t n = n0; n < n1; n += NB1) {
    if (chunk_cancelled()) return;  // the caller took this chunk over: its copy counts
    const int64_t nb = std::min(NB1, n1 - n);
    const uint16_t* wr[NB1];
    for (int64_t j = 0; j < NB1; ++j) wr[j] = w + (n + std::min(j, nb - 1)) * K;  // pad: repeat
    const bool prefetch = n + NB1 < n1;  // the next block's rows, this thread's only
    __m512 acc[NB1];
#pragma GCC unroll 8
    for (int64_t j = 0; j < NB1; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k <= k_full; k += 32) {
      const bool last = k == k_full;
      if (last && tail == 0) break;
      const __mmask32 mask = last ? tail : ~__mmask32{0};
      __m512bh xv[PARTS];
#pragma GCC unroll 2
      for (int p = 0; p < PARTS; ++p) {
        xv[p] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + p * K + k));
      }
#pragma GCC unroll 8
      for (int64_t j = 0; j < NB1; ++j) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + NB1 * K + k), _MM_HINT_T1);
        const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, wr[j] + k));
#pragma GCC unroll 2
        for (int p = 0; p < PARTS; ++p) acc[j] = _mm512_dpbf16_ps(acc[j], xv[p], wv);
      }
    }
    for (int64_t j = 0; j < nb; ++j) out[n - n0 + j] = _mm512_reduce_add_ps(acc[j]);
  }
}
#endif

// Round float rows to bf16 bits (round to nearest even, as c10::BFloat16 does).
inline uint16_t float_to_bf16_bits(float f) { return c10::BFloat16(f).x; }

}  // namespace

bool gemv_has_avx512_bf16() { return MINIVLLM_HAVE_AVX512BF16 != 0; }

void linear_small_m(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool portable) {
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && out.dim() == 2,
              "input (M, K), weight (N, K), out (M, N)");
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must be (N, K) with K = input.size(1)");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be (M, N)");
  const bool w_f32 = weight.scalar_type() == at::kFloat;
  TORCH_CHECK((w_f32 || weight.scalar_type() == at::kBFloat16) && weight.is_contiguous(),
              "weight must be contiguous float32 or bfloat16");
  TORCH_CHECK(input.stride(1) == 1 && out.is_contiguous(),
              "input rows must have unit stride; out must be contiguous");
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "out and input must share a dtype");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "input must be float32 or bfloat16");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "bias must be contiguous (N,)");
  }
  if (M == 0 || N == 0) return;
  const bool is_f32 = input.scalar_type() == at::kFloat;
  const int64_t x_st = input.stride(0);
  // float32 weights always take the FMA path: a bf16 dot product would round them.
  const bool use_bf16_dot = MINIVLLM_HAVE_AVX512BF16 && !portable && !w_f32;

  // What every chunk reads, held by value: the caller may take a late helper's chunk
  // over and return while that helper still reads (parallel_for_revocable).
  struct Job {
    at::Tensor weight, out;
    std::optional<at::Tensor> bias;
    int64_t M, K, N;
    bool is_f32, w_f32, use_bf16_dot;
    int parts = 1;
    std::vector<float> xf;     // portable: float32 rows
    std::vector<uint16_t> xb;  // BF16 dot products: bf16 rows (hi, then lo for float32 input)
  };
  auto job = std::make_shared<Job>(Job{weight, out, bias, M, K, N, is_f32, w_f32, use_bf16_dot});
  // The activations, once, in the layout the chosen path reads (contiguous rows).
  if (use_bf16_dot) {
    job->parts = is_f32 ? 2 : 1;
    std::vector<uint16_t>& xb = job->xb;
    xb.resize(job->parts * M * K);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* hi = xb.data() + m * K;
      if (is_f32) {
        const float* xr = input.data_ptr<float>() + m * x_st;
        uint16_t* lo = xb.data() + (M + m) * K;
        for (int64_t k = 0; k < K; ++k) {
          hi[k] = float_to_bf16_bits(xr[k]);
          lo[k] = float_to_bf16_bits(xr[k] - bf16_bits_to_float(hi[k]));
        }
      } else {
        const at::BFloat16* xr = input.data_ptr<at::BFloat16>() + m * x_st;
        for (int64_t k = 0; k < K; ++k) hi[k] = xr[k].x;
      }
    }
  } else {
    std::vector<float>& xf = job->xf;
    xf.resize(M * K);
    for (int64_t m = 0; m < M; ++m) {
      float* dst = xf.data() + m * K;
      if (is_f32) {
        const float* xr = input.data_ptr<float>() + m * x_st;
        std::copy(xr, xr + K, dst);
      } else {
        const at::BFloat16* xr = input.data_ptr<at::BFloat16>() + m * x_st;
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(xr[k]);
      }
    }
  }

  // Threads take whole blocks of NB1 (a multiple of NB) output features; a small
  // layer stays on one thread.
  static_assert(NB1 % NB == 0, "a thread's share must hold whole blocks of both sizes");
  const int64_t blocks = (N + NB1 - 1) / NB1;
  parallel_for_revocable(0, blocks, grain_for(NB1 * K), [job](int64_t b0, int64_t b1) {
    const Job& j = *job;
    const int64_t M = j.M, K = j.K, N = j.N;
    const int64_t n0 = b0 * NB1, n1 = std::min(N, b1 * NB1);
    std::vector<float> y(M * (n1 - n0));  // this thread's columns, M x (n1 - n0)
    if (j.w_f32) {
      gemv_portable(j.xf.data(), M, K, j.weight.data_ptr<float>(), y.data(), n0, n1);
    } else {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(j.weight.data_ptr<at::BFloat16>());
#if MINIVLLM_HAVE_AVX512BF16
      if (j.use_bf16_dot && M == 1 && j.parts == 1) {
        gemv_avx512bf16_one_row<1>(j.xb.data(), K, w, y.data(), n0, n1);
      } else if (j.use_bf16_dot && M == 1) {
        gemv_avx512bf16_one_row<2>(j.xb.data(), K, w, y.data(), n0, n1);
      } else if (j.use_bf16_dot) {
        gemv_avx512bf16(j.xb.data(), j.parts, M, K, w, y.data(), n0, n1);
      } else {
        gemv_portable(j.xf.data(), M, K, w, y.data(), n0, n1);
      }
#else
      gemv_portable(j.xf.data(), M, K, w, y.data(), n0, n1);
#endif
    }
    if (!chunk_commit_begin()) return;  // the caller ran this chunk itself
    const int64_t width = n1 - n0;
    for (int64_t m = 0; m < M; ++m) {
      const float* src = y.data() + m * width;
      if (j.is_f32) {
        float* o = j.out.data_ptr<float>() + m * N + n0;
        if (j.bias.has_value()) {
          MINIVLLM_DISPATCH(j.bias->scalar_type(), "linear_small_m_bias", [&] {
            const scalar_t* b = j.bias->data_ptr<scalar_t>() + n0;
            for (int64_t i = 0; i < width; ++i) o[i] = src[i] + static_cast<float>(b[i]);
          });
        } else {
          std::copy(src, src + width, o);
        }
      } else {
        at::BFloat16* o = j.out.data_ptr<at::BFloat16>() + m * N + n0;
        if (j.bias.has_value()) {
          MINIVLLM_DISPATCH(j.bias->scalar_type(), "linear_small_m_bias", [&] {
            const scalar_t* b = j.bias->data_ptr<scalar_t>() + n0;
            for (int64_t i = 0; i < width; ++i)
              o[i] = static_cast<at::BFloat16>(src[i] + static_cast<float>(b[i]));
          });
        } else {
          for (int64_t i = 0; i < width; ++i) o[i] = static_cast<at::BFloat16>(src[i]);
        }
      }
    }
  });
}

}  // namespace minivllm
