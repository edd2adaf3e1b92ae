// The AVX2 register tiles of quant.cpp's decode GEMVs (read quant.cpp's header first:
// it says how they are blocked and why). Included by quant.cpp only, inside
// namespace minivllm's anonymous namespace, after GROUP4, NB1, NB1_GROUPED, NB1_INT4,
// NB and MR are defined there.
#pragma once

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
  parallel_for(0, blocks, grain_for(NB_ * t.k), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB_, nb = std::min<int64_t>(NB_, t.n - n0);
      int64_t m0 = 0;
      for (; m0 + MR <= t.m; m0 += MR) tile_mr(t, n0, nb, m0);
      if (m0 < t.m) tile_1(t, n0, nb, m0);
    }
  });
}
#endif
