// The row loop's pieces (attention.cpp): the next key tile's prefetch, p @ V in
// registers, a key tile's rows located through the block table, and one query
// vector's scores against a tile of keys. Split from attention.cpp to keep each file
// readable at one sitting; attention.cpp's header comment explains how they fit.
#pragma once

#include "kv_cache.h"
#include "ops.h"

#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

namespace minivllm {
namespace rows {

constexpr int64_t KEY_TILE = 32;          // keys per online-softmax update
constexpr int64_t MR = 4;                 // query vectors per register block
constexpr int64_t DC = 16;                // head_dim elements per register block of p @ V

// A thread's scratch for the row loop (attention.cpp's run_part), kept from chunk to chunk.
template <typename scalar_t>
struct RowScratch {
  std::vector<float> q_buf, acc, row_max, row_sum, scores, k_buf, v_buf;
  std::vector<int64_t> pos;
  std::vector<scalar_t> staged;     // the row items' outputs, head_dim a query vector
  std::vector<scalar_t*> staged_to; // where each goes
};

// The next key tile's rows of one KV head (K's or V's), asked for a few at a time while
// this tile is computed: blocks sit anywhere in the cache, where no hardware prefetcher
// looks, and a burst of requests per tile stalls on the full miss queue. Into L2
// (locality 2, prefetcht1), like the GEMVs' prefetches: 4-6% faster than into L1 on a
// batch-64 decode on the Xeon (docs/kernels.md); the prefetches still take about half of
// the op's samples there, waiting for memory.
struct Prefetch {
  const char* row[KEY_TILE];
  int64_t count = 0;      // rows of the next tile (0: none)
  int64_t row_bytes = 0;  // head_dim * sizeof(cache_t)
  void rows(int64_t begin, int64_t end) const {
    for (int64_t j = begin; j < std::min(end, count); ++j) {
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row[j] + b, 0, 2);
    }
  }
};

// acc[r][d0 + l] += sum_j p[r][j] * v_j[d0 + l] for MR query vectors and DC
// elements of head_dim: MR x DC accumulators in registers, each V row loaded once.
// With AVX2 the 8 accumulators are named vectors (GCC kept one of the array's in
// memory, a store and a reload per key on the loop's critical path).
inline void pv_block(const float* __restrict p, const float* const* v_rows, int64_t kt,
                     float* __restrict acc, int64_t head_dim, int64_t d0,
                     const Prefetch* prefetch = nullptr) {
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(MR == 4 && DC == 16, "the registers below are 4 vectors x 2 halves");
  float* r0 = acc + d0;
  float* r1 = r0 + head_dim;
  float* r2 = r1 + head_dim;
  float* r3 = r2 + head_dim;
  __m256 a00 = _mm256_loadu_ps(r0), a01 = _mm256_loadu_ps(r0 + 8);
  __m256 a10 = _mm256_loadu_ps(r1), a11 = _mm256_loadu_ps(r1 + 8);
  __m256 a20 = _mm256_loadu_ps(r2), a21 = _mm256_loadu_ps(r2 + 8);
  __m256 a30 = _mm256_loadu_ps(r3), a31 = _mm256_loadu_ps(r3 + 8);
  for (int64_t j = 0; j < kt; ++j) {
    if (prefetch != nullptr) prefetch->rows(j, j + 1);
    const __m256 v0 = _mm256_loadu_ps(v_rows[j] + d0), v1 = _mm256_loadu_ps(v_rows[j] + d0 + 8);
    __m256 pr = _mm256_broadcast_ss(p + j);
    a00 = _mm256_fmadd_ps(pr, v0, a00);
    a01 = _mm256_fmadd_ps(pr, v1, a01);
    pr = _mm256_broadcast_ss(p + KEY_TILE + j);
    a10 = _mm256_fmadd_ps(pr, v0, a10);
    a11 = _mm256_fmadd_ps(pr, v1, a11);
    pr = _mm256_broadcast_ss(p + 2 * KEY_TILE + j);
    a20 = _mm256_fmadd_ps(pr, v0, a20);
    a21 = _mm256_fmadd_ps(pr, v1, a21);
    pr = _mm256_broadcast_ss(p + 3 * KEY_TILE + j);
    a30 = _mm256_fmadd_ps(pr, v0, a30);
    a31 = _mm256_fmadd_ps(pr, v1, a31);
  }
  _mm256_storeu_ps(r0, a00), _mm256_storeu_ps(r0 + 8, a01);
  _mm256_storeu_ps(r1, a10), _mm256_storeu_ps(r1 + 8, a11);
  _mm256_storeu_ps(r2, a20), _mm256_storeu_ps(r2 + 8, a21);
  _mm256_storeu_ps(r3, a30), _mm256_storeu_ps(r3 + 8, a31);
#else
  float a[MR][DC];
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t l = 0; l < DC; ++l) a[r][l] = acc[r * head_dim + d0 + l];
  }
  for (int64_t j = 0; j < kt; ++j) {
    if (prefetch != nullptr) prefetch->rows(j, j + 1);
    const float* v = v_rows[j] + d0;
    for (int64_t r = 0; r < MR; ++r) {
      const float pr = p[r * KEY_TILE + j];
      for (int64_t l = 0; l < DC; ++l) a[r][l] += pr * v[l];
    }
  }
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t l = 0; l < DC; ++l) acc[r * head_dim + d0 + l] = a[r][l];
  }
#endif
}

// Keys t0 .. t0 + count - 1 of a sequence whose block table is `table`: each one's slot
// in the cache (block id * block_size + offset) and its element offset (c_sb, c_ss: the
// cache's block and slot strides).
inline void locate_keys(const int32_t* table, int64_t t0, int64_t count, int64_t block_size,
                        int64_t c_sb, int64_t c_ss, int64_t* slot, int64_t* off) {
  if (count <= 0) return;
  int64_t b = t0 / block_size, r = t0 % block_size;
  for (int64_t j = 0; j < count; ++j) {
    slot[j] = table[b] * block_size + r;
    off[j] = table[b] * c_sb + r * c_ss;
    if (++r == block_size) {
      r = 0;
      ++b;
    }
  }
}

// s[j] = q . k_rows[j] for j < kt. With AVX2, 8 keys at a time: 8 independent FMA
// chains (a single dot product's chain waits on its own FMA latency), whose 8 sums
// come out of one tree of horizontal adds; the rest one key at a time.
inline void score_row(const float* __restrict q, const float* const* k_rows, int64_t kt,
                      int64_t head_dim, float* __restrict s,
                      const Prefetch* prefetch = nullptr) {
  int64_t j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0) {
    for (; j0 + 8 <= kt; j0 += 8) {
      if (prefetch != nullptr) prefetch->rows(j0, j0 + 8);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) {
          acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_rows[j0 + j] + d), acc[j]);
        }
      }
      // [a0..a7] -> lane j = sum of acc[j]: pairs, quads, then the two 128-bit halves.
      const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      _mm256_storeu_ps(s + j0, _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                             _mm256_permute2f128_ps(h0123, h4567, 0x31)));
    }
  }
#endif
  if (prefetch != nullptr) prefetch->rows(j0, KEY_TILE);
  for (int64_t j = j0; j < kt; ++j) s[j] = dot(q, k_rows[j], head_dim);
}

}  // namespace rows
}  // namespace minivllm
