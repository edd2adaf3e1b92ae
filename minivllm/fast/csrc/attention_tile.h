// Prefill attention in GEMM shape: one work item's query rows against the keys
// they see, computed as small matrix products on packed tiles.
//
// The row loop of attention.cpp scores one query vector against one key at a
// time (a dot product over head_dim, then a 16-lane reduction): fine for a
// decode, where each key row is used by a handful of query vectors and the op
// waits on memory anyway, but a prefill of T tokens does T^2 / 2 such dots per
// head and is bound by arithmetic. Here, per KV head of the item:
//
//   Q^T  (D x M)   the item's M query vectors (rows x the GQA group's heads),
//                  pre-scaled, float32, packed once per item;
//   K    (NK x D)  a tile of NK keys read through the block table, as float32;
//   V    (NK x Dp) the same keys' values (head_dim padded to a multiple of MR);
//   S^T = K Q^T    (NK x M), by the register-blocked micro-kernel below;
//   mask + online softmax down each column (one query vector): running max and
//                  sum per column, so every step is element-wise across the M
//                  query vectors and vectorises (a reduction along a row would
//                  not, without -ffast-math);
//   O^T += V^T P^T (Dp x M), the same micro-kernel with V read transposed.
//
// The micro-kernel keeps an MR x NR block of C in registers (4 x 24 floats = 12
// AVX2 registers; 4 x 48 with AVX-512) and walks the inner dimension: per step it
// loads NR floats of B once and broadcasts MR floats of A, 12 FMAs for 7 loads,
// where the dot-product loop does one FMA per load. K and V are read from the
// cache once per item and KV head, shared by all the query heads of the group.
// No score matrix beyond one NK x M tile exists. The micro-kernel uses the
// compiler's vector types (no intrinsics: the same source builds for AVX2,
// AVX-512 and NEON); the rest is plain loops.
#pragma once

#include "kv_cache.h"
#include "ops.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace minivllm {
namespace tile {

#if defined(__AVX512F__)
constexpr int64_t VEC = 16;  // floats per vector register
#else
constexpr int64_t VEC = 8;  // AVX2 (or two NEON registers)
#endif
constexpr int64_t MR = 4;         // rows of C per register block
constexpr int64_t NB = 3;         // vectors of C per row of a register block
constexpr int64_t NR = NB * VEC;  // columns of C per register block: query vectors
constexpr int64_t NK = 64;        // keys per tile: a multiple of MR
constexpr int64_t TILE_M = 96;    // query vectors per item and KV head (about)
static_assert(NK % MR == 0, "a key tile is whole register blocks");

// One vector register of floats, as a GCC/Clang vector type: written this way the
// accumulators stay in registers. (The same kernel over float acc[MR][NR] arrays
// compiled to 128-bit moves through the stack, slower than the dot-product loop.)
typedef float vfloat __attribute__((vector_size(VEC * sizeof(float))));
typedef float vfloat_u __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float))));
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }

// C[MR][NR] = (accumulate ? C : 0) + A[MR][k] B[k][NR]. Element (r, p) of A is
// a[r * a_rs + p * a_cs] (so A may be read transposed); B and C have row strides.
inline void micro_kernel(const float* __restrict a, int64_t a_rs, int64_t a_cs,
                         const float* __restrict b, int64_t ldb, int64_t k,
                         float* __restrict c, int64_t ldc, bool accumulate) {
  vfloat acc[MR][NB];
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t n = 0; n < NB; ++n) acc[r][n] = accumulate ? load(c + r * ldc + n * VEC) : vfloat{};
  }
  for (int64_t p = 0; p < k; ++p) {
    vfloat bv[NB];
    for (int64_t n = 0; n < NB; ++n) bv[n] = load(b + p * ldb + n * VEC);
    for (int64_t r = 0; r < MR; ++r) {
      const float ar = a[r * a_rs + p * a_cs];
      for (int64_t n = 0; n < NB; ++n) acc[r][n] += ar * bv[n];
    }
  }
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t n = 0; n < NB; ++n) store(c + r * ldc + n * VEC, acc[r][n]);
  }
}

// C (m x n) (+)= A (m x k) B (k x n), m a multiple of MR and n of NR.
inline void gemm(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                 int64_t k, float* c, int64_t ldc, int64_t m, int64_t n, bool accumulate) {
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
      micro_kernel(a + i0 * a_rs, a_rs, a_cs, b + j0, ldb, k, c + i0 * ldc + j0, ldc,
                   accumulate);
    }
  }
}

// Per-thread scratch, sized once for the op's shapes and reused by every item.
struct Scratch {
  int64_t m_cap, dp;  // query vectors per item (a multiple of NR), padded head_dim
  std::vector<float> qt, ot, st, k, v, col_max, col_sum, alpha, pos;
  Scratch(int64_t m_cap_, int64_t head_dim)
      : m_cap(m_cap_), dp((head_dim + MR - 1) / MR * MR),
        qt(head_dim * m_cap_), ot(dp * m_cap_), st(NK * m_cap_), k(NK * head_dim, 0.f),
        v(NK * dp, 0.f), col_max(m_cap_), col_sum(m_cap_), alpha(m_cap_), pos(m_cap_) {}
};

// What an item needs to know about the batch (pointers and strides of the op).
// cache_t: the cache's element type, scalar_t or a quantized code (kv_cache.h) whose
// scales k_s / v_s are contiguous (num_blocks, block_size, H_kv) (null for a float cache).
template <typename scalar_t, typename cache_t>
struct Batch {
  const scalar_t* q;
  const cache_t *k, *v;
  scalar_t* o;
  const float *k_s, *v_s;
  int64_t q_st, q_sh, o_st, o_sh;  // token / head strides of query and out
  int64_t c_sb, c_ss, c_sh;        // block / slot / head strides of the caches
  int64_t block_size, num_kv_heads, group, head_dim;
  float scale;
};

// Query rows [row_begin, row_end) of one sequence (first row of the batch q0,
// ctx cached keys before the step, block table `table`), every KV head.
template <typename scalar_t, typename cache_t>
void attend_rows(const Batch<scalar_t, cache_t>& b, const int32_t* table, int64_t q0, int64_t ctx,
                 int64_t row_begin, int64_t row_end, Scratch& w) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t D = b.head_dim, dp = w.dp, group = b.group;
  const int64_t m_count = (row_end - row_begin) * group;
  const int64_t mp = (m_count + NR - 1) / NR * NR;  // columns: query vectors, padded
  const int64_t num_keys = ctx + row_end;            // the last row sees this many
  // Query vector m = (row m / group, head m % group of the group) sees keys
  // 0 .. pos[m]. Padding columns (zero queries) see every key, so their softmax
  // stays finite; their results are never written.
  for (int64_t m = 0; m < mp; ++m) {
    w.pos[m] = static_cast<float>(m < m_count ? ctx + row_begin + m / group : num_keys - 1);
  }

  for (int64_t h = 0; h < b.num_kv_heads; ++h) {
    for (int64_t m = 0; m < mp; ++m) {
      if (m >= m_count) {  // padding columns: zero queries
        for (int64_t d = 0; d < D; ++d) w.qt[d * mp + m] = 0.f;
        continue;
      }
      const scalar_t* src = b.q + (q0 + row_begin + m / group) * b.q_st +
                            (h * group + m % group) * b.q_sh;
      for (int64_t d = 0; d < D; ++d) w.qt[d * mp + m] = static_cast<float>(src[d]) * b.scale;
    }
    std::fill(w.col_max.begin(), w.col_max.begin() + mp, NEG_INF);
    std::fill(w.col_sum.begin(), w.col_sum.begin() + mp, 0.f);
    std::fill(w.ot.begin(), w.ot.begin() + dp * mp, 0.f);

    for (int64_t t0 = 0; t0 < num_keys; t0 += NK) {
      const int64_t kt = std::min(NK, num_keys - t0);
      const int64_t kt_pad = (kt + MR - 1) / MR * MR;
      // Pack the tile's K and V rows as float32, dequantized if the cache is (rows
      // past kt keep old values: their scores are masked, and P V stops at kt).
      for (int64_t j = 0; j < kt; ++j) {
        const int64_t t = t0 + j;  // key t lives in block table[t / bs], slot t % bs
        const int64_t block = table[t / b.block_size];
        const int64_t off = block * b.c_sb + (t % b.block_size) * b.c_ss + h * b.c_sh;
        float ks = 1.f, vs = 1.f;
        if constexpr (is_quantized_v<cache_t>) {
          const int64_t s = (block * b.block_size + t % b.block_size) * b.num_kv_heads + h;
          ks = b.k_s[s];
          vs = b.v_s[s];
        }
        dequantize_row(b.k + off, ks, w.k.data() + j * D, D);
        dequantize_row(b.v + off, vs, w.v.data() + j * dp, D);
      }
      // Ask for the next tile's rows now: blocks sit anywhere in the cache (no
      // hardware prefetcher follows them), and the two GEMMs below take long
      // enough to hide the misses that the packing loop above otherwise waits on.
      for (int64_t t = t0 + NK; t < std::min(t0 + 2 * NK, num_keys); ++t) {
        const int64_t off = table[t / b.block_size] * b.c_sb + (t % b.block_size) * b.c_ss +
                            h * b.c_sh;
        for (int64_t d = 0; d < D; d += 64 / sizeof(cache_t)) {  // a cache line
          __builtin_prefetch(b.k + off + d);
          __builtin_prefetch(b.v + off + d);
        }
      }
      // S^T = K Q^T: (kt_pad x D) (D x mp).
      float* st = w.st.data();
      gemm(w.k.data(), D, 1, w.qt.data(), mp, D, st, mp, kt_pad, mp, false);
      // Mask (key t0 + j is visible to column m if t0 + j <= pos[m]), then the
      // online softmax down each column, element-wise across the row of columns.
      // (__restrict: the buffers never overlap, and without it the compiler
      // keeps these loops scalar in case they do.)
      float* __restrict cmax = w.col_max.data();
      float* __restrict csum = w.col_sum.data();
      float* __restrict alpha = w.alpha.data();
      const float* __restrict pos = w.pos.data();
      for (int64_t j = 0; j < kt_pad; ++j) {
        float* __restrict s = st + j * mp;
        const float t = static_cast<float>(t0 + j);
        if (j >= kt) {
          std::fill(s, s + mp, NEG_INF);
          continue;
        }
        for (int64_t m = 0; m < mp; ++m) s[m] = t <= pos[m] ? s[m] : NEG_INF;
      }
      for (int64_t m = 0; m < mp; ++m) alpha[m] = cmax[m];  // the old max
      for (int64_t j = 0; j < kt; ++j) {
        const float* __restrict s = st + j * mp;
        for (int64_t m = 0; m < mp; ++m) cmax[m] = cmax[m] < s[m] ? s[m] : cmax[m];
      }
      for (int64_t m = 0; m < mp; ++m) {  // alpha = e^(old max - new max): 0 on the first tile
        alpha[m] = fast_exp(alpha[m] - cmax[m]);
        csum[m] *= alpha[m];
      }
      for (int64_t j = 0; j < kt; ++j) {
        float* __restrict s = st + j * mp;
        for (int64_t m = 0; m < mp; ++m) {
          s[m] = fast_exp(s[m] - cmax[m]);  // a masked -inf gives 0
          csum[m] += s[m];
        }
      }
      for (int64_t d = 0; d < dp; ++d) {
        float* __restrict o = w.ot.data() + d * mp;
        for (int64_t m = 0; m < mp; ++m) o[m] *= alpha[m];
      }
      // O^T += V^T P^T: (dp x kt) (kt x mp); V^T is V read with swapped strides.
      gemm(w.v.data(), 1, dp, st, mp, kt, w.ot.data(), mp, dp, mp, true);
    }
    for (int64_t m = 0; m < m_count; ++m) {
      scalar_t* dst = b.o + (q0 + row_begin + m / group) * b.o_st + (h * group + m % group) * b.o_sh;
      const float inv = 1.f / w.col_sum[m];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(w.ot[d * mp + m] * inv);
    }
  }
}

}  // namespace tile
}  // namespace minivllm
