// A linear layer for decode-shaped inputs: y = x W^T + b with few rows (M <= ~16).
//
// At decode time a linear layer multiplies a handful of token rows by a weight
// matrix that is far larger than every cache, so its cost is the time to read
// the weights once: N * K * 2 bytes in bf16. A GEMM library tiles for reuse
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
// - Elsewhere (or with portable=true) a plain loop converts each bf16 weight to
//   float32 (a 16-bit shift) and accumulates LANES partial sums with fused
//   multiply-adds the compiler vectorises; activations stay float32.
// - K tails (K % 32 on the BF16 path) are masked loads, never reads past a row.
// - Output features are split over threads with at::parallel_for.
#include "ops.h"

#include <c10/util/BFloat16.h>

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
// out[m][n] = sum_k x[m][k] * w[n][k] for n in [n0, n1): x is float32 rows (K floats each).
void gemv_portable(const float* x, int64_t M, int64_t K, const uint16_t* w,
                   float* out, int64_t n0, int64_t n1) {
  std::vector<float> wf(NB * K);  // NB weight rows as float32, converted once per block
  for (int64_t n = n0; n < n1; n += NB) {
    const int64_t nb = std::min(NB, n1 - n);
    for (int64_t j = 0; j < nb; ++j) {
      const uint16_t* wr = w + (n + j) * K;
      float* dst = wf.data() + j * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits_to_float(wr[k]);
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t j = 0; j < nb; ++j) out[m * (n1 - n0) + (n - n0) + j] =
          dot(x + m * K, wf.data() + j * K, K);
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
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "weight must be contiguous bfloat16");
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
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const bool use_bf16_dot = MINIVLLM_HAVE_AVX512BF16 && !portable;

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
#if MINIVLLM_HAVE_AVX512BF16
    if (use_bf16_dot) {
      gemv_avx512bf16(xb.data(), parts, M, K, w, y.data(), n0, n1);
    } else {
      gemv_portable(xf.data(), M, K, w, y.data(), n0, n1);
    }
#else
    gemv_portable(xf.data(), M, K, w, y.data(), n0, n1);
#endif
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
