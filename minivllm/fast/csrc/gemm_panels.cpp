// A float32 GEMM for decode batches: y = x W^T + b with tens of rows (17 <= M <= 256).
//
// Between the small-M GEMV (gemv.cpp, up to 16 rows, bound by reading the weights)
// and a prefill's hundreds of rows (oneDNN, bound by arithmetic) lies the batch-64
// decode step. There the weights are read once a step from memory (SmolLM2's 540 MB
// in float32, about 19 ms at the Xeon's 28 GB/s) and each weight element is used M
// times. oneDNN's GEMM does not overlap those reads with its arithmetic: on the
// Xeon, its 30 layers took 74 ms with the weights in memory and 55 ms with one layer's
// weights, in cache, 30 times over (docs/kernels.md, "The batch-64 float32 GEMM").
// This kernel asks for the next weight panel while it multiplies this one:
//
// - The weight is packed once at load (minivllm/fast/linear_prepack.py) into panels of
//   NR = 48 output features: panel p is a (K, 48) row-major block, the features
//   p*48 .. p*48+47 of each input feature side by side (N padded with zero rows).
// - Register block: MR = 8 rows of x by the panel's 48 features = 24 zmm
//   accumulators. Each k step loads the panel's 3 vectors at k, broadcasts the 8
//   rows' x[r][k] and does 24 FMAs; 24 independent chains cover the FMA latency.
//   The panel (K x 192 bytes: 108 KiB at K = 576) stays in L2 while the M / 8
//   blocks of rows run over it; x's rows stay in L1 / L2.
// - While a panel's blocks run, the next panel of this thread's range is prefetched
//   into L2 (prefetcht1), its cache lines spread evenly over the blocks' k steps, so
//   the memory reads overlap the FMAs instead of preceding them.
// - Panels are split over threads with parallel_for (thread_team.h), a contiguous
//   range each, so "the next panel" is usually the one this thread runs next.
// - Accumulation is float32 FMAs in k order per output element: not oneDNN's order,
//   so results differ from F.linear's by rounding (tests/test_gemm_panels.py
//   compares both with a float64 oracle).
//
// It needs AVX-512F (32 vector registers of 16 floats); gemm_panels_width() is 0
// where the build has no AVX-512, and the linear layer keeps oneDNN there.
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define MINIVLLM_HAVE_PANELS 1
#else
#define MINIVLLM_HAVE_PANELS 0
#endif

namespace minivllm {
namespace {

#if MINIVLLM_HAVE_PANELS
constexpr int64_t NR = 48;  // output features per panel: 3 vectors of 16
constexpr int64_t MR = 8;   // rows of x per register block
constexpr int64_t LINE = 64;

// The 3 vectors' lane masks for the first `cols` features of a panel (cols <= NR).
inline void column_masks(int64_t cols, __mmask16* masks) {
  for (int64_t v = 0; v < 3; ++v) {
    const int64_t left = std::clamp<int64_t>(cols - v * 16, 0, 16);
    masks[v] = static_cast<__mmask16>((1u << left) - 1u);
  }
}

// c[r][0 .. cols) = bias + sum_k a[r][k] * b[k][0 .. cols) for R rows (R <= MR): R x 3
// accumulators in registers. Meanwhile prefetch `pf_lines` cache lines from `pf` into L2,
// per_k of them each k step. noinline: one call per block, and GCC keeps the 24
// accumulators in registers in a function of their own.
template <int R>
__attribute__((noinline)) void panel_block(const float* __restrict a, int64_t lda,
                                           const float* __restrict b, int64_t K,
                                           float* __restrict c, int64_t ldc,
                                           const float* __restrict bias, int64_t cols,
                                           const char* pf, int64_t pf_lines) {
  __mmask16 mask[3];
  column_masks(cols, mask);
  __m512 acc[R][3];
  for (int v = 0; v < 3; ++v) {
    const __m512 init = bias != nullptr ? _mm512_maskz_loadu_ps(mask[v], bias + v * 16)
                                        : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][v] = init;
  }
  const int64_t per_k = (pf_lines + K - 1) / K;  // 0 without a prefetch
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t j = k * per_k; j < std::min(pf_lines, (k + 1) * per_k); ++j) {
      _mm_prefetch(pf + j * LINE, _MM_HINT_T1);
    }
    const float* bk = b + k * NR;
    const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16),
                 b2 = _mm512_loadu_ps(bk + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 3; ++v) _mm512_mask_storeu_ps(c + r * ldc + v * 16, mask[v], acc[r][v]);
  }
}

using Block = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                       const float*, int64_t, const char*, int64_t);
constexpr Block BLOCKS[MR + 1] = {nullptr,        panel_block<1>, panel_block<2>,
                                  panel_block<3>, panel_block<4>, panel_block<5>,
                                  panel_block<6>, panel_block<7>, panel_block<8>};
#endif

}  // namespace

int64_t gemm_panels_width() {
#if MINIVLLM_HAVE_PANELS
  return NR;
#else
  return 0;
#endif
}

void gemm_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                 const std::optional<at::Tensor>& bias) {
#if MINIVLLM_HAVE_PANELS
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && out.dim() == 2, "x: (M, K), panels: (P, K, ",
              NR, "), out: (M, N)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "gemm_panels is float32 only");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out.size(1);
  TORCH_CHECK(panels.size(1) == K && panels.size(2) == NR && panels.is_contiguous(),
              "panels must be contiguous (P, K, ", NR, ") with x's K = ", K);
  TORCH_CHECK(out.size(0) == M && N <= P * NR && N > (P - 1) * NR && out.is_contiguous(),
              "out must be contiguous (M, N) with N in the panels' last one");
  TORCH_CHECK(x.stride(1) == 1, "x's rows must have unit stride");
  const float* b_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(),
                "bias must be contiguous float32 (N,)");
    b_ptr = bias->data_ptr<float>();
  }
  if (M == 0 || N == 0) return;
  const float* a = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t lda = x.stride(0), panel = K * NR;
  const int64_t blocks = (M + MR - 1) / MR;
  const int64_t lines = panel * static_cast<int64_t>(sizeof(float)) / LINE;
  const int64_t lines_per_block = (lines + blocks - 1) / blocks;
  parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(w + (p + 1) * panel) : nullptr;
      const int64_t cols = std::min(NR, N - p * NR);
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t rows = std::min(MR, M - i * MR);
        const int64_t first = i * lines_per_block;
        const int64_t count = next ? std::clamp<int64_t>(lines - first, 0, lines_per_block) : 0;
        BLOCKS[rows](a + i * MR * lda, lda, w + p * panel, K, c + i * MR * N + p * NR, N,
                     b_ptr ? b_ptr + p * NR : nullptr, cols,
                     next ? next + first * LINE : nullptr, count);
      }
    }
  });
#else
  (void)out, (void)x, (void)panels, (void)bias;
  TORCH_CHECK(false, "gemm_panels needs AVX-512F (gemm_panels_width() is 0 on this build)");
#endif
}

}  // namespace minivllm
