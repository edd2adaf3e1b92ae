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
//   plain loop: bf16 weights are widened to float32 (a 16-bit shift), and an
//   MR x NB block of 8-lane partial sums is accumulated with fused multiply-adds
//   the compiler vectorises (AVX2/FMA, NEON); activations stay float32. For
//   float32 weights this beats MKL's sgemm from 2 rows up, which packs the
//   whole weight matrix first (see docs/kernels.md for the numbers).
// - K tails (K % 32 on the BF16 path) are masked loads, never reads past a row;
//   the portable path's K % 8 tail is a scalar loop.
// - Output features are split over threads with at::parallel_for.
#include "ops.h"

#include <c10/util/BFloat16.h>

#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
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
// The portable register block: MR input rows x NB weight rows x VL lanes of
// partial sums, 2 x 4 x 8 = 8 vectors of 8 floats. AVX2 has 16 vector
// registers; the 4 weight vectors and one activation vector need room too, so
// the AVX-512 path's MB = 4 rows would spill. Each k step loads MR + NB
// vectors for MR * NB FMAs, and 8 independent accumulators hide the FMA latency.
constexpr int64_t MR = 2;
constexpr int VL = 8;

// VL floats as one value: GCC/Clang's vector extension, portable C++ to every
// target they support (AVX2 ymm here, NEON pairs on ARM). Written as a plain
// float acc[MR][NB][VL] array, GCC kept the accumulators in memory, not registers.
typedef float vecf __attribute__((vector_size(VL * sizeof(float))));
inline vecf load_vecf(const float* p) {  // an unaligned load
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// out[i][j] = x_i . w_j for MR activation rows and NB weight rows, all float32.
inline void dot_block(const float* const* xr, const float* const* wr, int64_t K,
                      float out[MR][NB]) {
  vecf acc[MR][NB] = {};
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vecf wv[NB];
    for (int64_t j = 0; j < NB; ++j) wv[j] = load_vecf(wr[j] + k);
    for (int64_t i = 0; i < MR; ++i) {
      const vecf xv = load_vecf(xr[i] + k);
      for (int64_t j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];  // contracted to FMAs
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < NB; ++j) {
      float tail = 0.f;  // the K % VL last elements
      for (int64_t t = k; t < K; ++t) tail += xr[i][t] * wr[j][t];
      const vecf a = acc[i][j];
      out[i][j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) + tail;
    }
  }
}

// Weight row r as float32: a float32 weight is used in place; a bf16 one is
// widened into `buf` (K floats, a 16-bit shift each) while it streams in.
inline const float* weight_row(const float* w, int64_t r, int64_t K, float*) { return w + r * K; }
inline const float* weight_row(const uint16_t* w, int64_t r, int64_t K, float* buf) {
  const uint16_t* src = w + r * K;
  for (int64_t k = 0; k < K; ++k) buf[k] = bf16_bits_to_float(src[k]);
  return buf;
}

// out[m][n] = sum_k x[m][k] * w[n][k] for n in [n0, n1): x is float32 rows (K floats
// each); W is float (float32 weights) or uint16_t (bf16 bits). Each NB-block of weight
// rows is read from memory once and then from L1 for every MR-block of input rows.
template <typename W>
void gemv_portable(const float* x, int64_t M, int64_t K, const W* w,
                   float* out, int64_t n0, int64_t n1) {
  std::vector<float> wf(std::is_same_v<W, float> ? 0 : NB * K);  // bf16 rows, widened
  const int64_t width = n1 - n0;
  for (int64_t n = n0; n < n1; n += NB) {
    const int64_t nb = std::min(NB, n1 - n);
    const float* wr[NB];
    for (int64_t j = 0; j < NB; ++j)  // pad a short block by repeating its last row
      wr[j] = j < nb ? weight_row(w, n + j, K, wf.data() + j * K) : wr[nb - 1];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = std::min(MR, M - m0);
      const float* xr[MR];
      for (int64_t i = 0; i < MR; ++i) xr[i] = x + (m0 + std::min(i, mr - 1)) * K;
      float r[MR][NB];
      dot_block(xr, wr, K, r);
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nb; ++j) out[(m0 + i) * width + (n - n0) + j] = r[i][j];
    }
  }
}

#if MINIVLLM_HAVE_AVX512BF16
// ------------------------------------------------------------------------- AVX-512 BF16 path
// x: `parts` bf16 copies of the activations (hi, and lo for float32), each M rows
// of K elements. Accumulates NB weight rows x up to MB input rows in registers.
void gemv_avx512bf16(const uint16_t* x, int parts, int64_t M, int64_t K, const uint16_t* w,
                     float* out, int64_t n0, int64_t n1) {
  const int64_t k_full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k_full)) - 1);
  const int64_t width = n1 - n0;
  for (int64_t n = n0; n < n1; n += NB) {
    const int64_t nb = std::min(NB, n1 - n);
    const uint16_t* wr[NB];
    for (int64_t j = 0; j < NB; ++j) wr[j] = w + (n + std::min(j, nb - 1)) * K;  // pad: repeat
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      __m512 acc[MB][NB];
      for (int64_t i = 0; i < MB; ++i)
        for (int64_t j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
      for (int64_t k = 0; k <= k_full; k += 32) {
        const bool last = k == k_full;
        if (last && tail == 0) break;
        __m512bh wv[NB];
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

  // The activations, once, in the layout the chosen path reads (contiguous rows).
  std::vector<float> xf;     // portable: float32 rows
  std::vector<uint16_t> xb;  // BF16 dot products: bf16 rows (hi, then lo for float32 input)
  int parts = 1;
  if (use_bf16_dot) {
    parts = is_f32 ? 2 : 1;
    xb.resize(parts * M * K);
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

  // Threads take whole NB-blocks of output features; a small layer stays on one thread.
  const int64_t blocks = (N + NB - 1) / NB;
  const int64_t grain = grain_for(NB * K);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * NB, n1 = std::min(N, b1 * NB);
    std::vector<float> y(M * (n1 - n0));  // this thread's columns, M x (n1 - n0)
    if (w_f32) {
      gemv_portable(xf.data(), M, K, weight.data_ptr<float>(), y.data(), n0, n1);
    } else {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
#if MINIVLLM_HAVE_AVX512BF16
      if (use_bf16_dot) {
        gemv_avx512bf16(xb.data(), parts, M, K, w, y.data(), n0, n1);
      } else {
        gemv_portable(xf.data(), M, K, w, y.data(), n0, n1);
      }
#else
      gemv_portable(xf.data(), M, K, w, y.data(), n0, n1);
#endif
    }
    const int64_t width = n1 - n0;
    for (int64_t m = 0; m < M; ++m) {
      const float* src = y.data() + m * width;
      if (is_f32) {
        float* o = out.data_ptr<float>() + m * N + n0;
        if (bias.has_value()) {
          MINIVLLM_DISPATCH(bias->scalar_type(), "linear_small_m_bias", [&] {
            const scalar_t* b = bias->data_ptr<scalar_t>() + n0;
            for (int64_t j = 0; j < width; ++j) o[j] = src[j] + static_cast<float>(b[j]);
          });
        } else {
          std::copy(src, src + width, o);
        }
      } else {
        at::BFloat16* o = out.data_ptr<at::BFloat16>() + m * N + n0;
        if (bias.has_value()) {
          MINIVLLM_DISPATCH(bias->scalar_type(), "linear_small_m_bias", [&] {
            const scalar_t* b = bias->data_ptr<scalar_t>() + n0;
            for (int64_t j = 0; j < width; ++j)
              o[j] = static_cast<at::BFloat16>(src[j] + static_cast<float>(b[j]));
          });
        } else {
          for (int64_t j = 0; j < width; ++j) o[j] = static_cast<at::BFloat16>(src[j]);
        }
      }
    }
  });
}

}  // namespace minivllm
