// The SIMD tiles of quant_w8a8.cpp (read its header first: the maths and the blocking).
//
// Written once, compiled once per instruction set: quant_w8a8.cpp includes this file three
// times, each inside its own namespace (avx2, avxvnni, avx512vnni) and its own
// `#pragma GCC target` region, after defining that instruction set's
//   __m256i dot_u8s8(__m256i a, __m256i b)   // lane i: sum_{c < 4} a[4i + c] * b[4i + c]
// (a unsigned, b signed bytes). Hence no include guard, on purpose.

// A line of the next tile's rows, prefetched into L2, or into L1 where run() set
// next_into_l1 (ops.h's prefetch_into_l1 says why each).
inline void prefetch_next_tile(const W8A8Problem& p, const char* line) {
  if (p.next_into_l1) {
    _mm_prefetch(line, _MM_HINT_T0);
  } else {
    _mm_prefetch(line, _MM_HINT_T1);
  }
}

// Lane j of the result: the sum of v[j]'s 8 int32 lanes (exact: integers). Two rounds of
// horizontal adds leave each v[j]'s sum in two halves (lanes 0-3 and 4-7), one per
// 128-bit half; a cross-half add finishes.
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
  // ab = [v0 lo, v1 lo, v2 lo, v3 lo | v0 hi, v1 hi, v2 hi, v3 hi], cd the same for v4..v7
  const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                          _mm256_permute2x128_si256(ab, cd, 0x31));
}

// One group of 32 activations, as quantize_group_portable (the same bits): the largest
// magnitude, then round(x * (1 / s)) by _mm256_cvtps_epi32 (the default rounding mode,
// ties to even), clamped, packed to bytes; returns sum(q).
inline int32_t quantize_group(const float* x, int8_t* q, float* scale) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(x + 8 * c);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[c]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float s = _mm_cvtss_f32(m4) / 127.f;
  const __m256 inv = _mm256_set1_ps(s > 0.f ? 1.f / s : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i r[4];
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv)), lo), hi);
  }
  // int32 -> int8; the packs interleave 128-bit halves, the permute puts them back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                           _mm256_packs_epi32(r[2], r[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  const __m256i total =
      _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  *scale = s;
  return _mm_cvtsi128_si32(t4);
}

// 4-bit group g of a packed row as 32 bytes, weights 0..31 in order (low nibbles, then high).
inline __m256i unpack_group4(const uint8_t* row, int64_t g) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * GROUP / 2));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// 8 x 8 floats, transposed in registers: r[j][c] -> r[c][j].
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// transpose_scales, 8 groups at a time where every group has its own scale (4-bit weights,
// Q8_0-style int8): the tile's (8 rows x groups) scales are read row by row and written
// group by group, an 8 x 8 block in registers at a time.
inline void transpose_scales_simd(const W8A8Problem& p, int64_t n0, int64_t nb, float* sw,
                                  float* mw) {
  if (p.s_groups != p.groups || p.groups < 8) {
    transpose_scales(p, n0, nb, sw, mw);
    return;
  }
  const void* bases[2] = {p.s, p.mn};
  int64_t first[TILE];  // row j's first scale
  for (int64_t j = 0; j < TILE; ++j) first[j] = tile_row(n0, nb, j) * p.groups;
  for (int a = 0; a < (mw == nullptr ? 1 : 2); ++a) {
    float* dst = a == 0 ? sw : mw;
    int64_t g0 = 0;
    for (; g0 + 8 <= p.groups; g0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) {  // 8 scales of row j; float16 widened exactly (F16C)
        const int64_t i = first[j] + g0;
        r[j] = p.half_scales ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                   scale_address(p, bases[a], i))))
                             : _mm256_loadu_ps(static_cast<const float*>(bases[a]) + i);
      }
      transpose8(r);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(dst + (g0 + c) * TILE, r[c]);
    }
    for (; g0 < p.groups; ++g0) {
      for (int64_t j = 0; j < TILE; ++j) dst[g0 * TILE + j] = scale_at(p, bases[a], first[j] + g0);
    }
  }
}

// The float part of group g for 8 weight rows (lane j: row j), in the ref's order, every
// product and sum rounded on its own: acc + (s_x s_w) I, plus m_w sum_x for 4-bit weights.
// isum: the rows' exact integer sums I (|I| < 2^24, so exact as float too); sw, mw: the
// group's 8 transposed scales and minimums; xs, xsum: the row of x's s_x and sum_x.
template <bool INT4>
inline __m256 fold_group(__m256 acc, __m256i isum, float xs, const float* sw, const float* mw,
                         float xsum) {
  const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(xs), _mm256_loadu_ps(sw));
  __m256 term = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum));
  if constexpr (INT4) {
    term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_loadu_ps(mw), _mm256_set1_ps(xsum)));
  }
  return _mm256_add_ps(acc, term);
}

// Tiles t0 .. t1 - 1 (8 weight rows each) for every row of x: y = the ref's sums, bit for
// bit. 4-bit rows are unpacked in registers for one row of x (each group is used once),
// else once per tile into `unpacked` (then read from L1 for every row of x).
template <bool INT4>
void tiles(const W8A8Problem& p, int64_t t0, int64_t t1) {
  constexpr int64_t GROUP_BYTES = INT4 ? GROUP / 2 : GROUP;  // of the stored weight
  const bool unpack_once = INT4 && p.m > 1;
  std::vector<uint8_t> unpacked(unpack_once ? TILE * p.k : 0);  // 4-bit rows, a byte a weight
  std::vector<float> sw(TILE * p.groups), mw(INT4 ? TILE * p.groups : 0);
  const int64_t ss = scale_stride(p);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * TILE, nb = std::min<int64_t>(TILE, p.n - n0);
    transpose_scales_simd(p, n0, nb, sw.data(), INT4 ? mw.data() : nullptr);
    const uint8_t* w[TILE];
    for (int64_t j = 0; j < TILE; ++j) w[j] = p.w + tile_row(n0, nb, j) * p.row_bytes;
    if (unpack_once) {
      for (int64_t j = 0; j < nb; ++j) unpack_row4(w[j], p.k, unpacked.data() + j * p.k);
      for (int64_t j = 0; j < TILE; ++j) w[j] = unpacked.data() + std::min(j, nb - 1) * p.k;
    }
    // The next tile's rows follow this tile's in memory, and so do its scales and minimums:
    // prefetched while row 0 of x runs (a 4-bit row's scales and minimums are half as many
    // bytes as its integers; read cold by transpose_scales_simd, they stalled the tile).
    // The rows go to L2, or on an AMD CPU at one row of x to L1 (prefetch_next_tile).
    const int64_t next_row = std::min<int64_t>(n0 + TILE, p.n - 1);
    const char* next = reinterpret_cast<const char*>(p.w + next_row * p.row_bytes);
    const char* next_s = scale_address(p, p.s, next_row * p.s_groups);
    const char* next_m = INT4 ? scale_address(p, p.mn, next_row * p.groups) : nullptr;
    const int64_t scale_bytes = p.half_scales ? 2 : 4;
    for (int64_t m = 0; m < p.m; ++m) {
      const int8_t* x = p.qx + m * p.k;
      const float* xs = p.xs + m * p.groups;
      __m256 acc = _mm256_setzero_ps();  // lane j: y[m, n0 + j]
      for (int64_t g = 0; g < p.groups; ++g) {
        if (m == 0) {
          for (int64_t b = 0; b < TILE * GROUP_BYTES; b += 64) {
            prefetch_next_tile(p, next + g * TILE * GROUP_BYTES + b);
          }
          if (g < p.s_groups) _mm_prefetch(next_s + g * TILE * scale_bytes, _MM_HINT_T0);
          if constexpr (INT4) _mm_prefetch(next_m + g * TILE * scale_bytes, _MM_HINT_T0);
        }
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * GROUP));
        __m256i v[TILE];  // v[j]: row j's partial sums for this group
        if constexpr (INT4) {  // q_w in 0..15: the unsigned operand
          for (int64_t j = 0; j < TILE; ++j) {
            const __m256i wv = unpack_once ? _mm256_loadu_si256(
                                                 reinterpret_cast<const __m256i*>(w[j] + g * GROUP))
                                           : unpack_group4(w[j], g);
            v[j] = dot_u8s8(wv, xv);
          }
        } else {  // |x| times w * sign(x): the product x * w, with an unsigned operand
          const __m256i ax = _mm256_sign_epi8(xv, xv);
          for (int64_t j = 0; j < TILE; ++j) {
            const __m256i wv =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + g * GROUP));
            v[j] = dot_u8s8(ax, _mm256_sign_epi8(wv, xv));
          }
        }
        acc = fold_group<INT4>(acc, sum_lanes8(v), xs[g], &sw[g * ss],
                               mw.data() + (INT4 ? g * TILE : 0),
                               INT4 ? p.xsum[m * p.groups + g] : 0.f);
      }
      float lanes[TILE];
      _mm256_storeu_ps(lanes, acc);
      for (int64_t j = 0; j < nb; ++j) p.y[m * p.n + n0 + j] = lanes[j];
    }
  }
}
